"""The family store: a family checkpoint (Kimi Linear, DeepSeek-V3 / Kimi K2, Qwen3-MoE, Qwen3-Next) packed by
`k3serve pack` for streaming under a RAM budget.

A family store folder holds:

    config.json              the checkpoint's config (and its tokenizer files: tokenizer.json, chat template, ...)
    trunk.safetensors        every tensor but the routed experts, byte for byte in its stored dtype (norms,
                             attention, DeltaNet / KDA, routers, shared experts, dense layers, embeddings)
    experts.bin              one blob per routed expert at the precision chosen at pack time, each starting on a
                             4 KiB boundary and padded to a multiple of 4 KiB (O_DIRECT can read it)
    store.json               the index: format, model type, the expert precision and blob kind, the blob's parts
                             (name, dtype, shape, offset; `k3serve.model.families.expert_blobs`), and for every
                             MoE layer its experts' offsets and CRC-32s in file order

K3 checkpoints pack to `k3serve.weights.store` instead (its trunk is streamed layer by layer as well). Opening a
family store checks the index against its files (sizes, every blob inside experts.bin, the config's fingerprint)
before any weight is read; the model's own checks (tensor shapes, MoE layers) run when it is built.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from k3serve.weights.store import ALIGNMENT, STORE_INDEX, ExpertLayerIndex, StoreError

FAMILY_STORE_FORMAT = "k3serve-family-store"
FAMILY_STORE_VERSION = 1
FAMILY_TRUNK_FILE = "trunk.safetensors"
FAMILY_EXPERT_FILE = "experts.bin"


def config_file_sha256(folder: str | Path) -> str:
    return hashlib.sha256((Path(folder) / "config.json").read_bytes()).hexdigest()


def store_format(path: str | Path) -> str | None:
    """The `format` a packed store's index names ("k3serve-store" or "k3serve-family-store"), None if unreadable."""
    try:
        raw = json.loads((Path(path) / STORE_INDEX).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw.get("format") if isinstance(raw, dict) else None


def is_family_store(path: str | Path) -> bool:
    return store_format(path) == FAMILY_STORE_FORMAT


class FamilyStore:
    """An opened, validated family store (metadata only; the bytes are read by `k3serve.stream`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_file = self.path / STORE_INDEX
        try:
            raw = json.loads(index_file.read_text())
        except FileNotFoundError:
            raise StoreError(f"{self.path} is not a packed store (no {STORE_INDEX}); create one with "
                             f"`k3serve pack CHECKPOINT {self.path}`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise StoreError(f"{index_file}: unreadable index: {exc}") from exc
        if raw.get("format") != FAMILY_STORE_FORMAT or raw.get("version") != FAMILY_STORE_VERSION:
            raise StoreError(f"{index_file}: not a {FAMILY_STORE_FORMAT} v{FAMILY_STORE_VERSION} index")
        self.raw = raw
        self.model_type: str = raw["model_type"]
        self.precision: str = raw["expert_precision"]
        self.kind: str = raw["expert_kind"]
        self.layout: str = raw["layout"]
        self.top_k = int(raw["top_k"])
        self.num_experts = int(raw["num_experts"])
        self.trunk_path = self.path / raw["trunk_file"]
        self.expert_path = self.path / raw["expert_file"]
        self.parts_json: list = raw["parts"]
        self.expert_blob_size = int(raw["expert_blob_size"])
        self.expert_stride = int(raw["expert_stride"])
        self.experts = {int(l): ExpertLayerIndex(tuple(v["order"]), tuple(v["offsets"]), tuple(v["crc32"]))
                        for l, v in raw["experts"].items()}
        self._validate()

    def _validate(self) -> None:
        problems: list[str] = []
        if not (self.path / "config.json").exists():
            problems.append("config.json is missing")
        elif self.raw.get("config_sha256") != config_file_sha256(self.path):
            problems.append("config.json differs from the config the store was packed with")
        if self.expert_stride % ALIGNMENT or self.expert_stride < self.expert_blob_size:
            problems.append(f"expert stride {self.expert_stride} is not a {ALIGNMENT}-aligned blob size")
        for layer, entry in self.experts.items():
            if len(entry.offsets) != self.num_experts or sorted(entry.order) != list(range(self.num_experts)):
                problems.append(f"layer {layer} indexes {len(entry.offsets)} experts, the store has "
                                f"{self.num_experts}")
        if not self.trunk_path.exists():
            problems.append(f"{self.trunk_path.name} is missing")
        end = max((max(e.offsets) + self.expert_stride for e in self.experts.values()), default=0)
        if not self.expert_path.exists():
            problems.append(f"{self.expert_path.name} is missing (the index needs {end} bytes)")
        elif self.expert_path.stat().st_size < end:
            problems.append(f"{self.expert_path.name} is {self.expert_path.stat().st_size} bytes, the index needs "
                            f"{end} (truncated?)")
        if problems:
            raise StoreError(f"packed store {self.path} does not match its index:\n  " + "\n  ".join(problems[:8]))

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.experts)

    @property
    def num_experts_total(self) -> int:
        return len(self.experts) * self.num_experts

    def expert_offset(self, layer: int, expert: int) -> int:
        return self.experts[layer].offsets[expert]
