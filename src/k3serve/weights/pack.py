"""`k3serve pack`: rewrite a safetensors checkpoint, or a K3 GGUF file, into a packed store (see
`k3serve.weights.store`).

Tensors are copied byte for byte in their stored dtype (the trunk stays bf16 on disk, experts stay MXFP4), so a
streaming source decodes exactly what the resident source decodes. `--trunk-precision q8_0|mxfp4` instead stores
the trunk's big matrices as Q8_0 (34 bytes per 32 weights) or MXFP4 (17 per 32) bytes, encoded here from their
float values; the model multiplies them from those bytes (lossy: docs/STREAMING.md, "Trunk precision"). A GGUF
file is read through the same reader as `--model FILE.gguf` (`Checkpoint.from_gguf`): its trunk is stored as the
float32 that reader gives (a trunk matrix the file holds as Q8_0 as its Q8_0 blocks, unchanged), its experts as
the same MXFP4 bytes, its config and tokenizer are written from its metadata. The index is written last, under a
temporary name and renamed, so an interrupted pack never leaves a folder that looks complete.

With `stripe_dirs` (`--stripe DIR1,...,DIRN`) trunk.bin and experts.bin are laid over the N drives' folders
(`k3serve.weights.stripes`): the same bytes at the same virtual offsets, each drive's share in
DIRk/k3stripe-<store id>-<k>of<N>; an interrupted pack removes the stripe folders it made.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
import zlib
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from k3serve.gguf_tokenizer import write_tokenizer_files
from k3serve.weights import names
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
from k3serve.weights.held import quantized_in_trunk
from k3serve.weights.layout import LAYOUTS, layer_order
from k3serve.weights.quantized import TRUNK_PRECISIONS, quantize_matrix
from k3serve.weights.store import (ALIGNMENT, EXPERT_FILE, MXFP4_ROWS_VERSION, READABLE_STORE_VERSIONS,
                                   STORE_FORMAT, STORE_INDEX, STORE_VERSION, STRIPE_FORMAT, STRIPE_INDEX,
                                   STRIPE_VERSION, TENSOR_ALIGNMENT, TRUNK_FILE, PackedStore, StoreError, TensorEntry,
                                   TrunkBlob, align_up, config_fingerprint, expert_blob, expert_parts, follows_in_group, packed_specs,
                                   stripe_chunk_bytes, stripe_folder_name, trunk_stripe_chunk_bytes)
from k3serve.weights.stripes import StripedWriter

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def _write_padded(f, data: bytes | np.ndarray, alignment: int = ALIGNMENT) -> None:
    f.write(data)
    pad = align_up(f.tell(), alignment) - f.tell()
    if pad:
        f.write(b"\0" * pad)


def _stored_tensor(checkpoint: Checkpoint, name: str, trunk_precision: str,
                   version: int = STORE_VERSION) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, bytes) of one trunk tensor as the store holds it: its checkpoint bytes, or, at trunk precision
    q8_0 / mxfp4, a matrix `quantized_in_trunk` picks encoded from its float32 values (`QuantizedMatrix`; an MXFP4
    matrix by rows from version 3, planar before)."""
    info = checkpoint.index.info(name)
    shape = tuple(info.shape)
    if trunk_precision != "bf16" and quantized_in_trunk(name, shape):
        matrix = quantize_matrix(checkpoint.read(name), trunk_precision)  # a GGUF's blocks at it kept as they are
        return matrix.store_dtype, shape, matrix.to_bytes(rows=version >= MXFP4_ROWS_VERSION)
    return info.dtype, shape, checkpoint.index.read_raw(name).tobytes()


def _trunk_blob(checkpoint: Checkpoint, specs: Sequence[names.TensorSpec], offset: int,
                trunk_precision: str = "bf16", version: int = STORE_VERSION) -> tuple[TrunkBlob, bytes]:
    entries, chunks, cursor = [], [], 0
    previous = None
    for spec in packed_specs(specs, version):
        dtype, shape, raw = _stored_tensor(checkpoint, spec.name, trunk_precision, version)
        # a fused group's parts back to back, so the fused matrix is one view of the read buffer (a Q8_0 group's
        # blocks too, and from version 3 an MXFP4 group's rows)
        adjacent = version >= 2 and follows_in_group(previous, spec.name)
        start = cursor if adjacent else align_up(cursor, TENSOR_ALIGNMENT)
        previous = spec.name
        if start > cursor:
            chunks.append(b"\0" * (start - cursor))
        chunks.append(raw)
        entries.append(TensorEntry(spec.name, dtype, shape, start, len(raw)))
        cursor = start + len(raw)
    data = b"".join(chunks)
    return TrunkBlob(offset, len(data), zlib.crc32(data), tuple(entries), version >= MXFP4_ROWS_VERSION), data


class _Stripes:
    """The drive folders of a striped pack: made at the start, marked at the end, removed if the pack fails."""

    def __init__(self, dirs: Sequence[str | Path], chunk_bytes: int, trunk_chunk_bytes: int) -> None:
        self.dirs = [Path(d).resolve() for d in dirs]
        self.chunk_bytes = chunk_bytes  # experts.bin's
        self.trunk_chunk_bytes = trunk_chunk_bytes
        self.store_id = uuid.uuid4().hex[:16]
        self.folders = [d / stripe_folder_name(self.store_id, k, len(dirs)) for k, d in enumerate(self.dirs)]

    @staticmethod
    def check(dirs: Sequence[str | Path]) -> None:
        if not dirs:
            raise StoreError("--stripe needs at least one directory")
        resolved = [Path(d).resolve() for d in dirs]
        for given, path in zip(dirs, resolved):
            if not path.is_dir():
                raise StoreError(f"stripe directory {given} does not exist (mount the drive and make the folder "
                                 "first)")
        if len(set(resolved)) != len(resolved):
            raise StoreError(f"--stripe lists a directory twice ({', '.join(map(str, dirs))}): give one directory "
                             "per drive")

    @contextmanager
    def files(self, name: str) -> Iterator[StripedWriter]:
        with ExitStack() as stack:
            handles = [stack.enter_context(open(folder / name, "wb")) for folder in self.folders]
            yield StripedWriter(handles, self.trunk_chunk_bytes if name == TRUNK_FILE else self.chunk_bytes)

    def mark(self) -> None:
        for k, folder in enumerate(self.folders):
            marker = {"format": STRIPE_FORMAT, "version": STRIPE_VERSION, "store_id": self.store_id, "stripe": k + 1,
                      "num_stripes": len(self.folders), "chunk_bytes": self.chunk_bytes,
                      "trunk_chunk_bytes": self.trunk_chunk_bytes}
            (folder / STRIPE_INDEX).write_text(json.dumps(marker) + "\n")

    def remove(self) -> None:
        for folder in self.folders:  # made with a fresh store id: no other store's folder has its name
            shutil.rmtree(folder, ignore_errors=True)

    def to_json(self) -> dict:
        return {"chunk_bytes": self.chunk_bytes, "trunk_chunk_bytes": self.trunk_chunk_bytes,
                "dirs": [str(d) for d in self.dirs]}


def pack_checkpoint(source: str | Path, out: str | Path, layout: str = "natural",
                    token_sets: Mapping[int, Sequence[Sequence[int]]] | None = None,
                    progress: bool = False, stripe_dirs: Sequence[str | Path] | None = None,
                    stripe_chunk: int | None = None, trunk_precision: str = "bf16",
                    version: int = STORE_VERSION) -> PackedStore:
    """Pack `source` into `out`. `token_sets[layer]` lists the experts each traced token chose (for the
    frequency and coactivation layouts). `stripe_dirs`: one folder per drive to lay trunk.bin and experts.bin
    over (`stripe_chunk`: both files' chunk; by default `stripe_chunk_bytes` of the expert stride for experts.bin and
    `trunk_stripe_chunk_bytes` of the largest layer for trunk.bin). `trunk_precision` "bf16" copies the trunk as
    stored (lossless); "q8_0" or "mxfp4" stores its big matrices in those formats
    (`weights.held.quantized_in_trunk`), which the model then multiplies straight from their bytes. `version` 1 or
    2 writes a previous format (for tests of reading it)."""
    if trunk_precision not in TRUNK_PRECISIONS:
        raise StoreError(f"unknown trunk precision {trunk_precision!r}; choose one of {', '.join(TRUNK_PRECISIONS)}")
    if version not in READABLE_STORE_VERSIONS:
        raise StoreError(f"store format version must be one of {READABLE_STORE_VERSIONS}, got {version}")
    if stripe_dirs is not None:
        _Stripes.check(stripe_dirs)
        if stripe_chunk is not None and (stripe_chunk < ALIGNMENT or stripe_chunk % ALIGNMENT):
            raise StoreError(f"stripe chunk {stripe_chunk} is not a positive multiple of {ALIGNMENT} bytes")
    if layout not in LAYOUTS:
        raise StoreError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if layout != "natural" and not token_sets:
        raise StoreError(f"layout {layout!r} needs a routing trace (--trace FILE, written by --trace-out)")
    checkpoint = Checkpoint.from_gguf(GGUFFile(source)) if is_gguf_file(source) else Checkpoint(source)
    config = checkpoint.config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / STORE_INDEX).unlink(missing_ok=True)
    parts = expert_parts(config)
    blob_size = sum(p.nbytes for p in parts)
    stride = align_up(blob_size)
    total = sum(checkpoint.index.info(s.name).nbytes for s in names.all_specs(config))
    stripes = None
    if stripe_dirs is not None:
        largest_layer = max(sum(align_up(checkpoint.index.info(s.name).nbytes, TENSOR_ALIGNMENT)
                                for s in names.layer_trunk_specs(config, layer)) for layer in range(config.num_layers))
        stripes = _Stripes(stripe_dirs, stripe_chunk or stripe_chunk_bytes(stride, len(stripe_dirs)),
                           stripe_chunk or trunk_stripe_chunk_bytes(largest_layer, len(stripe_dirs)))

    def output(name: str):
        return stripes.files(name) if stripes is not None else open(out / name, "wb")

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="pack", leave=True)
    try:
        for folder in stripes.folders if stripes is not None else ():
            folder.mkdir()
        with output(TRUNK_FILE) as f:
            globals_blob, data = _trunk_blob(checkpoint, names.global_specs(config), 0, trunk_precision, version)
            _write_padded(f, data)
            if bar:
                bar.update(len(data))
            layer_blobs = []
            for layer in range(config.num_layers):
                blob, data = _trunk_blob(checkpoint, names.layer_trunk_specs(config, layer), f.tell(),
                                          trunk_precision, version)
                _write_padded(f, data)
                layer_blobs.append(blob)
                if bar:
                    bar.update(len(data))
        expert_index: dict[str, dict] = {}
        with output(EXPERT_FILE) as f:
            for layer in config.moe_layer_ids:
                sets = token_sets.get(layer) if token_sets else None
                order = layer_order(layout, config.num_experts, sets) if sets or layout == "natural" \
                    else list(range(config.num_experts))
                offsets = [0] * config.num_experts
                crcs = [0] * config.num_experts
                for expert in order:
                    blob = expert_blob(checkpoint, parts, layer, expert, stride)
                    offsets[expert] = f.tell()
                    crcs[expert] = zlib.crc32(memoryview(blob)[:blob_size])
                    f.write(blob)
                    if bar:
                        bar.update(blob_size)
                expert_index[str(layer)] = {"order": order, "offsets": offsets, "crc32": crcs}
        if stripes is not None:
            stripes.mark()
    except BaseException:
        if stripes is not None:
            stripes.remove()
        raise
    finally:
        if bar:
            bar.close()
    if checkpoint.path.is_file():  # a GGUF file: config and tokenizer from its metadata
        (out / "config.json").write_text(json.dumps(config.to_dict(nested=True), indent=2) + "\n")
        write_tokenizer_files(checkpoint.index.file.metadata, out, str(source))
    else:
        shutil.copy(Path(source) / "config.json", out / "config.json")
        for file in _TOKENIZER_FILES:
            if (Path(source) / file).exists():
                shutil.copy(Path(source) / file, out / file)
    index = {
        "format": STORE_FORMAT, "version": version, "config_sha256": config_fingerprint(config),
        "layout": layout, "trunk_precision": trunk_precision, "alignment": ALIGNMENT, "trunk_file": TRUNK_FILE,
        "expert_file": EXPERT_FILE,
        "globals": globals_blob.to_json(), "layers": [b.to_json() for b in layer_blobs],
        "expert_blob_size": blob_size, "expert_stride": stride, "experts": expert_index,
    }
    if stripes is not None:
        index.update(store_id=stripes.store_id, stripes=stripes.to_json())
    staging = out / (STORE_INDEX + ".tmp")
    staging.write_text(json.dumps(index))
    staging.rename(out / STORE_INDEX)
    checkpoint.close()
    return PackedStore(out)
