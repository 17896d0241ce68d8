"""The simulator's drives (`sim k3 --drives N`, a store striped as `pack --stripe` lays it): the same bytes per
token as one drive, an even share on every drive, and an I/O-bound token that takes about 1/N of the time."""

from __future__ import annotations

import pytest

from k3serve.sim.device import SimClock, SimDevice, SimStripedIO, VirtualBuffer
from k3serve.sim.full import SimConfig, SimConfigError, minimum_ram, simulate
from k3serve.sim.presets import c_engine_v1
from k3serve.stream.io import Extent


def test_a_striped_read_is_shared_evenly_and_ends_sooner():
    machine = c_engine_v1()
    ends = {}
    for drives in (1, 4):
        clock = SimClock()
        devices = [SimDevice(machine.disk) for _ in range(drives)]
        io = SimStripedIO("experts", clock, devices, 16, 256 << 10)
        extents = [Extent(k * 17_547_264, VirtualBuffer(17_547_264)) for k in range(0, 32, 2)]  # 16 experts
        futures = io.submit(extents)
        ends[drives] = max(f.end for f in futures.values())
        shares = [d.bytes_read for d in devices]
        assert sum(shares) == 16 * 17_547_264 == io.counters.bytes_read
        assert max(shares) - min(shares) <= 16 * (256 << 10)  # within one chunk per expert
    assert ends[4] < 0.3 * ends[1]


def test_drives_move_the_same_bytes_in_a_quarter_of_the_time():
    ram = minimum_ram(trunk_dtype="bf16")
    runs = {n: simulate(SimConfig(machine=c_engine_v1(), ram_bytes=ram, trunk_dtype="bf16", tokens=1, warmup=1,
                                  drives=n)) for n in (1, 4)}
    one, four = runs[1], runs[4]
    assert four.expert_bytes_per_token == one.expert_bytes_per_token
    assert four.trunk_bytes_per_token == one.trunk_bytes_per_token
    assert one.io_seconds_per_token > 10 * one.compute_seconds_per_token  # I/O-bound: drives are the lever
    assert 0.2 < four.s_per_token / one.s_per_token < 0.35
    assert four.floor_io_s_per_token == pytest.approx(one.floor_io_s_per_token / 4, rel=0.1)
    assert four.config["drives"] == 4


def test_zero_drives_is_refused():
    with pytest.raises(SimConfigError, match="drives must be >= 1"):
        SimConfig(machine=c_engine_v1(), drives=0)
