"""Routers, the routed MoE block with shared experts, and the dense MLP of the families.

Softmax top-k routing (Qwen3-MoE, Qwen3-Next):
    p = softmax(W_r x);  chosen = top-k of p;  weight_e = p_e (/ sum of chosen p, if norm_topk_prob)
Grouped sigmoid routing with a selection-only bias (DeepSeek-V3 section 2.1.2 "auxiliary-loss-free balancing";
DeepSeek-V3 / Kimi K2 / Kimi Linear):
    s = sigmoid(W_r x);  c = s + bias;  group score = sum of the 2 largest c in each of NG groups;
    keep the topk_group best groups;  chosen = top-k of c within them;
    weight_e = s_e / (sum of chosen s + 1e-20) (if norm_topk_prob) * routed_scaling_factor
MoE block:
    out = sum_{e chosen} weight_e * Expert_e(x) + Shared(x)          (DeepSeek-V3, Kimi Linear: shared_experts)
    out = sum_{e chosen} weight_e * Expert_e(x) + sigmoid(w_sg . x) * Shared(x)     (Qwen3-Next: shared_expert)
Every MLP here is a SiLU-GLU: down(SiLU(gate x) * up x). Each routed expert runs once per forward on all the
tokens routed to it, all the layer's active experts in one compiled call (`ExpertSource.expert_outputs`); the
weighted outputs are added per token in ascending expert id. Ties in the top-k go to the lower expert id.
Shapes: T tokens, NE experts, TOPK active, NG groups, H hidden, S shared width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.expert_source import ExpertSource
from k3serve.model.families.experts import ExpertStore, outputs_one_by_one
from k3serve.model.fused_ops import shift_by_row_max, softmax_top_k
from k3serve.model.kernels import accumulate_expert_rows, linear
from k3serve.model import routing as routing_module
from k3serve.model.routing import ExpertTopP, Routing, keep_top_p, pairs_by_expert
from k3serve.model.ops import sigmoid


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices [T, k] of the k largest values per row, best first; the stable sort keeps lower ids first."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


@dataclass(frozen=True)
class SoftmaxRouter:
    weight: np.ndarray  # [NE, H]
    top_k: int
    normalize: bool

    def __call__(self, x: np.ndarray) -> Routing:
        logits = np.ascontiguousarray(x @ self.weight.T, dtype=np.float32)  # [T, NE]
        shift_by_row_max(logits)
        np.exp(logits, out=logits)  # numpy's exp between the two compiled stages: softmax's bits
        ids = np.empty((logits.shape[0], self.top_k), np.int64)  # [T, TOPK]
        weights = np.empty((logits.shape[0], self.top_k), np.float32)  # [T, TOPK]
        softmax_top_k(logits, self.normalize, ids, weights)
        return Routing(expert_ids=ids, weights=weights)


@dataclass(frozen=True)
class GroupedSigmoidRouter:
    weight: np.ndarray  # [NE, H]
    bias: np.ndarray  # [NE] e_score_correction_bias, selection only
    top_k: int
    num_groups: int  # NG
    topk_group: int
    normalize: bool
    scaling_factor: float

    def __call__(self, x: np.ndarray) -> Routing:
        scores = sigmoid(x @ self.weight.T)  # [T, NE]
        choice = scores + self.bias  # [T, NE]
        if self.num_groups > 1:
            T, NE = choice.shape
            grouped = choice.reshape(T, self.num_groups, NE // self.num_groups)  # [T, NG, NE/NG]
            group_scores = np.sum(-np.sort(-grouped, axis=2)[:, :, :2], axis=2)  # [T, NG]
            keep = np.zeros((T, self.num_groups), dtype=bool)
            np.put_along_axis(keep, _top_k(group_scores, self.topk_group), True, axis=1)
            choice = np.where(np.repeat(keep, NE // self.num_groups, axis=1), choice, -np.inf)
        ids = _top_k(choice, self.top_k)  # [T, TOPK]
        chosen = np.take_along_axis(scores, ids, axis=1)
        if self.normalize:
            chosen = chosen / (np.sum(chosen, axis=1, keepdims=True) + np.float32(1e-20))
        return Routing(expert_ids=ids, weights=(chosen * np.float32(self.scaling_factor)).astype(np.float32))


@dataclass(frozen=True)
class GLUWeights:
    gate_up: np.ndarray  # [2I, H] gate and up stacked
    down: np.ndarray  # [H, I]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # a long prompt PREFILL_CHUNK_TOKENS rows at a time: gate and up [T, 2I] and the product [T, I] were the peak of
        # a 2048-token prefill (Moonlight's dense layer 0, I = 11264: 368 MB); each row runs the same operations
        # (a Q8_0 trunk's row dot gives it the same bits; bf16 and float32 matrices go to BLAS from 32 rows, which
        # may round another row count differently)
        step = routing_module.PREFILL_CHUNK_TOKENS
        if x.shape[0] <= step:
            return self._rows(x)
        out = np.empty((x.shape[0], self.down.shape[0]), np.float32)  # [T, H]
        for first in range(0, x.shape[0], step):
            out[first:first + step] = self._rows(x[first:first + step])
        return out

    def _rows(self, x: np.ndarray) -> np.ndarray:
        h = linear(x, self.gate_up)  # [T, 2I]
        width = self.down.shape[1]
        return linear(_silu_glu(h[:, :width], h[:, width:]), self.down)


def _silu_glu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up with one new [T, I] array (`ops.silu`'s operations in its order, in place: the same bits)."""
    out = np.multiply(gate, np.float32(0.5))
    np.tanh(out, out=out)
    out *= np.float32(0.5)
    out += np.float32(0.5)  # sigmoid(gate)
    out *= gate
    out *= up
    return out


@dataclass
class DenseMLP:
    weights: GLUWeights

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, None]:
        return self.weights(x), None


@dataclass
class MoEBlock:
    layer: int
    router: SoftmaxRouter | GroupedSigmoidRouter
    experts: ExpertSource  # the model's (FamilyModel.use_experts switches every block at once)
    shared: GLUWeights | None
    shared_gate: np.ndarray | None  # [1, H]: Qwen3-Next scales the shared expert by sigmoid(w . x)
    top_p: ExpertTopP = ExpertTopP()  # --expert-top-p (FamilyModel.limit_experts); kept weights renormalized as
    # the router normalizes its chosen set (norm_topk_prob)

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, Routing]:
        routing = keep_top_p(self.router(x), self.top_p, self.router.normalize)
        out = np.zeros(x.shape, np.float32)  # [T, H]
        # The resident store runs a long prompt's experts EXPERT_CHUNK_TOKENS tokens at a time (routing.py); every
        # expert path but BLAS (bf16 / float32 experts with 256 tokens or more) and the block-scaled tile gives a
        # token the same bits whatever the other tokens. A streaming store would read its experts once a chunk.
        step = routing_module.EXPERT_CHUNK_TOKENS if isinstance(self.experts, ExpertStore) else max(1, x.shape[0])
        for first in range(0, x.shape[0], step):
            rows = slice(first, first + step)
            pairs = pairs_by_expert(routing.expert_ids[rows])  # experts ascending: a fixed order per token
            y = self.experts.expert_outputs(self.layer, pairs, x[rows])  # [N, H]
            if y is None:  # a source that hands out experts one by one
                y = outputs_one_by_one(self.experts.experts(self.layer, pairs.expert_ids), pairs, x[rows])
            accumulate_expert_rows(y, pairs.tokens, routing.weights[rows].ravel()[pairs.order], out[rows])
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * sigmoid(x @ self.shared_gate.T)  # [T, 1] broadcast
            out += shared
        return out, routing
