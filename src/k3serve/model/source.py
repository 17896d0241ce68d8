"""The resident weight source: everything in RAM, trunk as float32 and experts as their MXFP4 bytes.

The routed experts of each MoE layer are held stacked, one [NE, ...] array per matrix part, so that one compiled
call runs every active expert of a layer (`stacked_experts`); `experts()` hands out views into those stacks.

`trunk_precision` "q8_0" / "mxfp4" quantizes the trunk matrices at load (the ones `pack --trunk-precision`
quantizes: `weights.held.quantized_in_trunk`, the embedding and the lm_head included), multiplied from their bytes.

`share()` moves the weights into sealed read-only pages (weights/shared_pages.py) that another process maps with
`ResidentSource.from_shared`: `k3serve serve` and its lab worker hold one copy of the model between them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from k3serve.config import K3Config
from k3serve.model.kernels import StackedExperts
from k3serve.model.weights import (ExpertWeights, GlobalWeights, LayerWeights, WeightSource, build_expert,
                                   build_globals, build_layer)
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.held import quantized_in_trunk
from k3serve.weights.huge_pages import gather_small_arrays
from k3serve.weights.quantized import QuantizedMatrix, check_load_trunk_precision, quantize_matrix
from k3serve.weights.shared_pages import SharedArrays, SharedPagesWriter, to_refs

_PARTS = ("w1_packed", "w1_scales", "w3_packed", "w3_scales", "w2_packed", "w2_scales")


def quantizing_reader(read: Callable[[str], np.ndarray | QuantizedMatrix], precision: str
                      ) -> Callable[[str], np.ndarray | QuantizedMatrix]:
    """`read` with every trunk matrix `quantized_in_trunk` picks quantized to `precision` (bytes already at it kept)."""
    def read_quantized(name: str) -> np.ndarray | QuantizedMatrix:
        array = read(name)
        if quantized_in_trunk(name, array.shape) and (isinstance(array, QuantizedMatrix) or array.dtype != np.uint8):
            return quantize_matrix(array, precision)
        return array
    return read_quantized


class ResidentSource(WeightSource):
    """Loads a whole checkpoint into memory at construction. The baseline every streaming source must match.
    `trunk_precision`: "native" (as stored) or "q8_0" / "mxfp4" (the trunk matrices quantized at load)."""

    def __init__(self, checkpoint: Checkpoint, trunk_precision: str = "native") -> None:
        self.config: K3Config = checkpoint.config
        precision = check_load_trunk_precision(trunk_precision)
        read = checkpoint.read if precision == "native" else quantizing_reader(checkpoint.read, precision)
        self._globals = build_globals(read)
        self._layers = [build_layer(self.config, layer, read) for layer in range(self.config.num_layers)]
        # small trunk matrices onto huge pages (weights/huge_pages.py): read from DRAM at every decode step
        self._globals, self._layers = gather_small_arrays((self._globals, self._layers))
        self._stacks: dict[int, StackedExperts] = {}
        self._experts: dict[tuple[int, int], ExpertWeights] = {}
        for layer in self.config.moe_layer_ids:
            stack: list[np.ndarray] = []
            for expert in range(self.config.num_experts):
                weights = build_expert(layer, expert, read)
                if not stack:  # [NE, rows, bytes] per part, filled expert by expert (no second copy)
                    stack = [np.empty((self.config.num_experts, *getattr(weights, part).shape), np.uint8)
                             for part in _PARTS]
                for array, part in zip(stack, _PARTS):
                    array[expert] = getattr(weights, part)
            self._stacks[layer] = tuple(stack)  # type: ignore[assignment]
        self._index_experts()

    def _index_experts(self) -> None:
        """Each routed expert as views into its layer's stacks."""
        self._experts = {(layer, expert): ExpertWeights(*(array[expert] for array in stack))
                         for layer, stack in self._stacks.items() for expert in range(self.config.num_experts)}

    @classmethod
    def from_shared(cls, shared: SharedArrays) -> ResidentSource:
        """A source over weights another process placed in shared pages (`share`): read-only views, no copy."""
        source = cls.__new__(cls)
        source.config = shared.about
        source._globals, source._layers, source._stacks = shared.materialize()
        source._index_experts()
        return source

    def share(self) -> SharedArrays:
        """Move every weight into sealed shared pages, in place: afterwards this source reads read-only views of
        them, and the returned handle lets another process map the same pages (pickled into a spawned process, it
        travels as a file descriptor). The arrays move one layer at a time, so at most one layer is held twice. If
        it fails (no memory for the pages) the source is left unusable and the error goes to the caller, whose
        load fails."""
        writer = SharedPagesWriter("k3serve-weights")
        try:
            self._experts = {}  # views into the stacks: dropped so that each stack is freed once written
            globals_ref = to_refs(self._globals, writer)
            self._globals = None  # type: ignore[assignment]
            layer_refs = []
            for layer in range(len(self._layers)):
                layer_refs.append(to_refs(self._layers[layer], writer))
                self._layers[layer] = None  # type: ignore[call-overload]
            stack_refs = {layer: to_refs(self._stacks.pop(layer), writer) for layer in list(self._stacks)}
            shared = SharedArrays(writer.seal(), (globals_ref, layer_refs, stack_refs), about=self.config)
        except BaseException:
            writer.close()
            raise
        self._globals, self._layers, self._stacks = shared.materialize()
        self._index_experts()
        return shared

    def global_weights(self) -> GlobalWeights:
        return self._globals

    def layer(self, layer: int) -> LayerWeights:
        return self._layers[layer]

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        return {e: self._experts[(layer, e)] for e in expert_ids}

    def stacked_experts(self, layer: int) -> StackedExperts:
        """The layer's routed experts as (w1 packed, w1 scales, w3 packed, w3 scales, w2 packed, w2 scales),
        each [NE, ...] (k3serve.model.kernels.mxfp4_experts_run)."""
        return self._stacks[layer]

    @property
    def nbytes(self) -> int:
        trunk = sum(layer.nbytes for layer in self._layers)
        trunk += sum(a.nbytes for a in vars(self._globals).values())
        return trunk + sum(array.nbytes for stack in self._stacks.values() for array in stack)
