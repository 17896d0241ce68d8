"""What an architecture's opener hands back to `load_model` (loading/__init__.py), before the loader's shared steps
(the tokenizer checked against the vocabulary, threads, kernels) make it a `LoadedModel`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from k3serve.hf_tokenizer import HFTokenizer
from k3serve.model.interface import Model
from k3serve.model.weights import WeightSource
from k3serve.tokenizer import Tokenizer
from k3serve.weights.checkpoint import Checkpoint

# A K3 store's streaming source wrapped before the model is built on it (expert parallelism: the owners compute
# the routed experts, cluster/expert_actors.py).
ExpertWrapper = Callable[[WeightSource], WeightSource]


@dataclass(frozen=True)
class Opened:
    model: Model
    tokenizer: Tokenizer | HFTokenizer | None  # None: none shipped (or, for a GGUF file, read from its metadata)
    checkpoint: Checkpoint | None = None  # a K3 checkpoint read resident; None otherwise
