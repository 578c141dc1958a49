"""free_port: the kernel may hand one port to two probes in a row; a plan must never get it twice."""

from __future__ import annotations

import socket

import pytest

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
    monkeypatch.setattr(launcher, "port_partition", None)
    monkeypatch.setattr(socket, "socket", Probe)
    Probe.ports = [41000, 41000, 41000, 41002, 41000, 41002, 41004]
    assert [launcher.free_port() for _ in range(3)] == [41000, 41002, 41004]
    assert Probe.ports == []


def test_a_partition_draws_only_its_own_ports(monkeypatch):
    monkeypatch.setattr(launcher, "_handed_out", set())
    monkeypatch.setattr(launcher, "port_partition", (1, 3))
    monkeypatch.setattr(socket, "socket", Probe)
    # blocks of 16, numbered modulo 3: 41030 is in 2, 41041 and 41001 in 0, 41009 and 41060 in 1
    Probe.ports = [41041, 41030, 41009, 41047, 41060, 41001]
    assert [launcher.free_port() for _ in range(2)] == [41009, 41060]
    assert Probe.ports == [41001]


@pytest.mark.parametrize("partition", [None, (0, 2), (1, 2)])
def test_real_ports_are_free_and_distinct(monkeypatch, partition):
    monkeypatch.setattr(launcher, "port_partition", partition)
    ports = [launcher.free_port() for _ in range(64)]
    if partition is not None:
        assert all(port // 16 % partition[1] == partition[0] for port in ports)
    assert len(set(ports)) == 64
    for port in ports[:4]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
