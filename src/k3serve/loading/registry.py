"""The architectures k3serve runs, as one table: the only place that tells K3 from the families.

Each `Architecture` says how it is recognised (config.json `model_type`, a GGUF file's `general.architecture`, a
packed store's own format), how it opens resident from a checkpoint folder or a GGUF file and streaming from a packed
store, how it is packed, and what it offers beyond the `Model` interface. `load_model` (loading/__init__.py) is the
one composition root over it; the commands, the lab and the cluster ask an `Architecture` what it offers instead of
asking which one it is.

    name         model_type(s)           GGUF             routing traces, expert shards, cluster replicas,
                                                          shared weights
    kimi_k3      kimi_k3 (and the rest)  kimi-k3          yes
    kimi_linear  kimi_linear             kimi-linear      no
    deepseek_v3  deepseek_v3, kimi_k2    deepseek2        no
    qwen3_moe    qwen3_moe               qwen3moe         no
    qwen3_next   qwen3_next              qwen3next        no
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from k3serve.errors import CheckpointError, ConfigError
from k3serve.loading import families, k3
from k3serve.loading.opened import ExpertWrapper, Opened
from k3serve.model.families.gguf_families import GGUF_ARCHITECTURES
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.loading import MODEL_TYPE_FAMILIES
from k3serve.stream.options import StreamOptions
from k3serve.weights.family_store import FamilyStore, is_family_store
from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
from k3serve.weights.gguf_k3 import ARCHITECTURE as K3_GGUF_ARCHITECTURE
from k3serve.weights.shared_pages import SharedArrays
from k3serve.weights.store import is_packed_store


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values that name it
    gguf_architectures: tuple[str, ...]  # llama.cpp's general.architecture values
    # (checkpoint folder / GGUF file, expert precision, trunk precision) -> resident
    open_folder: Callable[[Path, str, str], Opened]
    open_gguf: Callable[[GGUFFile, str, str], Opened]
    open_store: Callable[[Path, StreamOptions, ExpertWrapper | None], Opened]  # packed store -> streaming
    pack: Callable[..., object]  # (source, out, expert_precision, **layout options) -> the packed store
    routing_traces: bool = False  # --trace-out, pack --layout/--trace, routing-stats, the lab's fixtures
    expert_shards: bool = False  # pack --shard and expert parallelism (k3serve cluster --expert-parallel)
    cluster_replicas: bool = False  # served by `k3serve cluster` replicas (tested with K3 models)
    record_routing: Callable | None = None  # (model, trace path): record a resident model's routing
    # (checkpoint folder, expert and trunk precision) -> (resident, its weights in shared pages), and (folder, those
    # pages) -> the model over them in another process (weights/shared_pages.py; `serve` lends its model to the
    # lab's worker)
    share_folder: Callable[[Path, str, str], tuple[Opened, SharedArrays]] | None = None
    open_shared: Callable[[Path, SharedArrays], Opened] | None = None
    dense_experts: bool = True  # its experts may be bf16, int8 or float32 (the loader compiles those kernels too)


K3 = Architecture("kimi_k3", ("kimi_k3",), (K3_GGUF_ARCHITECTURE,), k3.open_folder, k3.open_gguf, k3.open_store,
                  k3.pack, routing_traces=True, expert_shards=True, cluster_replicas=True,
                  record_routing=k3.record_routing, share_folder=k3.share_folder, open_shared=k3.open_shared,
                  dense_experts=False)  # K3's experts are MXFP4 (moe.py)


def _family(name: str) -> Architecture:
    return Architecture(name, tuple(t for t, f in MODEL_TYPE_FAMILIES.items() if f == name),
                        tuple(g for g, t in GGUF_ARCHITECTURES.items() if MODEL_TYPE_FAMILIES[t] == name),
                        families.open_folder, families.open_gguf, families.open_store, families.pack)


ARCHITECTURES: tuple[Architecture, ...] = (K3, *(_family(name) for name in dict.fromkeys(MODEL_TYPE_FAMILIES.values())))


def by_model_type(model_type: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES if model_type in a.model_types), None)


def of_folder(folder: Path) -> Architecture:
    """A checkpoint folder's architecture: a family by its root model_type (a nested text_config, as the released
    K3 has, is never a family's), else K3, whose reader refuses what it cannot read with the reason."""
    try:
        config = HFConfig.read(folder)
    except ConfigError:  # K3's own reader gives the precise error (a missing folder or config)
        return K3
    if config.has("text_config"):
        return K3
    found = by_model_type(config.get("model_type", default=None) or "")
    return found if found is not None and found is not K3 else K3


def of_gguf(file: GGUFFile) -> Architecture:
    found = next((a for a in ARCHITECTURES if file.architecture in a.gguf_architectures), None)
    if found is None:
        raise CheckpointError(f"{file.path}: GGUF architecture {file.architecture!r} is not supported (supported: "
                              f"{', '.join(g for a in ARCHITECTURES for g in a.gguf_architectures)})")
    return found


def of_store(folder: Path) -> Architecture:
    if not is_family_store(folder):
        return K3
    model_type = FamilyStore(folder).model_type
    found = by_model_type(model_type)
    if found is None or found is K3:
        raise CheckpointError(f"packed store {folder}: model_type {model_type!r} is not one k3serve runs")
    return found


def of_path(path: str | Path) -> Architecture:
    """The architecture of whatever `path` is: a packed store, a GGUF file or a checkpoint folder."""
    path = Path(path)
    if is_packed_store(path):
        return of_store(path)
    if is_gguf_file(path):
        file = GGUFFile(path)
        try:
            return of_gguf(file)
        finally:
            file.close()
    return of_folder(path)


__all__ = ["ARCHITECTURES", "Architecture", "K3", "by_model_type", "of_folder", "of_gguf", "of_path", "of_store"]
