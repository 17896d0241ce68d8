"""The families' entries in the registry (loading/registry.py): Kimi Linear, DeepSeek-V3 / Kimi K2, Qwen3-MoE and
Qwen3-Next from a Hugging Face checkpoint folder, a GGUF file as llama.cpp writes it, or a family store (the trunk
resident, the routed experts streamed), each a `FamilyModel`; and their packer."""

from __future__ import annotations

import logging
from pathlib import Path

from k3serve.errors import CheckpointError, TokenizerError
from k3serve.hf_tokenizer import HFTokenizer
from k3serve.loading.opened import ExpertWrapper, Opened
from k3serve.model.families import FamilyModel, load_family
from k3serve.model.families.loading import load_family_gguf
from k3serve.model.families.moe import MoEBlock
from k3serve.stream.family_source import StreamingExperts
from k3serve.stream.options import StreamOptions
from k3serve.tokenizer import Tokenizer
from k3serve.weights.family_store import FamilyStore
from k3serve.weights.gguf_file import GGUFFile

logger = logging.getLogger(__name__)


def family_tokenizer(folder: Path) -> Tokenizer | HFTokenizer | None:
    """A family checkpoint's (or family store's) tokenizer: tiktoken.model, else tokenizer.json; one that cannot be
    read leaves the model usable with token ids (a warning says why)."""
    for file, kind in (("tiktoken.model", Tokenizer), ("tokenizer.json", HFTokenizer)):
        if (folder / file).exists():
            try:
                return kind.from_dir(folder)
            except TokenizerError as exc:
                logger.warning("%s: tokenizer not usable (%s); pass token ids instead", folder, exc)
                return None
    return None


def open_folder(folder: Path, expert_precision: str, trunk_precision: str = "native") -> Opened:
    return Opened(load_family(folder, expert_precision=expert_precision, trunk_precision=trunk_precision),
                  family_tokenizer(folder))


def open_gguf(file: GGUFFile, expert_precision: str, trunk_precision: str = "native") -> Opened:
    return Opened(load_family_gguf(file, expert_precision=expert_precision, trunk_precision=trunk_precision), None)


def open_store(folder: Path, options: StreamOptions, wrap: ExpertWrapper | None = None) -> Opened:
    """A family store: the trunk resident, the routed experts streamed through `StreamingExperts`."""
    if wrap is not None:
        raise CheckpointError(f"{folder} is a family store: expert parallelism runs K3 stores")
    store = FamilyStore(folder)
    model: FamilyModel = load_family(folder, expert_precision=store.precision)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    if [b.layer for b in blocks] != store.moe_layers or any(b.router.top_k != store.top_k or
                                                            b.router.weight.shape[0] != store.num_experts
                                                            for b in blocks):
        raise CheckpointError(f"packed store {folder}: its MoE layers {store.moe_layers} ({store.num_experts} "
                              f"experts, top-{store.top_k}) differ from the model's; repack it")
    model.use_experts(StreamingExperts(store, options, model.config.num_layers))
    return Opened(model, family_tokenizer(folder))


def pack(source: Path, out: Path, expert_precision: str = "native", **options):
    """`k3serve pack` of a family checkpoint folder or GGUF file (the trunk as stored, or a folder's as Q8_0 with
    `trunk_precision="q8_0"`; experts at the precision)."""
    from k3serve.stream.family_pack import pack_family

    return pack_family(source, out, expert_precision=expert_precision, progress=True,
                       trunk_precision=options.get("trunk_precision", "native"))
