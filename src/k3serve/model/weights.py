"""Weight containers the K3 model computes with, and the `WeightSource` seam it reads them through (its trunk, on
top of the `ExpertSource` seam every architecture shares, model/expert_source.py).

The model never knows where bytes come from: a resident source holds everything in RAM, a streaming source
(k3serve.stream) reads through a cache under a budget. Trunk weights arrive as float32 arrays, except the big
MLP matrices (latent down/up, shared experts, dense MLP), which stay bf16 (uint16 bits, multiplied by
`k3serve.model.kernels.linear`) when the checkpoint stores them as bf16; routed experts arrive as their MXFP4
bytes (multiplied directly by the fused kernels, never expanded).

Fused projection matrices (several [out, H] matrices stacked so one GEMM serves them all) are built once when a
layer is assembled, from the released tensors.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from k3serve.config import K3Config
from k3serve.model.expert_source import ExpertSource, SourceStats, StepReads, StepTenants, StreamStats
from k3serve.model.routing import ExpertPairs, Routing
from k3serve.weights import names
from k3serve.weights.held import TRUNK_DTYPES
from k3serve.weights.quantized import QuantizedMatrix


@dataclass(frozen=True)
class KDAWeights:
    in_proj: np.ndarray  # [4P + D + NH, H]: q, k, v, g (output gate), f_a, b stacked
    f_b: np.ndarray  # [P, D]
    conv: np.ndarray  # [3P, K]: q, k, v depthwise taps, oldest to newest
    a_exp: np.ndarray  # [NH] exp(A_log[:NH])
    dt_bias: np.ndarray  # [P]
    o_norm: np.ndarray  # [D]
    o_proj: np.ndarray  # [H, P]


@dataclass(frozen=True)
class MLAWeights:
    in_proj: np.ndarray  # [QL + KL + DR (+ NA*DV), H]: q_a, kv_a_with_mqa (and g) stacked
    q_a_norm: np.ndarray  # [QL]
    q_b: np.ndarray  # [NA*(DN+DR), QL]
    kv_a_norm: np.ndarray  # [KL]
    w_uk: np.ndarray  # [NA, DN, KL] key half of kv_b, per head
    w_uv: np.ndarray  # [NA, DV, KL] value half of kv_b, per head
    o_proj: np.ndarray  # [H, NA*DV]
    has_gate: bool


@dataclass(frozen=True)
class DenseMLPWeights:
    gate_up: np.ndarray  # [2*DI, H] float32, or bf16 bits (uint16)
    down: np.ndarray  # [H, DI] float32, or bf16 bits


@dataclass(frozen=True)
class DenseMLPPieces:
    """A dense MLP whose matrices are read when the model reaches them, one at a time into the same staging buffer
    (a streamed layer held as views, stream/trunk_spans.py): `gate_up()` [2*DI, H], then `down()` [H, DI], bf16
    bits. Each array is valid until the next call."""

    gate_up: Callable[[], np.ndarray]
    down: Callable[[], np.ndarray]


@dataclass(frozen=True)
class MoEWeights:
    router: np.ndarray  # [NE, H]
    router_bias: np.ndarray  # [NE] selection-only correction bias
    latent_down: np.ndarray  # [LT, H] float32, or bf16 bits (uint16)
    latent_up: np.ndarray  # [H, LT] float32, or bf16 bits
    latent_norm: np.ndarray  # [LT]
    shared_gate_up: np.ndarray | None  # [2*SI, H] float32, or bf16 bits
    shared_down: np.ndarray | None  # [H, SI] float32, or bf16 bits


@dataclass(frozen=True)
class LayerWeights:
    input_norm: np.ndarray  # [H]
    post_attention_norm: np.ndarray  # [H]
    attn_res_query: np.ndarray  # [H] self_attention_res_norm * self_attention_res_proj
    mlp_res_query: np.ndarray  # [H] mlp_res_norm * mlp_res_proj
    attention: KDAWeights | MLAWeights
    mlp: DenseMLPWeights | DenseMLPPieces | MoEWeights

    @property
    def nbytes(self) -> int:
        total = 0
        for part in (self, self.attention, self.mlp):
            for value in vars(part).values():
                if isinstance(value, (np.ndarray, QuantizedMatrix)):
                    total += value.nbytes
        return total


class EmbeddingRows(Protocol):
    """An embedding not held whole: `rows[ids]` reads the rows of `ids` [T] -> [T, H] (bf16 bits or float32)."""

    def __getitem__(self, ids: np.ndarray) -> np.ndarray: ...


class ChunkedHead(Protocol):
    """An lm_head not held whole: `logits(x)` [R, H] -> [R, V], multiplying each row chunk as it is read."""

    def logits(self, x: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class GlobalWeights:
    embed: np.ndarray | QuantizedMatrix | EmbeddingRows  # [V, H]
    lm_head: np.ndarray | QuantizedMatrix | ChunkedHead  # [V, H]
    final_norm: np.ndarray  # [H]
    output_res_query: np.ndarray  # [H] output_attn_res_norm * output_attn_res_proj


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert in MXFP4: packed nibbles [rows, cols/2] and E8M0 scales [rows, cols/32] per matrix."""

    w1_packed: np.ndarray  # [MI, LT/2] gate
    w1_scales: np.ndarray  # [MI, LT/32]
    w3_packed: np.ndarray  # [MI, LT/2] up
    w3_scales: np.ndarray  # [MI, LT/32]
    w2_packed: np.ndarray  # [LT, MI/2] down
    w2_scales: np.ndarray  # [LT, MI/32]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values())


class WeightSource(ExpertSource):
    """K3's weights: its trunk (this seam, K3-only, read only by `K3Model`) and its routed experts (the
    `ExpertSource` seam every architecture shares, model/expert_source.py). Implementations must return identical
    values for identical requests.

    `global_weights`, `layer` and `experts` are required. `peek_layer` gives a layer's weights to compute a
    next-layer guess from, without taking it out of a streaming source's read-ahead."""

    config: K3Config

    @abstractmethod
    def global_weights(self) -> GlobalWeights: ...

    @abstractmethod
    def layer(self, layer: int) -> LayerWeights: ...

    def peek_layer(self, layer: int) -> LayerWeights:
        """`layer`'s weights for a next-layer guess (its post-attention norm, router and bias)."""
        return self.layer(layer)


class ForwardingSource(WeightSource):
    """A source that wraps another and forwards everything, capabilities included; a wrapper subclasses it and
    overrides only what it changes, so no capability is ever lost on the way."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.config = inner.config

    @property
    def plan(self) -> Any:
        return self.inner.plan

    def global_weights(self) -> GlobalWeights:
        return self.inner.global_weights()

    def layer(self, layer: int) -> LayerWeights:
        return self.inner.layer(layer)

    def peek_layer(self, layer: int) -> LayerWeights:
        return self.inner.peek_layer(layer)

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        return self.inner.experts(layer, expert_ids)

    def stacked_experts(self, layer: int) -> Any:
        return self.inner.stacked_experts(layer)

    def expert_outputs(self, layer: int, pairs: ExpertPairs, x: np.ndarray) -> np.ndarray | None:
        return self.inner.expert_outputs(layer, pairs, x)

    def begin_step(self, num_tokens: int) -> None:
        self.inner.begin_step(num_tokens)

    @property
    def prefetching(self) -> bool:
        return self.inner.prefetching

    def prefetch(self, layer: int, guess: Routing) -> None:
        self.inner.prefetch(layer, guess)

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        self.inner.note_routing(layer, expert_ids)

    def note_tenants(self, tenants: StepTenants | None) -> None:
        self.inner.note_tenants(tenants)

    def tenant_slots(self) -> dict[str, tuple[int, int]]:
        return self.inner.tenant_slots()

    def supports_nested_forward(self) -> bool:
        return self.inner.supports_nested_forward()

    def resident_experts(self, layer: int) -> set[int] | None:
        return self.inner.resident_experts(layer)

    def stats(self, timeout: float | None = None) -> SourceStats:
        return self.inner.stats(timeout)

    def local_stats(self) -> StreamStats | None:
        return self.inner.local_stats()

    def step_reads(self) -> StepReads | None:
        return self.inner.step_reads()

    def describe(self) -> str:
        return self.inner.describe()

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self.inner.close()


TensorReader = Callable[[str], "np.ndarray | QuantizedMatrix"]

def keep_bf16(w: np.ndarray) -> np.ndarray:
    """float32 values that are all bf16 (low 16 bits zero) -> their bf16 bits (uint16); others unchanged."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    bits = w.view(np.uint32)
    if w.size and not np.any(bits & np.uint32(0xFFFF)):
        return (bits >> 16).astype(np.uint16)
    return w


def _widened(array: np.ndarray | QuantizedMatrix) -> np.ndarray:
    if isinstance(array, QuantizedMatrix):  # a matrix the trunk keeps quantized, wanted as float32 (never the case
        return array.dequantize()          # for the tensors a quantized pack writes; kept for any reader)
    if array.dtype == np.uint16:  # bf16 bits from a reader that keeps them (TrunkBlob.decode(keep_bf16=True))
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(array, dtype=np.float32)


def adjacent_view(parts: list[np.ndarray]) -> np.ndarray | None:
    """The row-wise stack of 2-D `parts` as one view when their rows continue one another in one buffer at one row
    stride, each row's elements contiguous (a store of format 2 packs each fused group so; an MXFP4 entry of format
    3 is two such views, nibbles and scales, at the stride of its rows), else None."""
    first = parts[0]
    row_stride, item = first.strides[0], first.itemsize
    if any(p.dtype != first.dtype or p.ndim != 2 or p.shape[1] != first.shape[1]
           or (p.shape[1] > 1 and p.strides[1] != item) or (p.shape[0] > 1 and p.strides[0] != row_stride)
           for p in parts) or row_stride < first.shape[1] * item:
        return None
    base = first
    while isinstance(base.base, np.ndarray):
        base = base.base
    for a, b in zip(parts, parts[1:]):
        if a.ctypes.data + a.shape[0] * row_stride != b.ctypes.data or not np.may_share_memory(b, base):
            return None
    rows = sum(p.shape[0] for p in parts)
    # NOTE: the view reaches past `first` into the other parts, which the adjacency check found in `base`
    return np.lib.stride_tricks.as_strided(first, shape=(rows, first.shape[1]), strides=(row_stride, item))


def adjacent_quantized_view(parts: list[QuantizedMatrix]) -> QuantizedMatrix | None:
    """The row-wise stack of Q8_0 or MXFP4 `parts` as one view of their bytes when their rows lie back to back in
    one buffer (Q8_0 blocks; MXFP4 laid out by rows, store format 3: nibbles and scales each one strided view),
    else None (an MXFP4 entry of format 2 is its nibbles then its scales: never one view)."""
    first = parts[0]
    if any(p.precision != first.precision or p.cols != first.cols for p in parts):
        return None
    data = adjacent_view([p.data for p in parts])
    if data is None or first.scales is None:
        return None if data is None else QuantizedMatrix(first.precision, data, None, first.cols)
    scales = adjacent_view([p.scales for p in parts])  # type: ignore[misc]
    if scales is None or scales.strides[0] != data.strides[0]:
        return None
    return QuantizedMatrix(first.precision, data, scales, first.cols)


def fuse_rows(parts: list[np.ndarray | QuantizedMatrix], views: bool = False) -> np.ndarray | QuantizedMatrix:
    """Stack matrices row-wise; bf16 bits stay bf16 and Q8_0 / MXFP4 bytes stay quantized when every part is, else
    all are widened. With `views`, bf16, Q8_0 or MXFP4 (by rows) parts adjacent in one buffer give a view of it, no
    copy."""
    if all(isinstance(part, QuantizedMatrix) for part in parts) and len({p.precision for p in parts}) == 1:
        view = adjacent_quantized_view(parts) if views else None  # type: ignore[arg-type]
        return view if view is not None else QuantizedMatrix.stack(parts)  # type: ignore[arg-type]
    if all(isinstance(part, np.ndarray) and part.dtype == np.uint16 for part in parts):
        view = adjacent_view(parts) if views else None  # type: ignore[arg-type]
        return view if view is not None else np.ascontiguousarray(np.concatenate(parts, axis=0))
    return keep_bf16(np.concatenate([_widened(part) for part in parts], axis=0))


def take_rows(matrix: np.ndarray | QuantizedMatrix, rows: np.ndarray) -> np.ndarray | QuantizedMatrix:
    """Rows `rows` of a trunk matrix as held (float32, bf16 bits, or Q8_0 / MXFP4 bytes), in that order (a copy)."""
    if isinstance(matrix, QuantizedMatrix):
        return matrix.take_rows(rows)
    return np.ascontiguousarray(matrix[rows])


def build_layer(config: K3Config, layer: int, read: TensorReader, trunk_dtype: str = "float32",
                views: bool = False, mlp: DenseMLPPieces | None = None) -> LayerWeights:
    """Assemble one layer from released tensors; `read(name)` returns a float32 (or native) array, or bf16 bits
    (uint16) for bf16-stored tensors. With `trunk_dtype` "bf16" the attention projections stay bf16 bits too
    (multiplied by `kernels.linear`); the MLP matrices are kept bf16 in both (`k3serve.weights.held.held_bytes` is
    the accounting). Q8_0 / MXFP4 matrices (a store packed with --trunk-precision) stay quantized whatever the
    trunk dtype. With `views` (a bf16 trunk read from a store of format 2) bf16 and quantized matrices and bf16 or
    quantized fused groups are views of the reader's arrays, never copies (`held.widened_bytes` is then what the
    layer holds beside them; an MXFP4 fused group of a format-2 store, planar, is stacked as a copy); `mlp` replaces
    a dense layer's MLP (read in pieces)."""
    if trunk_dtype not in TRUNK_DTYPES:
        raise ValueError(f"trunk dtype must be one of {', '.join(TRUNK_DTYPES)}, got {trunk_dtype!r}")
    p = names.layer_prefix(layer)
    f32 = lambda name: _widened(read(name))  # noqa: E731

    def kept(name: str) -> np.ndarray | QuantizedMatrix:
        """A matrix kept as its stored bf16 bits or Q8_0 / MXFP4 bytes (a copy unless `views`)."""
        array = read(name)
        if isinstance(array, QuantizedMatrix):
            return array if views else array.copy()
        if array.dtype == np.uint16:
            return array if views else np.array(array, copy=True)
        return keep_bf16(_widened(array))

    def mat(name: str) -> np.ndarray | QuantizedMatrix:
        """An attention projection: kept with a bf16 trunk, widened with a float32 one; quantized bytes (a store
        packed with --trunk-precision q8_0 or mxfp4) are kept whatever the trunk dtype."""
        if trunk_dtype == "bf16":
            return kept(name)
        array = read(name)
        return array.copy() if isinstance(array, QuantizedMatrix) else _widened(array)

    def fused(parts: list) -> np.ndarray | QuantizedMatrix:
        if trunk_dtype == "bf16" or any(isinstance(part, QuantizedMatrix) for part in parts):
            return fuse_rows(parts, views)
        return np.ascontiguousarray(np.concatenate(parts, axis=0))

    a = f"{p}self_attn."
    attention: KDAWeights | MLAWeights
    if config.is_mla(layer):
        NA, DN, DV, KL = config.num_mla_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        parts = [mat(f"{a}q_a_proj.weight"), mat(f"{a}kv_a_proj_with_mqa.weight")]
        if config.mla_use_output_gate:
            parts.append(mat(f"{a}g_proj.weight"))
        kv_b = f32(f"{a}kv_b_proj.weight").reshape(NA, DN + DV, KL)  # [NA, DN+DV, KL]
        attention = MLAWeights(
            in_proj=fused(parts),
            q_a_norm=f32(f"{a}q_a_layernorm.weight"),
            q_b=mat(f"{a}q_b_proj.weight"),
            kv_a_norm=f32(f"{a}kv_a_layernorm.weight"),
            w_uk=np.ascontiguousarray(kv_b[:, :DN, :]),
            w_uv=np.ascontiguousarray(kv_b[:, DN:, :]),
            o_proj=mat(f"{a}o_proj.weight"),
            has_gate=config.mla_use_output_gate,
        )
    else:
        NH = config.kda_num_heads
        in_parts = ([mat(f"{a}{n}_proj.weight") for n in ("q", "k", "v", "g")]
                    + [mat(f"{a}f_a_proj.weight"), mat(f"{a}b_proj.weight")])
        in_proj = fused(in_parts)
        del in_parts
        conv = np.concatenate([f32(f"{a}{n}_conv1d.weight")[:, 0, :] for n in ("q", "k", "v")], axis=0)
        attention = KDAWeights(
            in_proj=in_proj,
            f_b=f32(f"{a}f_b_proj.weight"),
            conv=np.ascontiguousarray(conv),
            a_exp=np.exp(f32(f"{a}A_log")[:NH]).astype(np.float32),
            dt_bias=f32(f"{a}dt_bias"),
            o_norm=f32(f"{a}o_norm.weight"),
            o_proj=mat(f"{a}o_proj.weight"),
        )
    if mlp is None and config.is_dense(layer):
        m = f"{p}mlp."
        mlp = DenseMLPWeights(
            gate_up=fuse_rows([read(f"{m}gate_proj.weight"), read(f"{m}up_proj.weight")], views),
            down=kept(f"{m}down_proj.weight"),
        )
    elif mlp is None:
        m = names.moe_prefix(layer)
        has_shared = config.shared_intermediate_size > 0
        mlp = MoEWeights(
            router=f32(f"{m}gate.weight"),
            router_bias=f32(f"{m}gate.e_score_correction_bias"),
            latent_down=kept(f"{m}routed_expert_down_proj.weight"),
            latent_up=kept(f"{m}routed_expert_up_proj.weight"),
            latent_norm=f32(f"{m}routed_expert_norm.weight"),
            shared_gate_up=fuse_rows(
                [read(f"{m}shared_experts.gate_proj.weight"), read(f"{m}shared_experts.up_proj.weight")], views
            ) if has_shared else None,
            shared_down=kept(f"{m}shared_experts.down_proj.weight") if has_shared else None,
        )
    return LayerWeights(
        input_norm=f32(f"{p}input_layernorm.weight"),
        post_attention_norm=f32(f"{p}post_attention_layernorm.weight"),
        attn_res_query=(f32(f"{p}self_attention_res_norm.weight")
                        * f32(f"{p}self_attention_res_proj.weight").reshape(-1)),
        mlp_res_query=f32(f"{p}mlp_res_norm.weight") * f32(f"{p}mlp_res_proj.weight").reshape(-1),
        attention=attention,
        mlp=mlp,  # type: ignore[arg-type]
    )


def build_small_globals(read: TensorReader, embed: np.ndarray | QuantizedMatrix | EmbeddingRows,
                        lm_head: np.ndarray | QuantizedMatrix | ChunkedHead) -> GlobalWeights:
    """The globals around an embedding and an lm_head given as they are held (a streaming source's floor)."""
    f32 = lambda name: _widened(read(name))  # noqa: E731
    return GlobalWeights(embed=embed, lm_head=lm_head, final_norm=f32(names.FINAL_NORM),
                         output_res_query=f32(names.OUTPUT_RES_NORM) * f32(names.OUTPUT_RES_PROJ).reshape(-1))


def build_globals(read: TensorReader, trunk_dtype: str = "float32") -> GlobalWeights:
    """With `trunk_dtype` "bf16" the embedding and the lm_head stay bf16 bits (rows widened on lookup, the head
    multiplied by `kernels.linear`)."""
    f32 = lambda name: _widened(read(name))  # noqa: E731

    def big(name: str) -> np.ndarray | QuantizedMatrix:
        """bf16: the reader's own bf16 bits (views of the globals' read buffer, which they keep alive: no copy);
        Q8_0 / MXFP4 bytes (a quantized pack, a GGUF's Q8_0) are kept, copied (a GGUF's are views of its mapped
        file), whatever the trunk dtype; the embedding decodes its rows."""
        array = read(name)
        if isinstance(array, QuantizedMatrix):
            return array.copy()
        if trunk_dtype == "bf16":
            return array if array.dtype == np.uint16 else keep_bf16(_widened(array))
        return _widened(array)
    return GlobalWeights(
        embed=big(names.EMBED),
        lm_head=big(names.LM_HEAD),
        final_norm=f32(names.FINAL_NORM),
        output_res_query=f32(names.OUTPUT_RES_NORM) * f32(names.OUTPUT_RES_PROJ).reshape(-1),
    )


def build_expert(layer: int, expert: int, read: TensorReader) -> ExpertWeights:
    """`read(name)` returns the uint8 array as stored."""
    def u8(matrix: str, part: str) -> np.ndarray:
        return np.ascontiguousarray(read(names.expert_name(layer, expert, matrix, part)), dtype=np.uint8)

    return ExpertWeights(
        w1_packed=u8("w1", "weight_packed"), w1_scales=u8("w1", "weight_scale"),
        w3_packed=u8("w3", "weight_packed"), w3_scales=u8("w3", "weight_scale"),
        w2_packed=u8("w2", "weight_packed"), w2_scales=u8("w2", "weight_scale"),
    )
