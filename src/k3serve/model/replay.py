"""Replaying the delta rule over a recorded segment: the state after any prefix of it.

Per head, with S [Dk, Dv], for each position t of the segment:
    S <- diag(exp(g_t)) S;   u = S^T k_t;   S <- S + k_t (beta_t (v_t - u))^T
and the short-conv tail after n positions is the last K-1 rows of [tail_0; x_1 .. x_n] (x the pre-conv inputs).
KDA (K3, Kimi Linear) and gated DeltaNet (Qwen3-Next, decay equal across key channels) both record a
`DeltaRuleWindow` per multi-token segment; speculative rollback (model/rollback.py) uses it to rebuild the state
after the kept positions, either by replaying on demand or by materialising every intermediate state.

Shapes: T positions, n kept positions, NH heads, Dk / Dv head dims, K conv kernel, C conv channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.delta_rule import delta_rule_trajectory as compiled_trajectory


def delta_rule_trajectory(k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
                          num_steps: int | None = None, keep_all: bool = False) -> np.ndarray:
    """Replay the delta rule from `state` [NH, Dk, Dv] over the first `num_steps` of k, g [T, NH, Dk],
    v [T, NH, Dv], beta [T, NH].

    Returns the final state, or with `keep_all` every intermediate state [n, NH, Dk, Dv]. The compiled loop of the
    forward pass (model/delta_rule.py), so a replayed state has the bits the forward pass left at that token."""
    n = k.shape[0] if num_steps is None else num_steps
    return compiled_trajectory(k, v, g, beta, state, n, keep_all)


def conv_tail_after(tail: np.ndarray, conv_inputs: np.ndarray, num_steps: int) -> np.ndarray:
    """The conv tail [K-1, C] after feeding the first `num_steps` rows of conv_inputs [T, C] to `tail`."""
    full = np.concatenate([tail, conv_inputs[:num_steps]], axis=0)
    return full[full.shape[0] - tail.shape[0]:].copy()


@dataclass
class DeltaRuleWindow:
    """One delta-rule layer's record of a segment: the state before it and the vectors each position consumed.
    Satisfies `model.cache.RecurrentWindow`."""

    state: np.ndarray  # [NH, Dk, Dv] before the segment
    tail: np.ndarray  # [K-1, C] before the segment
    k: np.ndarray  # [T, NH, Dk]
    v: np.ndarray  # [T, NH, Dv]
    g: np.ndarray  # [T, NH, Dk]
    beta: np.ndarray  # [T, NH]
    conv_inputs: np.ndarray  # [T, C] pre-conv inputs

    @property
    def num_positions(self) -> int:
        return int(self.k.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.state, self.tail, self.k, self.v, self.g, self.beta, self.conv_inputs))

    def detached(self) -> DeltaRuleWindow:
        return DeltaRuleWindow(*(np.array(a, np.float32) for a in (self.state, self.tail, self.k, self.v, self.g,
                                                                    self.beta, self.conv_inputs)))

    def state_after(self, num_kept: int) -> tuple[np.ndarray, np.ndarray]:
        state = delta_rule_trajectory(self.k, self.v, self.g, self.beta, self.state, num_kept)
        return state, conv_tail_after(self.tail, self.conv_inputs, num_kept)

    def all_states(self) -> tuple[np.ndarray, np.ndarray]:
        states = delta_rule_trajectory(self.k, self.v, self.g, self.beta, self.state, keep_all=True)
        tails = np.stack([conv_tail_after(self.tail, self.conv_inputs, n) for n in range(1, self.num_positions + 1)])
        return states, tails
