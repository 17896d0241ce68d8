"""The resident weight source: everything in RAM, trunk as float32 and experts as their MXFP4 bytes."""

from __future__ import annotations

from typing import Mapping, Sequence

from k3serve.config import K3Config
from k3serve.weights.checkpoint import Checkpoint
from k3serve.model.weights import (ExpertWeights, GlobalWeights, LayerWeights, build_expert, build_globals,
                                   build_layer)


class ResidentSource:
    """Loads a whole checkpoint into memory at construction. The baseline every streaming source must match."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.config: K3Config = checkpoint.config
        read = checkpoint.read
        self._globals = build_globals(read)
        self._layers = [build_layer(self.config, layer, read) for layer in range(self.config.num_layers)]
        self._experts: dict[tuple[int, int], ExpertWeights] = {
            (layer, expert): build_expert(layer, expert, read)
            for layer in self.config.moe_layer_ids
            for expert in range(self.config.num_experts)
        }

    def global_weights(self) -> GlobalWeights:
        return self._globals

    def layer(self, layer: int) -> LayerWeights:
        return self._layers[layer]

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        return {e: self._experts[(layer, e)] for e in expert_ids}

    @property
    def nbytes(self) -> int:
        trunk = sum(layer.nbytes for layer in self._layers)
        trunk += sum(a.nbytes for a in vars(self._globals).values())
        return trunk + sum(e.nbytes for e in self._experts.values())
