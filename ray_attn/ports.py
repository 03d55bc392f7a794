"""Free TCP ports, asked of the OS: for the TP group's rendezvous (``runtime/rendezvous.py``) and
for the servers and clusters that scripts and tests start on loopback.  No imports beyond the
standard library, so that a client script can take one without loading torch."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` right now (every interface by default)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_port() -> int:
    """A TCP port free on loopback, where the scripts and tests start their servers and clusters."""
    return free_port("127.0.0.1")


def loopback_ports(n: int, avoid=()) -> list[int]:
    """``n`` distinct TCP ports free on loopback right now, none of them in ``avoid``.

    Each is held until all are chosen: asked for one at a time, the OS may hand out the same port
    twice, and a ``ray start --head`` given one port for two of its components refuses to start
    ("dashboard_agent_http is trying to use a port number ... used by other components").
    ``avoid``: ports already promised to a process that has not bound them yet."""
    held: list[socket.socket] = []
    avoid = set(avoid)
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()
