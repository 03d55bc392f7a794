"""Starting the tests' own local Ray, on a machine that may be busy.

Ray gives a starting raylet a fixed 30 s to register with the GCS (``ray/_private/node.py``, not a
setting in Ray 2.60); beside a CPU hog on two cores that is sometimes not enough, and ``ray.init``
raises "The current node timed out during startup".  Nothing of the test is at fault then, so the
start is tried again (after shutting down what the failed one left), a few times.
"""

from __future__ import annotations

import ray

ATTEMPTS = 3


def init_local_ray(**kwargs) -> None:
    """``ray.init(address="local", **kwargs)``, tried again when the node times out at start."""
    for attempt in range(ATTEMPTS):
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as e:  # noqa: BLE001 -- Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == ATTEMPTS - 1:
                raise
            ray.shutdown()
