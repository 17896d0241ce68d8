"""The machine model: what a read and a matmul cost, as measured curves, in a JSON or TOML file.

A machine file holds

    name, description, source        who measured what, and how (every preset names its sources)
    [disk]   sizes = [bytes, ...]            request sizes measured (ascending)
             queue_depths = [1, 4, 16, ...]  concurrent requests measured (ascending)
             throughput = [[bytes/s at each queue depth] for each size]   O_DIRECT, aggregate over the requests
    [compute] dense_bytes_per_s       dense (trunk) matrix-vector product, weight bytes per second, batch 1
              dense_flops             dense matrix-matrix product, FLOP/s (large batches)
              expert_bytes_per_s      MXFP4 expert kernel at batch 1, packed weight bytes per second
              expert_flops            MXFP4 expert kernel, FLOP/s (many rows per expert)
              attention_s_per_token_layer   KDA / MLA state work per token per layer (seconds)
              layer_overhead_s        fixed cost per layer per forward step (dispatch, routing, norms)
              widen_bytes_per_s       bf16 -> float32 widening of a streamed trunk layer (k3serve keeps fp32)
    [network] (optional; the cluster mode needs one, from here or `--network`)
              bytes_per_s             payload bytes/s of one node's link, each direction
              call_latency_s          fixed cost of one call, request and reply together (wire, stack, RPC);
                                      the calls of a layer pay it side by side
              call_overhead_s         (optional, default 0) the caller's own work per call (submitting and
                                      collecting it: serialisation, the RPC client), one call after another

Time of a read of n bytes while k requests (itself included) are in flight on the device:

    t(n, k) = n / (throughput(n, k) / k)

with throughput interpolated linearly in log(size) and log(queue depth) and held flat beyond the measured
range. Time of a matrix product of W weight bytes and F FLOPs: max(W / bytes_per_s, F / flops). Time of a call
carrying b bytes one way: b / bytes_per_s on the link, call_overhead_s / 2 of the caller's work (its calls queue
for it), and half the call latency.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from k3serve.errors import K3Error


class MachineError(K3Error):
    """A machine file is missing, malformed or physically impossible."""


def _positive(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise MachineError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation in log(x), flat outside [xs[0], xs[-1]]."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            a, b = math.log(xs[i - 1]), math.log(xs[i])
            w = (math.log(x) - a) / (b - a)
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


@dataclass(frozen=True)
class DiskModel:
    sizes: tuple[int, ...]
    queue_depths: tuple[int, ...]
    throughput: tuple[tuple[float, ...], ...]  # bytes/s, [size][queue depth]

    def __post_init__(self) -> None:
        if not self.sizes or not self.queue_depths:
            raise MachineError("disk.sizes and disk.queue_depths must not be empty")
        for name, values in (("disk.sizes", self.sizes), ("disk.queue_depths", self.queue_depths)):
            for v in values:
                _positive(name, v)
            if list(values) != sorted(set(values)):
                raise MachineError(f"{name} must be strictly ascending, got {list(values)}")
        if len(self.throughput) != len(self.sizes) or any(len(r) != len(self.queue_depths) for r in self.throughput):
            raise MachineError(f"disk.throughput must be {len(self.sizes)} rows (sizes) of "
                               f"{len(self.queue_depths)} values (queue depths)")
        for row in self.throughput:
            for v in row:
                _positive("disk.throughput", v)

    def bandwidth(self, nbytes: int, in_flight: int) -> float:
        """Aggregate bytes/s of `in_flight` concurrent requests of `nbytes` each."""
        qd = [float(q) for q in self.queue_depths]
        per_size = [_interp(qd, list(row), float(max(in_flight, 1))) for row in self.throughput]
        return _interp([float(s) for s in self.sizes], per_size, float(max(nbytes, 1)))

    def read_seconds(self, nbytes: int, in_flight: int) -> float:
        k = max(in_flight, 1)
        return nbytes * k / self.bandwidth(nbytes, k)


@dataclass(frozen=True)
class ComputeModel:
    dense_bytes_per_s: float
    dense_flops: float
    expert_bytes_per_s: float
    expert_flops: float
    attention_s_per_token_layer: float
    layer_overhead_s: float
    widen_bytes_per_s: float

    def __post_init__(self) -> None:
        for name in ("dense_bytes_per_s", "dense_flops", "expert_bytes_per_s", "expert_flops", "widen_bytes_per_s"):
            _positive(f"compute.{name}", getattr(self, name))
        for name in ("attention_s_per_token_layer", "layer_overhead_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise MachineError(f"compute.{name} must be a number >= 0, got {value!r}")

    def dense_seconds(self, weight_bytes: float, flops: float) -> float:
        return max(weight_bytes / self.dense_bytes_per_s, flops / self.dense_flops)

    def expert_seconds(self, weight_bytes: float, flops: float) -> float:
        return max(weight_bytes / self.expert_bytes_per_s, flops / self.expert_flops)


@dataclass(frozen=True)
class NetworkModel:
    bytes_per_s: float  # payload bytes/s of one node's link, each direction
    call_latency_s: float  # fixed cost of one call, request and reply together; a layer's calls overlap it
    call_overhead_s: float = 0.0  # the front's own work per call, request and reply together; calls queue for it

    def __post_init__(self) -> None:
        _positive("network.bytes_per_s", self.bytes_per_s)
        for key in ("call_latency_s", "call_overhead_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise MachineError(f"network.{key} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class Machine:
    name: str
    disk: DiskModel
    compute: ComputeModel
    description: str = ""
    source: str = ""
    extra: dict = field(default_factory=dict)  # free-form notes kept with the file (probe settings, ...)
    network: NetworkModel | None = None  # the link between nodes (cluster mode)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["disk"] = {"sizes": list(self.disk.sizes), "queue_depths": list(self.disk.queue_depths),
                       "throughput": [list(r) for r in self.disk.throughput]}
        return out

    @staticmethod
    def from_dict(raw: Any, where: str = "machine") -> Machine:
        if not isinstance(raw, dict):
            raise MachineError(f"{where}: a machine must be a table / object, got {type(raw).__name__}")
        for key in ("name", "disk", "compute"):
            if key not in raw:
                raise MachineError(f"{where}: missing key {key!r} (a machine file needs name, disk and compute)")
        disk, compute = raw["disk"], raw["compute"]
        if not isinstance(disk, dict) or not isinstance(compute, dict):
            raise MachineError(f"{where}: disk and compute must be tables")
        for key in ("sizes", "queue_depths", "throughput"):
            if key not in disk:
                raise MachineError(f"{where}: missing key disk.{key}")
        wanted = [f.name for f in ComputeModel.__dataclass_fields__.values()]
        missing = [k for k in wanted if k not in compute]
        if missing:
            raise MachineError(f"{where}: missing key(s) {', '.join('compute.' + k for k in missing)}")
        unknown = sorted(set(compute) - set(wanted))
        if unknown:
            raise MachineError(f"{where}: unknown key(s) {', '.join('compute.' + k for k in unknown)}")
        try:
            disk_model = DiskModel(tuple(int(s) for s in disk["sizes"]), tuple(int(q) for q in disk["queue_depths"]),
                                   tuple(tuple(float(v) for v in row) for row in disk["throughput"]))
        except (TypeError, ValueError) as exc:
            raise MachineError(f"{where}: disk curves must be lists of numbers: {exc}") from exc
        return Machine(str(raw["name"]), disk_model, ComputeModel(**{k: compute[k] for k in wanted}),
                       str(raw.get("description", "")), str(raw.get("source", "")), dict(raw.get("extra", {})),
                       _network(raw.get("network"), where))


def _network(raw: Any, where: str) -> NetworkModel | None:
    if raw is None:
        return None
    wanted, optional = {"bytes_per_s", "call_latency_s"}, {"call_overhead_s"}
    if not isinstance(raw, dict) or not wanted <= set(raw) <= wanted | optional:
        raise MachineError(f"{where}: network must be a table with bytes_per_s and call_latency_s (and optionally "
                           f"call_overhead_s), got {raw!r}")
    return NetworkModel(**raw)


def load_machine(path: str | Path) -> Machine:
    """A machine from a .json or .toml file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise MachineError(f"cannot read machine file {path}: {exc}") from exc
    try:
        if path.suffix.lower() == ".toml":
            import tomllib
            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - json and toml raise different types; both mean a malformed file
        raise MachineError(f"{path}: not valid {path.suffix.lstrip('.') or 'json'}: {exc}") from exc
    return Machine.from_dict(raw, str(path))


def save_machine(machine: Machine, path: str | Path) -> None:
    Path(path).write_text(json.dumps(machine.to_dict(), indent=1) + "\n")
