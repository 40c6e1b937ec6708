"""cluster/processes.py: the ports it hands out."""
from __future__ import annotations

import socket

from cluster import processes
from cluster.processes import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    ephemeral = processes._ephemeral_range()
    if ephemeral is not None and ephemeral[0] - processes._PORTS_FROM >= 1000:
        # an outgoing connection never takes one of these as its local port (nor connects to itself on it)
        assert all(processes._PORTS_FROM <= p < ephemeral[0] for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_held_is_never_handed_out(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    try:
        monkeypatch.setattr(processes, "_ephemeral_range", lambda: (taken + 1, taken + 2))
        monkeypatch.setattr(processes, "_PORTS_FROM", taken + 1 - 1000)  # the range to draw from ends at `taken`
        drawn = {free_port() for _ in range(20)}
        assert taken not in drawn
    finally:
        held.close()


def test_without_a_readable_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(processes, "_ephemeral_range", lambda: None)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
