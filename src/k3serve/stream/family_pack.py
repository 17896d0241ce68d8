"""`k3serve pack` for the families: a Hugging Face checkpoint folder (or a GGUF file) of Kimi Linear, DeepSeek-V3 /
Kimi K2, Qwen3-MoE or Qwen3-Next -> a family store (`k3serve.weights.family_store`).

The trunk (every tensor that is not a routed expert) is copied byte for byte into trunk.safetensors; with
`trunk_precision="q8_0"` (a checkpoint folder only) each matrix the resident loader would quantize at that
precision (`TensorReader.quantized_at_load`: attention, shared and dense MLPs, embedding, lm_head) is stored as
its Q8_0 blocks instead (U8 [R, C / 32 * 34], read back as the same Q8_0 matrix), so the store computes what
`--trunk-precision q8_0` computes resident. Each routed
expert is read once and packed at `expert_precision` ("native": the stored bf16 or float32 values; "int8";
"mxfp4") exactly as the resident loader packs it (`ExpertStore.packed`), then written as
one checksummed, 4 KiB-aligned blob. The index is written last, under a temporary name and renamed, so an
interrupted pack never leaves a folder that looks complete. Experts are in id order (the trace-driven layouts of
K3's `pack --layout` are not offered for the families).

A GGUF file is read through the reader `--model FILE.gguf` uses (`gguf_families`): its experts come from the same
`ExpertStore.read` (MXFP4 experts stay packed at "native" and "mxfp4"), its trunk is written as the float32 that
reader gives (so streamed and resident compute with the same values; a BF16 file's trunk takes 2x its bytes in the
store) except that a Q8_0 trunk matrix is stored as its blocks (U8 [R, C / 32 * 34]), kept as Q8_0 at run time, its config (the one `gguf_families.hf_config` rebuilds) as config.json and its
tokenizer as tokenizer.json / tokenizer_config.json / generation_config.json.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import zlib
from pathlib import Path

from k3serve.errors import CheckpointError
from k3serve.gguf_tokenizer import write_tokenizer_files
from k3serve.model.families.gguf_families import hf_config, tensor_index
from k3serve.model.families.loading import load_family_gguf, load_family_reading
from k3serve.model.families.expert_blobs import blob_parts, blob_size, expert_arrays, write_blob
from k3serve.model.families.experts import ExpertStore, normalize_precision
from k3serve.model.families.moe import MoEBlock
from k3serve.weights.family_store import (FAMILY_EXPERT_FILE, FAMILY_STORE_FORMAT, FAMILY_STORE_VERSION,
                                          FAMILY_TRUNK_FILE, FamilyStore, config_file_sha256)
from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
from k3serve.weights.safetensors_io import INDEX_FILE_NAME, STORAGE_DTYPES, SafetensorsIndex, save_safetensors
from k3serve.weights.store import STORE_INDEX, align_up

logger = logging.getLogger(__name__)

# a routed expert's tensors: per expert (`...mlp.experts.3.gate_proj.weight`, Kimi's `...experts.3.w1.weight`)
# or fused (`...mlp.experts.gate_up_proj`); shared experts (`shared_experts.`, `shared_expert.`) are trunk
ROUTED_EXPERT = re.compile(r"(^|\.)experts\.")


def pack_family(source: str | Path, out: str | Path, expert_precision: str = "native",
                progress: bool = False, trunk_precision: str = "native") -> FamilyStore:
    """Pack the family checkpoint folder `source` into `out` (see the module docstring)."""
    source, out = Path(source), Path(out)
    precision = normalize_precision(expert_precision)
    from_gguf = is_gguf_file(source)
    if trunk_precision not in ("native", "bf16", "q8_0"):
        raise CheckpointError(f"a family store holds its trunk as stored or as Q8_0 blocks; --trunk-precision "
                              f"{trunk_precision} is not offered for {source}")
    trunk_q8_0 = trunk_precision == "q8_0"
    if from_gguf and trunk_q8_0:
        raise CheckpointError(f"{source} is a GGUF file: its store keeps the file's trunk (a Q8_0 file's as Q8_0); "
                              "--trunk-precision q8_0 quantizes a checkpoint folder's")
    quantized: dict = {}
    if from_gguf:
        model = load_family_gguf(source, precision)
    else:
        model, reader = load_family_reading(source, precision, trunk_precision="q8_0" if trunk_q8_0 else "native",
                                            record_quantized=True)
        quantized = reader.quantized_at_load or {}  # name -> the Q8_0 matrix the model holds for it
        reader.quantized_at_load = None  # the expert store keeps the reader: drop these references
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    if not blocks or not isinstance(model.experts, ExpertStore):
        raise CheckpointError(f"{source}: the model has no routed experts; run it resident, there is nothing to "
                              "stream")
    num_experts = {b.router.weight.shape[0] for b in blocks}
    top_k = {b.router.top_k for b in blocks}
    if len(num_experts) != 1 or len(top_k) != 1:
        raise CheckpointError(f"{source}: MoE layers with different expert counts {num_experts} or top-k {top_k}")
    out.mkdir(parents=True, exist_ok=True)
    (out / STORE_INDEX).unlink(missing_ok=True)

    if from_gguf:
        _write_gguf_trunk_and_files(source, out)
    else:
        with SafetensorsIndex.open(source) as index:
            trunk_names = [n for n in index if not ROUTED_EXPERT.search(n)]
            save_safetensors(out / FAMILY_TRUNK_FILE,
                             {n: quantized[n].data if n in quantized else index.read_raw(n).view(
                                 STORAGE_DTYPES[index.info(n).dtype]).reshape(index.info(n).shape)
                              for n in trunk_names},
                             dtypes={n: "U8" if n in quantized else index.info(n).dtype for n in trunk_names})

    kind, parts, stride = None, None, 0
    expert_index: dict[str, dict] = {}
    total = len(blocks) * next(iter(num_experts))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="expert", desc="pack", leave=True)
    try:
        with open(out / FAMILY_EXPERT_FILE, "wb") as f:
            for block in blocks:
                count = block.router.weight.shape[0]
                offsets, crcs = [0] * count, [0] * count
                for expert in range(count):
                    this_kind, arrays = expert_arrays(model.experts.packed(block.layer, expert))
                    if parts is None:
                        kind, parts = this_kind, blob_parts(arrays)
                        stride = align_up(blob_size(parts))
                    elif this_kind != kind:
                        raise CheckpointError(f"{source}: layer {block.layer} expert {expert} packs as {this_kind}, "
                                              f"the first expert as {kind} (a mix of bf16 and float32 experts?); "
                                              "pack with --expert-precision int8 or mxfp4")
                    blob = bytearray(stride)
                    write_blob(arrays, parts, blob)
                    offsets[expert] = f.tell()
                    crcs[expert] = zlib.crc32(memoryview(blob)[:blob_size(parts)])
                    f.write(blob)
                    if bar:
                        bar.update(1)
                expert_index[str(block.layer)] = {"order": list(range(count)), "offsets": offsets, "crc32": crcs}
    finally:
        if bar:
            bar.close()
        model.experts.close()
    for file in [] if from_gguf else sorted(source.iterdir()):  # config, tokenizer, chat template, generation config
        if file.is_file() and not file.name.endswith(".safetensors") and file.name not in (INDEX_FILE_NAME,
                                                                                             STORE_INDEX):
            shutil.copy(file, out / file.name)
    assert parts is not None and kind is not None
    index_json = {
        "format": FAMILY_STORE_FORMAT, "version": FAMILY_STORE_VERSION, "model_type": model.config.model_type,
        "config_sha256": config_file_sha256(out), "expert_precision": precision, "expert_kind": kind,
        "trunk_precision": "q8_0" if trunk_q8_0 else "native",
        "layout": "natural", "top_k": next(iter(top_k)), "num_experts": next(iter(num_experts)),
        "trunk_file": FAMILY_TRUNK_FILE, "expert_file": FAMILY_EXPERT_FILE, "parts": [p.to_json() for p in parts],
        "expert_blob_size": blob_size(parts), "expert_stride": stride, "experts": expert_index,
    }
    staging = out / (STORE_INDEX + ".tmp")
    staging.write_text(json.dumps(index_json))
    staging.rename(out / STORE_INDEX)
    return FamilyStore(out)



def _write_gguf_trunk_and_files(source: Path, out: Path) -> None:
    """A GGUF file's trunk under our names, as the float32 its reader gives (what `--model FILE.gguf` computes
    with), its config as config.json and its tokenizer as side files (`gguf_tokenizer.write_tokenizer_files`)."""
    file = GGUFFile(source)
    try:
        config = hf_config(file)
        index = tensor_index(file, config)
        trunk_names = [n for n in index if not ROUTED_EXPERT.search(n)]
        # a Q8_0 trunk matrix is stored as its blocks, U8 [R, C / 32 * 34] (`TensorReader` reads it back as the
        # same Q8_0 matrix, or dequantized), so the store computes what the file computes resident
        blocks = {n: index.q8_0_blocks(n) for n in trunk_names}
        # MLA's kv_b: where its halves are kept as Q8_0 blocks (`kv_b_proj.k_b` / `.v_b`, what the model multiplies
        # with), not also as the joined float32 matrix (4x their bytes, never read)
        trunk_names = [n for n in trunk_names if not (n.endswith("kv_b_proj.weight") and all(
            blocks.get(n[:-len("weight")] + half) is not None for half in ("k_b", "v_b")))]
        save_safetensors(out / FAMILY_TRUNK_FILE,
                         {n: index.read(n) if blocks[n] is None else blocks[n].data for n in trunk_names},
                         dtypes={n: "F32" if blocks[n] is None else "U8" for n in trunk_names})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer_files(file.metadata, out, str(source))
    finally:
        file.close()
