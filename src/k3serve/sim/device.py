"""The discrete-event clock and the simulated device: reads cost time from the machine model, not bytes.

- `SimClock`: one compute thread's time. `advance(dt)` is compute; `wait_until(t)` is blocking on a read;
  `wait_for_calls(t)` is blocking on other nodes (cluster mode); `idle_until(t)` is a node with nothing to do.
- `SimCores`: cores shared by the processes of one machine (the cluster mode on one box).
- `SimDevice`: one first-come-first-served server for every engine; a run submitted at time s by an engine with
  queue depth Q arrives when one of that engine's Q workers is free and takes n / throughput(n, k) of device
  time, k = runs outstanding at its arrival. Deterministic: no randomness, no wall clock.
- `SimIOEngine`: an `IOEngine` whose runs are the engine's own (`k3serve.stream.io.coalesce`: offset order,
  adjacent extents merged) but whose reads are scheduled on the device. Its futures are `SimFuture`s: `done()`
  says whether the simulated read has finished by now, `result()` advances the clock to its end.
- `SimStripedIO`: the `StripedIO` of a store striped over several drives (`--drives N`): the same virtual runs,
  each split into each drive's share (`k3serve.weights.stripes.drive_shares`), read in parts of up to
  `max_coalesce_bytes` as the live reader cuts it, each drive with its own workers (a queue per device) and its
  own `SimDevice`; a run ends when its last share does.
"""

from __future__ import annotations

import heapq
from concurrent.futures import Future
from typing import Sequence

from k3serve.sim.machine import DiskModel
from k3serve.stream.io import DEFAULT_MAX_COALESCE_BYTES, Extent, IOCounters, coalesce
from k3serve.weights.stripes import drive_shares


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.io_wait = 0.0  # seconds the compute thread spent blocked on reads
        self.remote_wait = 0.0  # seconds blocked on calls to other nodes
        self.compute = 0.0

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds
        self.compute += seconds

    def wait_until(self, t: float) -> None:
        if t > self.now:
            self.io_wait += t - self.now
            self.now = t

    def wait_for_calls(self, t: float) -> None:
        if t > self.now:
            self.remote_wait += t - self.now
            self.now = t

    def idle_until(self, t: float) -> None:
        self.now = max(self.now, t)


class SimCores:
    """CPU cores shared by several simulated processes on one machine (the cluster mode's one-box stand-in): a
    compute segment waits for the first core free, first come first served, then holds it."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a machine needs at least one core, got {count}")
        self._free = [0.0] * count  # heap of the times each core is next free

    def run(self, clock: SimClock, seconds: float) -> None:
        free = heapq.heappop(self._free)
        clock.idle_until(free)
        clock.advance(seconds)
        heapq.heappush(self._free, clock.now)


class SimFuture(Future):
    """A read that ends at `end` on the simulated clock."""

    def __init__(self, clock: SimClock, end: float, value: object) -> None:
        super().__init__()
        self.clock = clock
        self.end = end
        self.set_result(value)

    def done(self) -> bool:
        return self.clock.now >= self.end

    def result(self, timeout: float | None = None) -> object:
        self.clock.wait_until(self.end)
        return super().result(timeout)


class SimDevice:
    """One device shared by every engine: a single server whose service time for a request of n bytes is
    n / throughput(n, k), k = the requests outstanding on the device when it arrives (itself included), served
    first come first served. Aggregate throughput therefore never exceeds the measured curve at that queue
    depth, and a lone request pays its queue-depth-1 latency."""

    def __init__(self, disk: DiskModel) -> None:
        self.disk = disk
        self._free_at = 0.0
        self._ends: list[float] = []  # end times of outstanding requests (a heap)
        self.busy_seconds = 0.0
        self.bytes_read = 0
        self.num_reads = 0

    def schedule(self, arrival: float, nbytes: int, batch: int = 1, rate: float | None = None) -> float:
        """`batch`: requests submitted together with this one (up to the engine's queue depth), which the device
        sees queued at once. `rate`: bytes/s this request is served at instead of the curve's (a stream whose
        delivered rate a run's own counters recorded)."""
        while self._ends and self._ends[0] <= arrival:
            heapq.heappop(self._ends)
        k = max(len(self._ends) + 1, batch)
        service = nbytes / (rate if rate is not None else self.disk.bandwidth(nbytes, k))
        start = max(arrival, self._free_at)
        end = start + service
        self._free_at = end
        heapq.heappush(self._ends, end)
        self.busy_seconds += service
        self.bytes_read += nbytes
        self.num_reads += 1
        return end


class _SimReader:
    """What both simulated readers share: coalesce a submission into runs, give each run one future that completes
    when its last byte is in (`_run_end`), and never fail a checksum."""

    clock: SimClock
    queue_depth: int
    max_coalesce_bytes: int

    def _run_end(self, run: Sequence[Extent], batch: int) -> float:
        raise NotImplementedError

    def submit(self, extents: Sequence[Extent]) -> dict[int, Future]:
        futures: dict[int, Future] = {}
        runs = coalesce(extents, self.max_coalesce_bytes)
        batch = min(len(runs), self.queue_depth)
        for run in runs:
            future = SimFuture(self.clock, self._run_end(run, batch), [])
            for extent in run:
                futures[id(extent)] = future
        return futures

    def read_now(self, extent: Extent) -> list[Extent]:
        raise AssertionError("simulated reads never fail their checksum")


class SimIOEngine(_SimReader):
    """The `ExpertIO` of the simulator (and the trunk's): same runs as `IOEngine`, reads on the device."""

    def __init__(self, name: str, clock: SimClock, device: SimDevice, queue_depth: int,
                 max_coalesce_bytes: int = DEFAULT_MAX_COALESCE_BYTES, rate: float | None = None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"a stream's read rate must be positive, got {rate}")
        self.path = name
        self.rate = rate  # bytes/s for every read of this engine (None: the disk curve)
        self.mode = "direct"
        self.clock = clock
        self.device = device
        self.queue_depth = queue_depth
        self.max_coalesce_bytes = max_coalesce_bytes
        self.counters = IOCounters()
        self._workers = [0.0] * queue_depth  # heap of the times each worker is next free

    def schedule(self, nbytes: int, batch: int) -> float:
        """One read of `nbytes` on the next free worker; returns its end."""
        free = heapq.heappop(self._workers)
        end = self.device.schedule(max(self.clock.now, free), nbytes, batch, self.rate)
        heapq.heappush(self._workers, end)
        self.counters.bytes_read += nbytes
        self.counters.num_reads += 1
        return end

    def _run_end(self, run: Sequence[Extent], batch: int) -> float:
        return self.schedule(sum(len(e.buffer) for e in run), batch)


class SimStripedIO(_SimReader):
    """The `ExpertIO` (and trunk reader) of a store striped over `devices`: one `SimIOEngine` per drive."""

    def __init__(self, name: str, clock: SimClock, devices: Sequence[SimDevice], queue_depth: int, chunk_bytes: int,
                 max_coalesce_bytes: int = DEFAULT_MAX_COALESCE_BYTES, rate: float | None = None) -> None:
        self.path = name
        self.mode = "direct"
        self.clock = clock
        self.chunk_bytes = chunk_bytes
        self.queue_depth = queue_depth
        self.max_coalesce_bytes = max_coalesce_bytes
        self.drives = [SimIOEngine(f"{name} drive {k}", clock, device, queue_depth, max_coalesce_bytes, rate)
                       for k, device in enumerate(devices)]

    @property
    def counters(self) -> IOCounters:
        total = IOCounters()
        for drive in self.drives:
            total.bytes_read += drive.counters.bytes_read
            total.num_reads += drive.counters.num_reads
        return total

    def _run_end(self, run: Sequence[Extent], batch: int) -> float:
        nbytes = sum(len(e.buffer) for e in run)
        shares = drive_shares(run[0].offset, nbytes, self.chunk_bytes, len(self.drives))
        end = 0.0
        for drive, share in zip(self.drives, shares):
            # a drive's chunks of a run are adjacent: the reader sends them as reads of up to
            # max_coalesce_bytes, issued on that drive's workers together
            count = -(-share // self.max_coalesce_bytes)
            for i in range(count):
                part = share // count + (1 if i < share % count else 0)
                end = max(end, drive.schedule(part, max(batch, min(count, self.queue_depth))))
        return end


class VirtualBuffer:
    """Stands in for a slot's buffer: only its length (the read length) matters to the I/O path."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes
