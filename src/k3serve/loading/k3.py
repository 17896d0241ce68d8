"""K3's entry in the registry (loading/registry.py): a released or test checkpoint folder, a K3 GGUF file
(llama.cpp's `kimi-k3`) or a K3 packed store, opened as a `K3Model` over the right `WeightSource`; its packer; and
what only K3 offers (routing traces in K3's layout, expert shards, resident weights shared with another process)."""

from __future__ import annotations

from pathlib import Path

from k3serve.config import K3Config, load_config
from k3serve.errors import CheckpointError, ConfigError
from k3serve.hf_tokenizer import HFTokenizer
from k3serve.loading.opened import ExpertWrapper, Opened
from k3serve.model.k3 import K3Model
from k3serve.model.source import ResidentSource
from k3serve.stream.options import StreamOptions
from k3serve.stream.source import StreamingSource
from k3serve.tokenizer import Tokenizer
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.gguf_file import GGUFFile
from k3serve.weights.shared_pages import SharedArrays
from k3serve.weights.store import PackedStore, config_fingerprint

K3_EXPERT_PRECISIONS = ("native", "mxfp4")


def _check_precision(expert_precision: str) -> None:
    if expert_precision not in K3_EXPERT_PRECISIONS:
        raise ConfigError(f"K3 experts ship as MXFP4; --expert-precision {expert_precision!r} applies to the other "
                          "families")


def open_folder(folder: Path, expert_precision: str, trunk_precision: str = "native") -> Opened:
    _check_precision(expert_precision)
    checkpoint = Checkpoint(folder)
    tokenizer = Tokenizer.from_dir(checkpoint.tokenizer_dir) if checkpoint.tokenizer_dir else None
    return Opened(K3Model(ResidentSource(checkpoint, trunk_precision)), tokenizer, checkpoint)


def share_folder(folder: Path, expert_precision: str, trunk_precision: str = "native"
                 ) -> tuple[Opened, SharedArrays]:
    """`open_folder` with the weights moved into sealed shared pages (model/source.py `ResidentSource.share`),
    before the model is built on them: the model reads read-only views, and the handle lets another process
    (`open_shared`) map the same pages."""
    _check_precision(expert_precision)
    checkpoint = Checkpoint(folder)
    tokenizer = Tokenizer.from_dir(checkpoint.tokenizer_dir) if checkpoint.tokenizer_dir else None
    source = ResidentSource(checkpoint, trunk_precision)
    shared = source.share()
    return Opened(K3Model(source), tokenizer, checkpoint), shared


def open_shared(folder: Path, shared: SharedArrays) -> Opened:
    """The model of `folder` over weights another process shared (`share_folder`): nothing is read from the
    checkpoint's weight files; its config must be the one the weights were built with."""
    if not isinstance(shared.about, K3Config) or config_fingerprint(shared.about) != config_fingerprint(
            load_config(folder)):
        raise CheckpointError(f"{folder}: the shared weights were built from another model's config")
    source = ResidentSource.from_shared(shared)
    tokenizer = Tokenizer.from_dir(folder) if (folder / "tiktoken.model").exists() else None
    return Opened(K3Model(source), tokenizer)


def open_gguf(file: GGUFFile, expert_precision: str, trunk_precision: str = "native") -> Opened:
    _check_precision(expert_precision)
    checkpoint = Checkpoint.from_gguf(file)
    return Opened(K3Model(ResidentSource(checkpoint, trunk_precision)), None, checkpoint)


def open_store(folder: Path, options: StreamOptions, wrap: ExpertWrapper | None = None) -> Opened:
    """A K3 store streamed through a `StreamingSource` (wrapped by `wrap`, e.g. expert parallelism's owners)."""
    store = PackedStore(folder)
    tokenizer: Tokenizer | HFTokenizer | None = None
    if (folder / "tiktoken.model").exists():
        tokenizer = Tokenizer.from_dir(folder)
    elif (folder / "tokenizer.json").exists():  # a store packed from a GGUF file (gguf_tokenizer.py)
        tokenizer = HFTokenizer.from_dir(folder)
    source = StreamingSource(store, options)
    if wrap is not None:
        try:
            source = wrap(source)
        except BaseException:
            source.close()
            raise
    return Opened(K3Model(source), tokenizer)


def record_routing(model: K3Model, path: Path) -> None:
    """Record every forward's routing to `path` (`--trace-out` on a resident model; K3's trace layout)."""
    from k3serve.stream.trace import TracedSource, TraceWriter, trace_meta

    model.source = TracedSource(model.source, TraceWriter(path, trace_meta(model.config), best_effort=True))


def pack(source: Path, out: Path, expert_precision: str = "native", **options):
    """`k3serve pack` of a K3 checkpoint folder or GGUF file (layout and token_sets as `pack_checkpoint`)."""
    from k3serve.weights.pack import pack_checkpoint

    _check_precision(expert_precision)
    return pack_checkpoint(source, out, progress=True, **options)
