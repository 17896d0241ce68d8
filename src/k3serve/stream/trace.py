"""Routing traces: every (step, token, layer, experts) the router chose, one line per token and MoE layer.

File format (text, one record per line):

    # k3serve-trace 1 {"num_layers": L, "num_experts": NE, "top_k": TOPK, "expert_bytes": B, ...}
    STEP TOKEN LAYER E1 E2 ... ETOPK

STEP numbers forward passes (a prefill is one step, each decode one more); TOKEN numbers tokens over the whole
run. A step's request for a layer is the union of its tokens' experts: that is what a source must load.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping

import numpy as np

from k3serve.atomic_file import naming, temporary_sibling
from k3serve.errors import K3Error
from k3serve.model.weights import ForwardingSource, WeightSource

logger = logging.getLogger(__name__)

TRACE_MAGIC = "# k3serve-trace 1 "


class TraceError(K3Error):
    """A routing trace file is missing or malformed."""


@dataclass
class Trace:
    meta: dict
    records: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)  # (step, token, layer, ids)

    @property
    def num_tokens(self) -> int:
        return len({r[1] for r in self.records})

    @property
    def num_steps(self) -> int:
        return len({r[0] for r in self.records})

    def requests(self) -> list[tuple[int, int, list[int]]]:
        """(step, layer, sorted union of experts) in the order a forward pass issues them."""
        merged: dict[tuple[int, int], set[int]] = {}
        for step, _, layer, ids in self.records:
            merged.setdefault((step, layer), set()).update(ids)
        return [(s, l, sorted(ids)) for (s, l), ids in merged.items()]

    def token_sets(self) -> dict[int, list[tuple[int, ...]]]:
        out: dict[int, list[tuple[int, ...]]] = {}
        for _, _, layer, ids in self.records:
            out.setdefault(layer, []).append(ids)
        return out

    def popularity(self) -> Counter:
        """Requests per (layer, expert), counting a step's union once (what a cache sees)."""
        counts: Counter = Counter()
        for _, layer, ids in self.requests():
            counts.update((layer, e) for e in ids)
        return counts


class TraceWriter:
    """Writes a trace file. With `best_effort` (`--trace-out` beside `generate` and `serve`) a write error never
    reaches the forward pass that routed the tokens: the writer logs one warning naming the file and the error,
    cuts the file back to its last whole record (a readable trace), stops, and counts every record it could not
    write in `dropped_records`. Without it (routing-stats, the lab, whose output is the trace) the error is raised.

    A best-effort trace is whole or absent under its name (k3serve/atomic_file.py): it is written to a temporary
    file beside it (`.NAME.XXXX.tmp`) and renamed when the writer closes (at the end of the command, or at exit),
    so a killed process never leaves a torn trace under the name it was given. The callers without `best_effort`
    write to their own staging file already."""

    def __init__(self, path: str | Path, meta: Mapping[str, object], best_effort: bool = False) -> None:
        self.path = Path(path)
        self.best_effort = best_effort
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writing = temporary_sibling(self.path) if best_effort else self.path  # renamed to `path` at close
        try:
            with naming(self.path):
                self._file: IO[bytes] | None = open(self._writing, "wb")
                self._file.write((TRACE_MAGIC + json.dumps(dict(meta), sort_keys=True) + "\n").encode())
                self._file.flush()  # a disk full at start fails the command at start, naming the file
        except BaseException:
            if self._writing != self.path:
                self._writing.unlink(missing_ok=True)
            raise
        self._bytes_written = self._file.tell()  # NOTE: the file's length up to its last whole record
        self.num_records = 0
        self.dropped_records = 0
        self.error: OSError | None = None  # the write error that stopped a best-effort trace
        atexit.register(self.close)  # flush a trace even when the caller never closes the source

    def write(self, step: int, first_token: int, layer: int, expert_ids: np.ndarray) -> None:
        """expert_ids [T, TOPK]: one row per token, tokens numbered from `first_token`."""
        rows = np.asarray(expert_ids)  # [T, TOPK]
        if self.error is not None:
            self.dropped_records += len(rows)
            return
        assert self._file is not None
        lines = [f"{step} {first_token + t} {layer} " + " ".join(str(int(e)) for e in row)
                 for t, row in enumerate(rows)]
        data = ("\n".join(lines) + "\n").encode()
        try:
            self._file.write(data)
            if self.best_effort:
                self._file.flush()  # per call, so that a write error loses this call's records only
        except OSError as exc:
            if not self.best_effort:
                raise
            self._stop(exc, len(lines))
            return
        self._bytes_written += len(data)
        self.num_records += len(lines)

    def _stop(self, error: OSError, num_lost: int) -> None:
        self.error = error
        self.dropped_records += num_lost
        file, self._file = self._file, None
        try:
            file.close()  # closes the descriptor even when flushing the failed bytes raises again
        except OSError:
            pass
        try:
            os.truncate(self._writing, self._bytes_written)  # a torn last line would make the trace unreadable
        except OSError:
            pass
        logger.warning("--trace-out %s: %s; routing tracing stopped (requests go on), the trace keeps its first "
                       "%d records and the rest are counted as dropped", self.path, error.strerror or error,
                       self.num_records)

    def close(self) -> None:
        """Flush and close; a best-effort trace is then renamed to its name (as far as it got, if it stopped)."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                if not self.best_effort:
                    raise
                self._stop(exc, 0)
            self._file = None
        if self._writing != self.path and self._writing.exists():
            try:
                os.replace(self._writing, self.path)
            except OSError as exc:
                logger.warning("--trace-out %s: cannot rename the finished trace into place (%s); it is %s",
                               self.path, exc.strerror or exc, self._writing)


def read_trace(path: str | Path) -> Trace:
    """Read and check a trace: a text file with the header, then records whose layers and expert ids fit the
    header's model (a binary file, or an id past the expert count, is a TraceError naming the file)."""
    path = Path(path)
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not a k3serve routing trace (a binary file, not text; write one with "
                         "--trace-out)") from None
    if not lines or not lines[0].startswith(TRACE_MAGIC):
        raise TraceError(f"{path} is not a k3serve routing trace (write one with --trace-out)")
    try:
        meta = json.loads(lines[0][len(TRACE_MAGIC):])
        if not isinstance(meta, dict):
            raise TraceError(f"{path}: malformed trace header: expected a JSON object")
        num_experts, top_k = meta.get("num_experts"), meta.get("top_k")
        for key, value in (("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TraceError(f"{path}: malformed trace header: {key} must be a positive integer, got {value!r}")
        num_layers = meta.get("num_layers")
        trace = Trace(meta)
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            fields = [int(x) for x in line.split()]
            if len(fields) < 4:
                raise TraceError(f"{path}:{number}: expected STEP TOKEN LAYER EXPERT..., got {line!r}")
            step, token, layer, ids = fields[0], fields[1], fields[2], tuple(fields[3:])
            if min(step, token, layer) < 0:
                raise TraceError(f"{path}:{number}: STEP, TOKEN and LAYER are never negative, got {line!r}")
            if isinstance(num_layers, int) and layer >= num_layers:
                raise TraceError(f"{path}:{number}: layer {layer} is past the header's num_layers {num_layers}")
            bad = [e for e in ids if not 0 <= e < num_experts]
            if bad:
                raise TraceError(f"{path}:{number}: expert id {bad[0]} is outside 0..{num_experts - 1} (the "
                                 f"header's num_experts is {num_experts})")
            trace.records.append((step, token, layer, ids))
    except (ValueError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: malformed trace: {exc}") from exc
    return trace


def prefill_only(trace: Trace) -> bool:
    """True when no step of the trace routes a single token: every step is a prefill of many tokens (what
    `routing-stats` records, one step per window), so a step's request is the union of hundreds of tokens' experts
    and a cache replay of it says nothing about decode."""
    tokens_per_step = Counter(step for step, _ in {(r[0], r[1]) for r in trace.records})
    return bool(tokens_per_step) and min(tokens_per_step.values()) > 1


MODEL_IDENTITY = ("num_layers", "num_experts", "top_k", "moe_layers", "hidden_size", "vocab_size")


def trace_meta(config, expert_bytes: int | None = None) -> dict:
    """The trace header: the model's identity (MODEL_IDENTITY, checked by `check_trace_model` wherever a trace
    is used with a model) and the expert size."""
    return {"num_layers": config.num_layers, "num_experts": config.num_experts,
            "top_k": config.num_experts_per_token, "moe_layers": list(config.moe_layer_ids),
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "expert_bytes": int(expert_bytes if expert_bytes is not None else config.expert_bytes)}


def check_trace_model(trace: Trace, config, path: str | Path, flag: str) -> None:
    """Refuse a trace recorded on another model: every identity field the trace carries must equal the model's
    (a trace from before hidden_size/vocab_size were recorded is checked on the fields it has)."""
    model = trace_meta(config, expert_bytes=0)
    carried = [key for key in MODEL_IDENTITY if key in trace.meta]
    if not carried:
        raise TraceError(f"{flag} {path}: the trace does not say which model it was recorded on")
    for key in carried:
        if trace.meta[key] != model[key]:
            raise TraceError(f"{flag} {path} was recorded on another model: {key} is {trace.meta[key]} in the "
                             f"trace and {model[key]} in this model")


class TracedSource(ForwardingSource):
    """Wraps any weight source and records its routing (for --trace-out on a resident model); with no writer it
    only forwards (a base for other recorders). Everything else, capabilities included, goes to the inner source."""

    def __init__(self, inner: WeightSource, writer: TraceWriter | None) -> None:
        super().__init__(inner)
        self.writer = writer
        self._step = -1
        self._next_token = 0
        self._step_first_token = 0

    def begin_step(self, num_tokens: int) -> None:
        self._step += 1
        self._step_first_token = self._next_token
        self._next_token += num_tokens
        self.inner.begin_step(num_tokens)

    def supports_nested_forward(self) -> bool:
        return False  # a nested forward would open a step inside the recorded one

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        if self.writer is not None:
            self.writer.write(self._step, self._step_first_token, layer, expert_ids)
        self.inner.note_routing(layer, expert_ids)

    def close(self) -> None:
        """Close the trace (a `--trace-out` file takes its name now), then the inner source."""
        if self.writer is not None:
            self.writer.close()
        self.inner.close()
