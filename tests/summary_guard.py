"""Prints a pytest run's summary when pytest itself cannot: run by ``tests/conftest.py`` as a child
process that reads one line per test event on its stdin.

Why: a Ray driver exits the process on its own when the cluster under it dies.  When the GCS is
gone (killed, OOM, a ``ray stop`` elsewhere), the core worker waits 60 s
(``gcs_rpc_server_reconnect_timeout_s``), logs "Failed to connect to GCS ... The program will
terminate" and ends the process with a C-level exit: no Python exception, no ``atexit``, no
``finally`` -- pytest never prints its summary, and the log ends mid-test.  This process outlives
it: when its stdin closes without pytest's clean-end line it prints what pytest would have, from
the events it saw, and names the test that was running.

Protocol (tab-separated lines): ``start <nodeid>``, ``report <nodeid> <when> <outcome>``, ``end``.
"""

from __future__ import annotations

import sys
import time


def summarize(lines) -> str | None:
    """The summary for a stream of protocol lines; None when the stream ends with ``end``."""
    outcomes: dict[str, str] = {}
    running = phase = None
    t0 = time.monotonic()
    for line in lines:
        parts = line.rstrip("\n").split("\t")
        if parts[0] == "end":
            return None
        if parts[0] == "start" and len(parts) == 2:
            running, phase = parts[1], "setup"
        elif parts[0] == "report" and len(parts) == 4:
            nodeid, when, outcome = parts[1:]
            # setup -> call -> teardown; a failed or skipped setup goes straight to teardown
            phase = "call" if (when, outcome) == ("setup", "passed") else "teardown"
            if outcome == "failed":
                outcomes[nodeid] = "failed" if when == "call" else "error"
            elif outcome == "skipped" and nodeid not in outcomes:
                outcomes[nodeid] = "skipped"
            elif when == "call" and nodeid not in outcomes:
                outcomes[nodeid] = "passed"
            if when == "teardown":
                running = None
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    out = ["", "=" * 20 + " pytest ended without its own summary " + "=" * 20,
           "The pytest process was ended from outside Python (a Ray driver whose cluster died exits "
           "this way; so do SIGKILL and the OOM killer)."]
    if running:
        out.append(f"Running at the end: {running} ({phase or 'setup'})")
    out += [f"FAILED {n}" for n, o in outcomes.items() if o == "failed"]
    out += [f"ERROR {n}" for n, o in outcomes.items() if o == "error"]
    tally = ", ".join(f"{counts[k]} {k}" for k in ("failed", "error", "passed", "skipped") if k in counts)
    out.append(f"{tally or 'no tests finished'}; "
               f"{'1 test' if running else 'no test'} unfinished, in {time.monotonic() - t0:.1f}s")
    return "\n".join(out) + "\n"


def main() -> None:
    text = summarize(sys.stdin)
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
