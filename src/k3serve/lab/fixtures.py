"""What the lab's modules measure on, built once and shared: the model (resident), held-out token windows, a
routing trace recorded from the model, packed stores (natural and co-activation layouts) and a widened copy with
bigger experts for I/O figures.

Files go to `<k3serve cache>/lab/<model key>/` (the model key is the digest of the model's checksum list, or of its
config for a folder without one), written under a temporary name and renamed, so a half-built fixture is never used.
A model is loaded once per process; modules run one at a time (the run queue), and a lock guards the first build.
The run queue's worker process gets its own copy (pickling sends the folders, not the loaded model), unless the
fixtures carry `shared_weights`: the weights `k3serve serve` holds for the same model, in sealed read-only shared
pages (loading's `SharedWeights`), which the worker maps instead of loading a second copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from k3serve.atomic_file import atomic_output, new_staging_folder, remove_stale_staging, write_text
from k3serve.config import K3Config, load_config
from k3serve.errors import K3Error

if TYPE_CHECKING:
    from k3serve.loading import SharedWeights

logger = logging.getLogger(__name__)

LAB_MODEL = "lab model"
# what a module with a model choice may run on: the lab's K3 model, or a random tiny model of a family
# (k3serve.model.families.synthetic: random weights, real shapes, routing and cache paths)
MODEL_CHOICES = (LAB_MODEL, "kimi_linear", "deepseek_v3", "qwen3_moe", "qwen3_next")
TRACE_WINDOWS = 8  # held-out windows (alternating code, prose) routed to record the lab's trace
TRACE_WINDOW_TOKENS = 128


def _atomic_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Build a folder under a temporary name next to `target`, then rename it into place. A build that fails is
    removed; one whose process was killed (a cancelled run's worker) is removed by the next build in that folder
    (`remove_stale_staging`: its `.staging-PID-*` names a process that is gone)."""
    remove_stale_staging(target.parent)
    if target.exists():
        return target
    staging = new_staging_folder(target.parent)
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


class LabFixtures:
    def __init__(self, model_dir: str | Path | None = None, cache_dir: str | Path | None = None,
                 shared_weights: SharedWeights | None = None) -> None:
        from k3serve.loading import cache_root, default_model_dir, verify_checksums

        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.model_arg = str(model_dir) if model_dir is not None else None  # for reproducing commands
        if shared_weights is not None and shared_weights.path != self.model_dir.resolve():
            raise K3Error(f"the shared weights are {shared_weights.path}'s, the lab's model is {self.model_dir}")
        self.shared_weights = shared_weights
        if cache_dir is not None:
            self.root = Path(cache_dir)
        else:
            if (self.model_dir / "SHA256SUMS").exists():
                key = verify_checksums(self.model_dir)[:12]
            else:
                key = hashlib.sha256((self.model_dir / "config.json").read_bytes()
                                     + str(self.model_dir.resolve()).encode()).hexdigest()[:12]
            self.root = cache_root() / "lab" / key
        self._lock = threading.RLock()
        self._loaded = None
        self._config: K3Config | None = None
        self._windows: dict[str, list[int]] | None = None
        self._families: dict[str, object] = {}

    def __reduce__(self):
        """Pickled (into the lab's worker process) as its folders and the shared weights' handle: the copy loads
        the model itself, once, or maps the shared weights."""
        return LabFixtures, (None if self.model_arg is None else self.model_dir, self.root, self.shared_weights)

    @property
    def model_name(self) -> str:
        return "the embedded model" if self.model_arg is None else self.model_dir.name

    # ---- the model ------------------------------------------------------------------------------------------
    @property
    def config(self) -> K3Config:
        if self._config is None:
            self._config = load_config(self.model_dir)
        return self._config

    def loaded(self):
        """The resident `LoadedModel` (K3 only), loaded once (over the shared weights when given)."""
        from k3serve.loading import load_model

        with self._lock:
            if self._loaded is None:
                loaded = load_model(self.model_dir, shared_weights=self.shared_weights)
                if not loaded.architecture.routing_traces:  # its fixtures are routing traces and K3 stores
                    raise K3Error(f"{self.model_dir}: the lab runs K3 checkpoints only")
                if loaded.tokenizer is None:
                    raise K3Error(f"{self.model_dir}: the lab needs a tokenizer (tiktoken.model)")
                self._loaded = loaded
            return self._loaded

    def model_for(self, choice: str) -> tuple[object, tuple[int, ...], str]:
        """(model, stop ids, its name for figures) of a module's `model` choice (MODEL_CHOICES): the lab's model,
        or a random tiny family model written once under the lab's cache folder and loaded once."""
        if choice == LAB_MODEL:
            loaded = self.loaded()
            return loaded.model, loaded.stop_ids, self.model_name
        if choice not in MODEL_CHOICES:
            raise K3Error(f"unknown model {choice!r}; choose one of {', '.join(MODEL_CHOICES)}")
        from k3serve.loading import load_model
        from k3serve.model.families.synthetic import write_random_family

        with self._lock:
            if choice not in self._families:
                folder = _atomic_dir(self.root / "families" / choice, lambda d: write_random_family(choice, d))
                self._families[choice] = load_model(folder).model
            return self._families[choice], (), f"a random tiny {choice} model"

    # ---- held-out text --------------------------------------------------------------------------------------
    def token_streams(self) -> dict[str, list[int]]:
        """{'code': ids, 'prose': ids}: the training corpus's held-out splits, tokenized (cached as JSON)."""
        with self._lock:
            if self._windows is None:
                path = self.root / "heldout_tokens.json"
                if not path.exists():
                    from k3serve.training.corpus import build_corpus

                    tokenizer = self.loaded().tokenizer
                    corpus = build_corpus()
                    streams = {"code": tokenizer.encode("".join(corpus.heldout_code)[:200_000]),
                               "prose": tokenizer.encode("\n".join(corpus.heldout_prose)[:200_000])}
                    self.root.mkdir(parents=True, exist_ok=True)
                    write_text(path, json.dumps(streams))
                self._windows = json.loads(path.read_text())
            return self._windows

    def windows(self, count: int, length: int, skip: int = 0, kind: str = "mixed") -> list[list[int]]:
        """`count` windows of `length` tokens (BOS first), alternating code and prose for kind 'mixed'."""
        streams = self.token_streams()
        bos = self.loaded().tokenizer.bos_id
        out = []
        for i in range(skip, skip + count):
            name = kind if kind in streams else ("code", "prose")[i % 2]
            ids = streams[name]
            start = ((i // 2 if kind == "mixed" else i) * (length - 1)) % max(len(ids) - length, 1)
            head = [bos] if bos is not None else []
            out.append(head + ids[start:start + length - len(head)])
        return out

    # ---- a routing trace ------------------------------------------------------------------------------------
    @property
    def trace_tokens(self) -> int:
        """Tokens in the routing trace (known before it is recorded)."""
        return TRACE_WINDOWS * TRACE_WINDOW_TOKENS

    def trace_path(self) -> Path:
        """A routing trace of the model on held-out windows (TRACE_WINDOWS x TRACE_WINDOW_TOKENS tokens)."""
        from k3serve.lab.routing_stats import measure_routing
        from k3serve.stream.trace import TraceWriter, trace_meta

        with self._lock:
            path = self.root / "routing.trace"
            if not path.exists():
                model = self.loaded().model
                windows = self.windows(TRACE_WINDOWS, TRACE_WINDOW_TOKENS)
                self.root.mkdir(parents=True, exist_ok=True)
                with atomic_output(path) as staging:
                    writer = TraceWriter(staging, trace_meta(model.config))
                    try:
                        measure_routing(model, windows, writer)
                    finally:
                        writer.close()
            return path

    def trace(self):
        from k3serve.stream.trace import read_trace

        return read_trace(self.trace_path())

    def token_requests(self, max_tokens: int | None = None) -> tuple[list[tuple[int, int, list[int]]], int]:
        """The trace as one request per (token, layer), in token order: what decoding those tokens one at a time
        asks of the expert cache (the routing is the same: a forward is exact whether batched or not). Returns
        (requests, number of tokens)."""
        records = sorted(self.trace().records, key=lambda r: (r[1], r[2]))
        tokens = sorted({r[1] for r in records})
        if max_tokens is not None:
            keep = set(tokens[:max_tokens])
            records = [r for r in records if r[1] in keep]
            tokens = tokens[:max_tokens]
        return [(token, layer, sorted(set(experts))) for _, token, layer, experts in records], len(tokens)

    # ---- packed stores --------------------------------------------------------------------------------------
    def widened_dir(self, inner: int, latent: int) -> Path:
        """The model with every expert widened (exact duplication: the same routing), as a checkpoint."""
        if inner == 1 and latent == 1:
            return self.model_dir
        from k3serve.weights.widen import widen_experts

        with self._lock:
            return _atomic_dir(self.root / f"widened-x{inner}-x{latent}",
                               lambda out: widen_experts(self.model_dir, out, inner=inner, latent=latent))

    def packed(self, layout: str = "natural", inner: int = 1, latent: int = 1) -> Path:
        """A packed store of the (widened) model; the co-activation and frequency layouts use the lab's trace."""
        from k3serve.weights.pack import pack_checkpoint

        with self._lock:
            source = self.widened_dir(inner, latent)
            sets = self.trace().token_sets() if layout != "natural" else None
            return _atomic_dir(self.root / f"packed-{layout}-x{inner}-x{latent}",
                               lambda out: pack_checkpoint(source, out, layout=layout, token_sets=sets))
