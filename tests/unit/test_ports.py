"""free_port: the kernel may hand one port to two probes in a row; a plan must never get it twice."""

from __future__ import annotations

import socket

from specdec import launcher


class Probe:
    """A socket whose bind(0) lands on the next port of a scripted sequence."""

    ports: list[int] = []

    def __init__(self, *args) -> None:
        self.port = 0

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def bind(self, address) -> None:
        self.port = Probe.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_repeats_is_drawn_again(monkeypatch):
    monkeypatch.setattr(launcher, "_handed_out", set())
    monkeypatch.setattr(socket, "socket", Probe)
    Probe.ports = [41000, 41000, 41000, 41002, 41000, 41002, 41004]
    assert [launcher.free_port() for _ in range(3)] == [41000, 41002, 41004]
    assert Probe.ports == []


def test_real_ports_are_free_and_distinct():
    ports = [launcher.free_port() for _ in range(64)]
    assert len(set(ports)) == 64
    for port in ports[:4]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
