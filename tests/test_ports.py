"""``ray_attn.ports``: ports for the servers and clusters that scripts and tests start on loopback.
Asked for one at a time, the OS may hand out a port again as soon as it was let go; a ``ray start
--head`` given one port for two of its components then refused to start (a CI run)."""

from __future__ import annotations

import socket

from ray_attn import ports


class ReusingSocket:
    """A socket whose OS gives out the lowest port no live socket holds: the worst case of a real
    one, which may repeat a port the moment it is closed."""

    live: set[int] = set()

    def __init__(self, *a):
        self.port = None

    def bind(self, addr):
        self.port = next(p for p in range(40000, 40100) if p not in ReusingSocket.live)
        ReusingSocket.live.add(self.port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        ReusingSocket.live.discard(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_ports_asked_together_are_distinct_and_avoid_the_promised(monkeypatch):
    monkeypatch.setattr(socket, "socket", ReusingSocket)
    assert ports.loopback_port() == ports.loopback_port()  # what one at a time can give
    assert ports.loopback_ports(4) == [40000, 40001, 40002, 40003]
    assert ports.loopback_ports(2, avoid=[40000, 40002]) == [40001, 40003]
    assert not ReusingSocket.live  # every socket it held is closed


def test_real_ports_are_free_and_distinct():
    got = ports.loopback_ports(5)
    assert len(set(got)) == 5
    for p in got:  # each can be bound now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
