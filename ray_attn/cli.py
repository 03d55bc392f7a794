"""``ray-attn``: the main job (``demo``, in ``ray_attn.demo``) and small utilities.

``ray-attn serve`` is the deployment layer's own command (``ray_attn.serve.cli``): this module,
the entry point, is the one library module that reaches into ``ray_attn.serve``."""

from __future__ import annotations

import argparse
import sys

from ray_attn import demo
from ray_attn.serve import cli as serve_cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ray-attn")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="a real model answering chat questions through TP workers, checked against "
                                     "a single process and HF; then shared prompts with cascade and local attention")
    demo.add_arguments(d)
    s = sub.add_parser("serve", help="serve a checkpoint folder or GGUF file (default: SmolLM2-135M-Instruct) "
                                     "with the OpenAI API on Ray Serve")
    serve_cli.add_arguments(s)
    args = p.parse_args(argv)
    try:
        if args.cmd == "demo":
            return demo.run_demo(args)
        if args.cmd == "serve":
            return serve_cli.run(args)
    except (ValueError, RuntimeError, OSError) as e:  # bad arguments or an unusable cluster: one line
        p.error(one_line(e))
    return 2


def one_line(e: Exception) -> str:
    """A config error as the user should read it: the field and why, not a pydantic traceback."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        return f"{where}: {msg}" if where else msg
    return str(e).splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
