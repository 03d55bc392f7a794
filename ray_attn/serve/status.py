"""Why an app is not running yet, in Serve's words: a replica that cannot be placed is named with
what it asked for, instead of ``serve.run`` waiting in silence.

Serve keeps a deployment's replicas pending while no node can hold their placement group (a
missing GPU, a node lost, every ``replica_resource`` unit taken) and, after
``RAY_SERVE_SLOW_STARTUP_WARNING_S`` (30 s), says so in the deployment's status message: the
deployment, the app, how many replicas, the resources each needs and what the cluster has.
``pending_messages`` reads those messages; ``DeployReporter`` prints each new one while a
``serve.run`` blocks (``ray-attn serve``).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional


def pending_messages(app: str) -> list[str]:
    """The status messages of ``app``'s deployments that are not healthy yet ([] when running)."""
    from ray import serve

    st = serve.status().applications.get(app)
    if st is None or st.status == "RUNNING":
        return []
    return [f"{name}: {d.message}" for name, d in st.deployments.items()
            if d.message and d.status != "HEALTHY"]


class DeployReporter:
    """While entered, prints each new pending message of ``app`` every ``every_s`` seconds."""

    def __init__(self, app: str, every_s: float = 5.0, report: Callable[[str], None] = print):
        self.app, self.every_s, self.report = app, every_s, report
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.seen: set[str] = set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                messages = pending_messages(self.app)
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


__all__ = ["DeployReporter", "pending_messages"]
