"""`distributed.free_port`: a port another process can bind later, picked below the kernel's ephemeral range (where
outgoing connections and `bind(0)` take theirs), skipping one in use, and not repeated by a reseeded generator."""
import random
import socket

import pytest

from megatron_ais import distributed


def _floor():
    floor = distributed._ephemeral_port_floor()
    if floor is None or floor <= distributed.LOWEST_PICKED_PORT:
        pytest.skip("this kernel does not say its ephemeral port range")
    return floor


def test_port_is_below_the_ephemeral_range_and_bindable():
    floor = _floor()
    port = distributed.free_port()
    assert distributed.LOWEST_PICKED_PORT <= port < floor
    with socket.socket() as s:
        s.bind(("", port))


def test_a_port_in_use_is_skipped(monkeypatch):
    _floor()
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        busy = held.getsockname()[1]
        picks = [busy]

        class Picker:  # the busy port first, then the real picker's
            def randrange(self, low, high):
                return picks.pop() if picks else random.SystemRandom().randrange(low, high)

        monkeypatch.setattr(distributed, "_port_picker", Picker())
        assert distributed.free_port() != busy


def test_seeding_the_global_generator_does_not_repeat_ports():
    _floor()
    random.seed(0)
    first = [distributed.free_port() for _ in range(4)]
    random.seed(0)
    assert [distributed.free_port() for _ in range(4)] != first


def test_without_the_range_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(distributed, "EPHEMERAL_PORTS_FILE", str(tmp_path / "missing"))
    port = distributed.free_port()
    with socket.socket() as s:
        s.bind(("", port))
