"""Why an app is not running yet: a replica that cannot be placed is named with what it asked
for, instead of ``serve.run`` waiting in silence.

Serve keeps a deployment's replicas pending while no node can hold their placement group (a
missing GPU, a node lost, every ``replica_resource`` unit taken).  It says so itself only
sometimes: after ``RAY_SERVE_SLOW_STARTUP_WARNING_S`` (30 s), and not at all while the
deployment is UNHEALTHY (a replica lost with its node leaves it so, and that message stays).
So ``placement_report`` works it out from the nodes: a replica needs its bundles on one node
(``STRICT_PACK``); if no node has that much it can never start, and if every node that could
is full it waits for one.  ``pending_messages`` gives Serve's messages and that report;
``DeployReporter`` prints each new one while a ``serve.run`` blocks (``ray-attn serve``).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional


DEPLOYMENT = "LLMServer"


def pending_messages(app: str, bundles: Optional[list[dict]] = None) -> list[str]:
    """Serve's status messages of ``app``'s deployments that are not healthy, and with the
    replicas' ``bundles``, the ``placement_report`` ([] when all runs)."""
    from ray import serve

    st = serve.status().applications.get(app)
    if st is None:
        return []
    out = [f"{name}: {d.message}" for name, d in st.deployments.items() if d.message and d.status != "HEALTHY"]
    report = placement_report(app, bundles, st) if bundles else None
    return out + ([report] if report else [])


def placement_report(app: str, bundles: list[dict], status=None) -> Optional[str]:
    """Why ``app``'s replicas that are not running wait, from the nodes' resources; None when
    none waits or a node has room (it is starting)."""
    import ray
    from ray import serve

    st = status or serve.status().applications.get(app)
    dep = st.deployments.get(DEPLOYMENT) if st is not None else None
    waiting = sum(n for state, n in (dep.replica_states if dep else {}).items() if state != "RUNNING")
    if not waiting:
        return None
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    total = ray._private.state.total_resources_per_node()
    free = ray._private.state.available_resources_per_node()

    def fits(res: dict) -> bool:
        return all(res.get(k, 0) + 1e-9 >= v for k, v in need.items())

    could = [n for n, res in total.items() if fits(res)]
    head = (f"{DEPLOYMENT} in app '{app}': {waiting} replica(s) wait for a node; each needs {need} "
            f"on one node (bundles {bundles}, STRICT_PACK)")
    if not could:
        return f"{head}, and no node has that much: {_nodes(total)}"
    if not any(fits(free.get(n, {})) for n in could):
        return f"{head}; the {len(could)} node(s) that could hold one are full (free: {_nodes({n: free.get(n, {}) for n in could})})"
    return None


def _nodes(per_node: dict) -> str:
    return "; ".join(f"{n[:8]}: {dict(sorted((k, round(v, 2)) for k, v in r.items() if not k.startswith(('node:', 'memory', 'object_store'))))}"
                     for n, r in per_node.items())


class DeployReporter:
    """While entered, prints each new pending message of ``app`` every ``every_s`` seconds."""

    def __init__(self, app: str, bundles: Optional[list[dict]] = None, every_s: float = 5.0,
                 report: Callable[[str], None] = print):
        self.app, self.bundles, self.every_s, self.report = app, bundles, every_s, report
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.seen: set[str] = set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                messages = pending_messages(self.app, self.bundles)
            except Exception:  # noqa: BLE001 - the controller starting or gone: nothing to say yet
                continue
            for m in messages:
                if m not in self.seen:
                    self.seen.add(m)
                    self.report(f"ray_attn: app '{self.app}' is not running yet -- {m}")

    def __enter__(self) -> "DeployReporter":
        self._thread = threading.Thread(target=self._run, name="deploy-reporter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.every_s + 5)


__all__ = ["DeployReporter", "pending_messages", "placement_report"]
