"""The package's import graph, read from the source (ast, nothing imported): the library never
imports the deployment layer (``ray_attn.serve``), and no ``ray_attn`` module imports itself round
a circle -- counting imports inside functions, which only postpone a circle to the first call.

An import under ``if TYPE_CHECKING:`` counts too: it never runs, but two modules that name each
other's types are one module in two files, and the next runtime import between them closes the
circle (``config`` <-> ``hf_config`` and ``planner.kv_cache`` <-> ``planner.step_prefix`` were such
pairs; the first now writes config.json from ``hf_export``, the second names what it reads of its
owner in a Protocol).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ray_attn"
SERVE = "ray_attn.serve"
# The ``ray-attn`` entry point is the one library module that may reach the deployment layer: its
# ``serve`` subcommand hands over to ``ray_attn.serve.cli``.
SERVE_CALLERS = {"ray_attn.cli": {"ray_attn.serve.cli"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_nodes(node: ast.AST):
    """Every Import/ImportFrom below ``node``: function bodies and TYPE_CHECKING blocks included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _target(name: str) -> str | None:
    """The ``ray_attn`` module that importing ``name`` runs last (its longest existing prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_of(module: str) -> set[str]:
    """The ``ray_attn`` modules ``module`` imports.  ``from pkg import name`` counts ``pkg.name``
    when that is a module, else ``pkg`` itself (its ``__init__`` defines the name)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                     for alias in node.names]
        out.update(t for t in map(_target, names) if t and t != module)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_graph_sees_lazy_and_relative_imports():
    # A function-level import and a relative one are both edges; the walk would otherwise pass a
    # tree whose circles only close at the first call.
    assert "ray_attn.serve.cli" in GRAPH["ray_attn.cli"]
    assert "ray_attn.planner.block_pool" in GRAPH["ray_attn.planner.kv_cache"]
    assert len(MODULES) > 50 and "ray_attn.serve.openai.chat" in MODULES


def test_the_graph_sees_type_checking_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ray_attn.config import X\n")
    assert [n.module for n in _import_nodes(tree) if isinstance(n, ast.ImportFrom)] == ["typing", "ray_attn.config"]


def test_the_library_never_imports_the_deployment_layer():
    wrong = {}
    for module, targets in GRAPH.items():
        if module == SERVE or module.startswith(SERVE + "."):
            continue
        reached = {t for t in targets if t == SERVE or t.startswith(SERVE + ".")}
        reached -= SERVE_CALLERS.get(module, set())
        if reached:
            wrong[module] = sorted(reached)
    assert not wrong, f"library modules importing {SERVE}: {wrong}"


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_cycle_finder_finds_a_circle_through_a_package():
    graph = {"a": {"a.b"}, "a.b": {"a.c"}, "a.c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "a.b", "a.c"]]


def test_the_http_side_starts_without_torch():
    """Serve's proxy callback (loaded by every node's proxy), the HTTP front, the app module a
    deploying driver imports and the config import no torch: each such process would pay torch's
    import (~1.6 s on two cores) for nothing.  A replica imports it with the engine, when it
    builds one.  Measured in a fresh interpreter, where nothing imported it yet."""
    import subprocess
    import sys

    mods = ["ray_attn.serve.proxy_auth", "ray_attn.serve.ingress", "ray_attn.serve.app", "ray_attn.config",
            "ray_attn.lora"]
    code = (f"import sys\nfor m in {mods!r}:\n    __import__(m)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=PACKAGE.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
