"""Expert-store shards for expert parallelism: `k3serve pack CHECKPOINT OUT --shard i/N`.

Shard i of N owns the experts [i * NE / N, (i + 1) * NE / N) of every MoE layer (a contiguous block of ids, so the
(token, expert) pairs of a step, sorted by expert, fall to the owners in owner order). A shard folder holds only
what an expert owner reads:

    config.json     the model's config
    experts.bin     the owned experts' blobs, in the packed store's blob format (4 KiB-aligned, padded, one stride
                    each; `k3serve.weights.store`), layer by layer, ascending id
    shard.json      the index: shard i/N, the owned id range, per layer each owned expert's offset and CRC-32

No trunk: the front (the process that runs the trunk) reads an ordinary packed store. Opening a shard checks it
against its config and its file size before any weight is read, like `PackedStore`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from k3serve.config import K3Config, load_config
from k3serve.errors import ConfigError
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.store import (ALIGNMENT, EXPERT_FILE, PackedStore, StoreError, align_up, config_fingerprint,
                                   expert_blob, expert_parts, is_packed_store, read_index)
from k3serve.weights.stripes import read_striped

SHARD_FORMAT = "k3serve-expert-shard"
SHARD_VERSION = 1
SHARD_INDEX = "shard.json"


@dataclass(frozen=True)
class ShardSpec:
    """Shard `index` of `count` (zero-based)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"shard {self.index}/{self.count}: need 0 <= i < N (written i/N, e.g. 0/2)")

    @staticmethod
    def parse(text: str) -> ShardSpec:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise ConfigError(f"--shard takes i/N (shard i of N, zero-based, e.g. 0/2), got {text!r}")
        return ShardSpec(int(match.group(1)), int(match.group(2)))

    def experts(self, num_experts: int) -> range:
        """The expert ids this shard owns; a count that does not divide the experts is an error."""
        check_shard_count(num_experts, self.count)
        per = num_experts // self.count
        return range(self.index * per, (self.index + 1) * per)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def check_shard_count(num_experts: int, count: int) -> None:
    if count < 1 or num_experts % count:
        raise ConfigError(f"{count} shards do not divide the model's {num_experts} experts per layer; choose a "
                          f"divisor of {num_experts}")


@dataclass(frozen=True)
class ShardLayerIndex:
    offsets: dict[int, int]  # expert id -> byte offset in experts.bin (owned experts only)
    crc32: dict[int, int]  # expert id -> CRC-32 of its blob (without padding)


def pack_shard(source: str | Path, out: str | Path, shard: ShardSpec) -> ExpertShard:
    """Write shard `shard` of `source` (a safetensors checkpoint, or a packed store whose blobs are copied as they
    are, checksums verified) into `out`, the index last, renamed into place."""
    source = Path(source)
    with ExitStack() as stack:
        if is_packed_store(source):
            store = PackedStore(source)
            config = store.config
        else:
            checkpoint = stack.enter_context(Checkpoint(source))
            config = checkpoint.config
        owned = shard.experts(config.num_experts)
        parts = expert_parts(config)
        blob_size = sum(p.nbytes for p in parts)
        stride = align_up(blob_size)

        def read_blob(layer: int, expert: int) -> bytearray:
            if is_packed_store(source):
                blob = bytearray(stride)
                blob[:blob_size] = read_striped(store.expert_files, store.stripe_chunk_bytes,
                                                store.expert_offset(layer, expert), blob_size)
                if zlib.crc32(memoryview(blob)[:blob_size]) != store.experts[layer].crc32[expert]:
                    raise StoreError(f"{store.expert_path}: layer {layer} expert {expert} fails its CRC-32 check")
                return blob
            return expert_blob(checkpoint, parts, layer, expert, stride)

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / SHARD_INDEX).unlink(missing_ok=True)
        layers: dict[str, dict] = {}
        with open(out / EXPERT_FILE, "wb") as f:
            for layer in config.moe_layer_ids:
                offsets, crcs = {}, {}
                for expert in owned:
                    blob = read_blob(layer, expert)
                    offsets[str(expert)] = f.tell()
                    crcs[str(expert)] = zlib.crc32(memoryview(blob)[:blob_size])
                    f.write(blob)
                layers[str(layer)] = {"offsets": offsets, "crc32": crcs}
    shutil.copy(source / "config.json", out / "config.json")
    index = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "config_sha256": config_fingerprint(config),
             "shard": [shard.index, shard.count], "experts": [owned.start, owned.stop], "alignment": ALIGNMENT,
             "expert_file": EXPERT_FILE, "expert_blob_size": blob_size, "expert_stride": stride, "layers": layers}
    staging = out / (SHARD_INDEX + ".tmp")
    staging.write_text(json.dumps(index))
    staging.rename(out / SHARD_INDEX)
    return ExpertShard(out)


class ExpertShard:
    """An opened, validated shard: what `k3serve.stream.expert_cache.ExpertCache` needs of a store
    (`experts[layer].offsets / .crc32`, `expert_blob_size`, `expert_path`) plus the owned range."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        raw = read_index(self.path / SHARD_INDEX, SHARD_FORMAT, SHARD_VERSION,
                         f"{self.path} is not an expert shard (no {SHARD_INDEX}); create one with "
                         f"`k3serve pack CHECKPOINT {self.path} --shard i/N`")
        self.config: K3Config = load_config(self.path)
        self.shard = ShardSpec(*raw["shard"])
        self.owned = range(*raw["experts"])
        self.expert_path = self.path / raw["expert_file"]
        self.expert_blob_size = int(raw["expert_blob_size"])
        self.expert_stride = int(raw["expert_stride"])
        self.experts = {int(l): ShardLayerIndex({int(e): int(o) for e, o in v["offsets"].items()},
                                                {int(e): int(c) for e, c in v["crc32"].items()})
                        for l, v in raw["layers"].items()}
        self._validate(raw)

    def _validate(self, raw: dict) -> None:
        c = self.config
        problems: list[str] = []
        if raw.get("config_sha256") != config_fingerprint(c):
            problems.append("config.json differs from the config the shard was packed with")
        if self.owned != self.shard.experts(c.num_experts):
            problems.append(f"owns experts {self.owned.start}..{self.owned.stop - 1}, shard {self.shard} of "
                            f"{c.num_experts} experts owns {self.shard.experts(c.num_experts)}")
        expected_blob = sum(p.nbytes for p in expert_parts(c))
        if self.expert_blob_size != expected_blob:
            problems.append(f"expert blobs are {self.expert_blob_size} bytes, config implies {expected_blob}")
        if sorted(self.experts) != list(c.moe_layer_ids):
            problems.append(f"expert layers {sorted(self.experts)} differ from MoE layers {list(c.moe_layer_ids)}")
        for layer, entry in self.experts.items():
            if sorted(entry.offsets) != list(self.owned) or sorted(entry.crc32) != list(self.owned):
                problems.append(f"layer {layer} indexes other experts than {self.owned.start}..{self.owned.stop - 1}")
        end = max((max(e.offsets.values(), default=0) + self.expert_stride for e in self.experts.values()), default=0)
        if not self.expert_path.exists():
            problems.append(f"{self.expert_path.name} is missing (the index needs {end} bytes)")
        elif os.path.getsize(self.expert_path) < end:
            problems.append(f"{self.expert_path.name} is {os.path.getsize(self.expert_path)} bytes, the index "
                            f"needs {end} (truncated?)")
        if problems:
            raise StoreError(f"expert shard {self.path} does not match its config:\n  " + "\n  ".join(problems[:8]))

    @property
    def num_experts_total(self) -> int:
        """Blobs in this shard (owned experts x MoE layers)."""
        return len(self.owned) * len(self.experts)

    def owns(self, expert: int) -> bool:
        return expert in self.owned


def is_expert_shard(path: str | Path) -> bool:
    return (Path(path) / SHARD_INDEX).exists()
