"""The packed store: a trunk file and an expert store written by `k3serve pack`, and its index.

A packed model folder holds:

    config.json              the model's config (and the tokenizer files when the source had them)
    trunk.bin                globals, then one blob per layer: every always-active tensor of that layer in its
                             stored dtype, contiguous, so one read fetches one layer. From format version 2 the
                             parts of each fused projection group (KDA's q, k, v, g, f_a, b; MLA's q_a, kv_a, g;
                             an MLP's gate and up) lie back to back with no padding, so the fused matrix is a view
                             of the read buffer (`packed_specs`), and the globals put their small tensors first,
                             then the embedding, then the lm_head (each read apart: stream/trunk_spans.py).
                             From version 3 an MXFP4 trunk matrix (`pack --trunk-precision mxfp4`) is laid out by
                             rows, each row's nibbles then its scales (`QuantizedMatrix.to_bytes`), so its fused
                             groups and rows are views too; versions 1 and 2 hold it planar (built as copies)
    experts.bin              one blob per routed expert: w1, w3, w2 packed bytes and scales together, each blob
                             starting on a 4 KiB boundary and padded to a multiple of 4 KiB (O_DIRECT can read it)
    store.json               the index: for every blob its offset, size and CRC-32; the layout order of experts

Blob layout of one expert (sizes from the config, identical for every expert):
    w1_packed [MI, LT/2] | w1_scales [MI, LT/32] | w3_packed [MI, LT/2] | w3_scales [MI, LT/32]
    | w2_packed [LT, MI/2] | w2_scales [LT, MI/32] | zero padding to the stride

A striped store (`k3serve pack --stripe DIR1,...,DIRN`) keeps config.json and store.json in its folder and lays
trunk.bin and experts.bin over N drives, RAID 0 fashion in chunks (`k3serve.weights.stripes`; each file its own
chunk): drive k (from 1) holds the folder DIRk/k3stripe-<store id>-<k>of<N> with that drive's share of each file
and a stripe.json naming the store id, k, N and the chunks. The index's offsets stay those of the unstriped files,
so a striped store reads back byte for byte as the unstriped one; store.json records the store id, the chunks and
the drive folders.

Opening a store checks it against its config before any weight is read: the config fingerprint, every trunk
tensor's name, shape and dtype, the expert blob size, that every blob lies inside its file, and for a striped
store that every stripe folder is there and belongs to this store.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from k3serve.config import MXFP4_GROUP_SIZE, K3Config, load_config
from k3serve.errors import CheckpointError
from k3serve.weights import names
from k3serve.weights.bf16 import bf16_bits_to_f32
from k3serve.weights.held import held_bytes, widened_bytes
from k3serve.weights.quantized import STORE_DTYPES, TRUNK_PRECISIONS, QuantizedMatrix
from k3serve.weights.safetensors_io import STORAGE_DTYPES
from k3serve.weights.stripes import striped_file_sizes

if TYPE_CHECKING:
    from k3serve.weights.checkpoint import Checkpoint

STORE_FORMAT = "k3serve-store"
STORE_VERSION = 3
# version 1: fused groups not adjacent (built as copies, never views); version 2: an MXFP4 trunk entry planar (its
# nibbles, then its scales: an MXFP4 trunk built as copies); version 3: an MXFP4 trunk entry by rows
READABLE_STORE_VERSIONS = (1, 2, 3)
MXFP4_ROWS_VERSION = 3  # the first version whose MXFP4 trunk entries are laid out by rows
STORE_INDEX = "store.json"
TRUNK_FILE = "trunk.bin"
EXPERT_FILE = "experts.bin"
ALIGNMENT = 4096  # blob starts and read lengths: the O_DIRECT granularity of common file systems
TENSOR_ALIGNMENT = 64  # tensors inside a trunk blob
STRIPE_INDEX = "stripe.json"
STRIPE_FORMAT = "k3serve-stripe"
STRIPE_VERSION = 1
MAX_STRIPE_CHUNK = 256 << 10  # experts.bin: a 17.5 MB K3 expert splits evenly (to 1.5%) over 2-4 drives
MAX_TRUNK_STRIPE_CHUNK = 4 << 20  # trunk.bin: a 1.1 GB K3 layer is 275 chunks, few pieces for the reader to cut


class StoreError(CheckpointError):
    """A packed store is missing, corrupt, or does not match the model's config."""


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def config_fingerprint(config: K3Config) -> str:
    # the interop keys are left out, so stores packed before checkpoints carried them keep their fingerprint
    text = json.dumps(config.to_dict(nested=True, interop=False), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class ExpertPart(NamedTuple):
    matrix: str  # w1, w3, w2
    part: str  # weight_packed or weight_scale
    shape: tuple[int, int]
    offset: int  # bytes into the blob
    nbytes: int


def expert_parts(config: K3Config) -> list[ExpertPart]:
    """The six arrays of one expert blob, in blob order."""
    parts, offset = [], 0
    for matrix in names.EXPERT_MATRICES:
        rows, cols = names.expert_matrix_shape(config, matrix)
        for part, shape in (("weight_packed", (rows, cols // 2)), ("weight_scale", (rows, cols // MXFP4_GROUP_SIZE))):
            nbytes = shape[0] * shape[1]
            parts.append(ExpertPart(matrix, part, shape, offset, nbytes))
            offset += nbytes
    return parts


def expert_blob(checkpoint: Checkpoint, parts: list[ExpertPart], layer: int, expert: int, stride: int) -> bytearray:
    """One routed expert's blob as a store holds it: its parts read raw from `checkpoint` at their offsets, zero
    padding up to `stride`."""
    blob = bytearray(stride)
    for p in parts:
        raw = checkpoint.index.read_raw(names.expert_name(layer, expert, p.matrix, p.part))
        if raw.nbytes != p.nbytes:
            raise StoreError(f"layer {layer} expert {expert} {p.matrix}.{p.part}: {raw.nbytes} bytes, "
                             f"expected {p.nbytes}")
        blob[p.offset:p.offset + p.nbytes] = raw.tobytes()
    return blob


def read_index(index_file: Path, fmt: str, version: int | tuple[int, ...], missing: str) -> dict:
    """A store's or shard's JSON index, checked for its format and version (one, or those readable); `missing` is
    the error when the file is absent."""
    if not index_file.exists():
        raise StoreError(missing)
    try:
        raw = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StoreError(f"{index_file}: unreadable index: {exc}") from exc
    versions = version if isinstance(version, tuple) else (version,)
    if raw.get("format") != fmt or raw.get("version") not in versions:
        raise StoreError(f"{index_file}: not a {fmt} index of version {' or '.join(map(str, versions))} (found "
                         f"{raw.get('format')!r} version {raw.get('version')!r}); repack it with `k3serve pack`")
    return raw


_QUANTIZED_DTYPES = tuple(STORE_DTYPES.values())


# Fused projection groups, by name suffix: packed back to back (version 2) so the fused matrix is one view.
CONTIGUOUS_GROUPS = (("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.g_proj.",
                      "self_attn.f_a_proj.", "self_attn.b_proj."),
                     ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.g_proj."),
                     ("mlp.gate_proj.", "mlp.up_proj."),
                     ("shared_experts.gate_proj.", "shared_experts.up_proj."))


def packed_specs(specs: Sequence[names.TensorSpec], version: int = STORE_VERSION) -> list[names.TensorSpec]:
    """The order a store of `version` holds a blob's tensors in. Version 2: the globals' small tensors first, then
    the embedding, then the lm_head; in a layer, each fused group's parts moved next to its first part."""
    specs = list(specs)
    if version < 2:
        return specs
    if any(s.name == names.EMBED for s in specs):
        big = (names.EMBED, names.LM_HEAD)
        return [s for s in specs if s.name not in big] + [s for b in big for s in specs if s.name == b]
    out: list[names.TensorSpec] = []
    for spec in specs:
        if spec in out:
            continue
        group = next((g for g in CONTIGUOUS_GROUPS if any(k in spec.name for k in g)), None)
        members = [spec] if group is None else [s for k in group for s in specs if k in s.name]
        out.extend(m for m in members if m not in out)
    return out


def follows_in_group(previous: str | None, name: str) -> bool:
    """Whether tensor `name` continues the fused group tensor `previous` is part of (written with no padding)."""
    return previous is not None and any(any(k in previous for k in g) and any(k in name for k in g)
                                        for g in CONTIGUOUS_GROUPS)


def stripe_folder_name(store_id: str, stripe: int, num_stripes: int) -> str:
    """The folder of drive `stripe` (counted from 0) on that drive; named counting from 1, as the errors do."""
    return f"k3stripe-{store_id}-{stripe + 1}of{num_stripes}"


def stripe_chunk_bytes(expert_stride: int, num_stripes: int) -> int:
    """The chunk a pack over `num_stripes` drives uses: at most `MAX_STRIPE_CHUNK`, at most an even share of one
    expert blob (so one expert's read reaches every drive), a multiple of `ALIGNMENT` (so O_DIRECT reads stay
    aligned on every drive)."""
    share = expert_stride // num_stripes // ALIGNMENT * ALIGNMENT
    return max(ALIGNMENT, min(MAX_STRIPE_CHUNK, share))


def trunk_stripe_chunk_bytes(largest_layer_bytes: int, num_stripes: int) -> int:
    """The chunk of trunk.bin: at most `MAX_TRUNK_STRIPE_CHUNK`, at most 1/64 of a drive's share of the largest
    layer (so a layer's read is even to within 1.6%), a multiple of `ALIGNMENT`."""
    share = largest_layer_bytes // num_stripes // 64 // ALIGNMENT * ALIGNMENT
    return max(ALIGNMENT, min(MAX_TRUNK_STRIPE_CHUNK, share))


class TensorEntry(NamedTuple):
    name: str
    dtype: str  # safetensors dtype string, or "Q8_0" / "MXFP4" (a quantized trunk: `weights.quantized`)
    shape: tuple[int, ...]
    offset: int  # bytes into the blob
    nbytes: int


@dataclass(frozen=True)
class TrunkBlob:
    """One contiguous region of trunk.bin: the globals or one layer."""

    offset: int
    size: int  # bytes of tensor data (the read length is align_up(size))
    crc32: int
    tensors: tuple[TensorEntry, ...]
    mxfp4_rows: bool = True  # MXFP4 entries laid out by rows (format 3), else planar (`QuantizedMatrix.from_bytes`)

    @property
    def read_size(self) -> int:
        return align_up(self.size)

    @property
    def float32_bytes(self) -> int:
        """An upper bound on the RAM its tensors take once widened to float32 (a quantized trunk's Q8_0 / MXFP4
        matrices are never widened: their bytes)."""
        return sum(t.nbytes if t.dtype in _QUANTIZED_DTYPES else int(np.prod(t.shape)) * 4 for t in self.tensors)

    def held_bytes(self, trunk_dtype: str = "float32") -> int:
        """The RAM its built weights hold with that trunk dtype (`k3serve.weights.held.held_bytes`)."""
        return held_bytes([(t.name, t.dtype, t.shape) for t in self.tensors], trunk_dtype)

    def widened_bytes(self, trunk_dtype: str = "bf16") -> int:
        """Float32 copies held beside the read buffer when built as its views (`k3serve.weights.held`)."""
        return widened_bytes([(t.name, t.dtype, t.shape) for t in self.tensors], trunk_dtype)

    @property
    def entries(self) -> tuple[TensorEntry, ...]:
        return self.tensors

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)

    def decode(self, raw: np.ndarray, keep_bf16: bool = False) -> dict[str, np.ndarray]:
        """raw: u8 [>= size], the blob's bytes -> {name: fresh array} exactly as `Checkpoint.read` returns them;
        with `keep_bf16`, bf16 tensors are their bits (uint16) as views of `raw`, not widened copies. Tensors of a
        quantized trunk (dtype "Q8_0" or "MXFP4") are `QuantizedMatrix` views of `raw`, whatever `keep_bf16`."""
        out: dict = {}
        for t in self.tensors:
            if t.dtype in _QUANTIZED_DTYPES:  # Q8_0 / MXFP4 bytes: views of `raw` (`build_layer` copies them)
                out[t.name] = QuantizedMatrix.from_bytes(t.dtype, raw[t.offset:t.offset + t.nbytes], t.shape,
                                                         rows=self.mxfp4_rows)
                continue
            stored = raw[t.offset:t.offset + t.nbytes].view(STORAGE_DTYPES[t.dtype]).reshape(t.shape)
            if t.dtype == "BF16" and keep_bf16:
                out[t.name] = stored
            elif t.dtype == "BF16":
                out[t.name] = bf16_bits_to_f32(stored)
            else:
                array = np.array(stored, copy=True)
                out[t.name] = array if array.dtype == np.uint8 else array.astype(np.float32, copy=False)
        return out

    def to_json(self) -> dict:
        return {"offset": self.offset, "size": self.size, "crc32": self.crc32,
                "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]}

    @staticmethod
    def from_json(raw: dict, version: int = STORE_VERSION) -> TrunkBlob:
        return TrunkBlob(int(raw["offset"]), int(raw["size"]), int(raw["crc32"]),
                         tuple(TensorEntry(n, d, tuple(s), int(o), int(b)) for n, d, s, o, b in raw["tensors"]),
                         mxfp4_rows=version >= MXFP4_ROWS_VERSION)


@dataclass(frozen=True)
class ExpertLayerIndex:
    order: tuple[int, ...]  # expert ids in file order (the layout)
    offsets: tuple[int, ...]  # by expert id
    crc32: tuple[int, ...]  # by expert id


class PackedStore:
    """An opened, validated packed store (read-only metadata; the bytes are read by `k3serve.stream`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        raw = read_index(self.path / STORE_INDEX, STORE_FORMAT, READABLE_STORE_VERSIONS,
                         f"{self.path} is not a packed store (no {STORE_INDEX}); create one with "
                         f"`k3serve pack CHECKPOINT {self.path}`")
        self.config: K3Config = load_config(self.path)
        self.version: int = int(raw["version"])
        self.layout: str = raw["layout"]
        self.trunk_precision: str = raw.get("trunk_precision", "bf16")  # `pack --trunk-precision`
        # the unstriped files' paths (a striped store has no file there: its bytes are in `trunk_files` and
        # `expert_files`, one per drive)
        self.trunk_path = self.path / raw["trunk_file"]
        self.expert_path = self.path / raw["expert_file"]
        stripes = raw.get("stripes")
        self.store_id: str | None = raw.get("store_id")
        self.stripe_chunk_bytes = int(stripes["chunk_bytes"]) if stripes else 0  # experts.bin's
        self.trunk_stripe_chunk_bytes = int(stripes["trunk_chunk_bytes"]) if stripes else 0
        self.stripe_folders: tuple[Path, ...] = tuple(
            Path(d) / stripe_folder_name(str(self.store_id), k, len(stripes["dirs"]))
            for k, d in enumerate(stripes["dirs"])) if stripes else ()
        self.trunk_files = tuple(f / raw["trunk_file"] for f in self.stripe_folders) or (self.trunk_path,)
        self.expert_files = tuple(f / raw["expert_file"] for f in self.stripe_folders) or (self.expert_path,)
        self.globals = TrunkBlob.from_json(raw["globals"], self.version)
        self.layers = [TrunkBlob.from_json(b, self.version) for b in raw["layers"]]
        self.expert_blob_size = int(raw["expert_blob_size"])
        self.expert_stride = int(raw["expert_stride"])
        self.experts = {int(l): ExpertLayerIndex(tuple(v["order"]), tuple(v["offsets"]), tuple(v["crc32"]))
                        for l, v in raw["experts"].items()}
        self._validate(raw)

    def _validate(self, raw: dict) -> None:
        c = self.config
        problems: list[str] = []
        if raw.get("config_sha256") != config_fingerprint(c):
            problems.append("config.json differs from the config the store was packed with")
        if self.trunk_precision not in TRUNK_PRECISIONS:
            problems.append(f"unknown trunk precision {self.trunk_precision!r}")
        if len(self.layers) != c.num_layers:
            problems.append(f"store has {len(self.layers)} trunk layers, config has {c.num_layers}")
        expected_blob = sum(p.nbytes for p in expert_parts(c))
        if self.expert_blob_size != expected_blob:
            problems.append(f"expert blobs are {self.expert_blob_size} bytes, config implies {expected_blob}")
        if self.expert_stride % ALIGNMENT or self.expert_stride < self.expert_blob_size:
            problems.append(f"expert stride {self.expert_stride} is not a {ALIGNMENT}-aligned blob size")
        if sorted(self.experts) != list(c.moe_layer_ids):
            problems.append(f"expert layers {sorted(self.experts)} differ from MoE layers {list(c.moe_layer_ids)}")
        for layer, blob in enumerate(self.layers[:c.num_layers]):
            want = [(s.name, s.shape) for s in packed_specs(names.layer_trunk_specs(c, layer), self.version)]
            have = [(t.name, t.shape) for t in blob.tensors]
            if want != have:
                problems.append(f"trunk layer {layer} holds other tensors than the config implies")
        for layer, entry in self.experts.items():
            if len(entry.offsets) != c.num_experts or sorted(entry.order) != list(range(c.num_experts)):
                problems.append(f"layer {layer} indexes {len(entry.offsets)} experts, config has {c.num_experts}")
        trunk_end = max([b.offset + b.read_size for b in self.layers + [self.globals]])
        expert_end = max((max(e.offsets) + self.expert_stride for e in self.experts.values()), default=0)
        if self.stripe_folders:
            stripe_problems = self._stripe_problems()
            if stripe_problems:  # the files' sizes say nothing while a folder is missing or another store's
                raise StoreError(f"striped store {self.path}:\n  " + "\n  ".join(stripe_problems))
        for files, end, chunk in ((self.trunk_files, trunk_end, self.trunk_stripe_chunk_bytes),
                                  (self.expert_files, expert_end, self.stripe_chunk_bytes)):
            needs = striped_file_sizes(end, chunk, len(files)) if len(files) > 1 else [end]
            for path, need in zip(files, needs):
                name = path.name if len(files) == 1 else str(path)
                if not path.exists():
                    problems.append(f"{name} is missing (the index needs {need} bytes)")
                    continue
                size = path.stat().st_size
                if size < need:
                    problems.append(f"{name} is {size} bytes, the index needs {need} (truncated?)")
        if problems:
            raise StoreError(f"packed store {self.path} does not match its config:\n  " + "\n  ".join(problems[:8]))

    @property
    def adjacent_groups(self) -> bool:
        """Whether each fused projection group is packed back to back (version 2): built as views."""
        return self.version >= 2

    @property
    def mxfp4_rows(self) -> bool:
        """Whether an MXFP4 trunk entry is laid out by rows (version 3): its fused groups and rows are views."""
        return self.version >= MXFP4_ROWS_VERSION

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def num_experts_total(self) -> int:
        return len(self.experts) * self.config.num_experts

    def _stripe_problems(self) -> list[str]:
        """Each stripe folder exists and its stripe.json names this store, this stripe and this many stripes."""
        problems, count = [], len(self.stripe_folders)
        for chunk in (self.stripe_chunk_bytes, self.trunk_stripe_chunk_bytes):
            if chunk < ALIGNMENT or chunk % ALIGNMENT:
                problems.append(f"stripe chunk {chunk} is not a multiple of {ALIGNMENT}")
        for k, folder in enumerate(self.stripe_folders):
            where = f"stripe {k + 1} of {count} ({folder.parent})"
            if not folder.parent.is_dir():
                problems.append(f"{where}: the directory is missing (is the drive mounted?)")
                continue
            if not folder.is_dir():
                others = sorted(p.name for p in folder.parent.glob("k3stripe-*"))
                held = f"; it holds {', '.join(others)}, stripes of other stores or other drives" if others else ""
                problems.append(f"{where}: no {folder.name} there, so this drive holds no part of this store"
                                f"{held}")
                continue
            try:
                marker = json.loads((folder / STRIPE_INDEX).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                problems.append(f"{where}: {folder / STRIPE_INDEX} is unreadable: {exc}")
                continue
            found = (marker.get("format"), marker.get("version"), marker.get("store_id"), marker.get("stripe"),
                     marker.get("num_stripes"), marker.get("chunk_bytes"), marker.get("trunk_chunk_bytes"))
            wanted = (STRIPE_FORMAT, STRIPE_VERSION, self.store_id, k + 1, count, self.stripe_chunk_bytes,
                      self.trunk_stripe_chunk_bytes)
            if found != wanted:
                problems.append(f"{where}: {folder} belongs to another store (its stripe.json says store "
                                f"{marker.get('store_id')}, stripe {marker.get('stripe')} of "
                                f"{marker.get('num_stripes')}; this store is {self.store_id})")
        return problems

    @property
    def num_stripes(self) -> int:
        """Drives the store is striped over (1: an ordinary store)."""
        return max(len(self.stripe_folders), 1)

    @property
    def expert_store_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.expert_files)

    @property
    def trunk_store_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.trunk_files)

    def expert_offset(self, layer: int, expert: int) -> int:
        return self.experts[layer].offsets[expert]


def is_packed_store(path: str | Path) -> bool:
    return (Path(path) / STORE_INDEX).exists()
