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
