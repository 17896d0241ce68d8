"""Finding and opening models: a checkpoint folder given by the user, or the embedded default model.

The embedded default is a deterministic K3 generated from a fixed seed on first use, with the tokenizer that
ships in the package. It lives in the user cache directory ($K3SERVE_CACHE, else $XDG_CACHE_HOME/k3serve, else
~/.cache/k3serve), is written to a temporary folder and renamed into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from threadpoolctl import threadpool_limits

from k3serve.config import K3Config
from k3serve.errors import CheckpointError, ConfigError, TokenizerError
from k3serve.model.families import FamilyModel, is_family_checkpoint, load_family
from k3serve.model.k3 import K3Model
from k3serve.model.kernels import warmup as warmup_kernels
from k3serve.model.source import ResidentSource
from k3serve.hf_tokenizer import HFTokenizer
from k3serve.tokenizer import Tokenizer, default_tokenizer_dir
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.synthetic import write_random_checkpoint

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "k3-random-default-v1"
DEFAULT_MODEL_SEED = 20261203


def cache_root() -> Path:
    if os.environ.get("K3SERVE_CACHE"):
        return Path(os.environ["K3SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3serve"


def default_model_config(tokenizer: Tokenizer) -> K3Config:
    """The generated default: 8 layers (KKKM KKKM), 32 experts of which 4 active, a 1032-token vocabulary."""
    return K3Config(
        hidden_size=256, num_layers=8, vocab_size=tokenizer.vocab_size, rms_norm_eps=1e-5,
        num_mla_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, mla_use_output_gate=True, num_experts=32, num_experts_per_token=4, num_shared_experts=1,
        latent_size=128, moe_intermediate_size=128, routed_scaling_factor=1.0, moe_renormalize=True,
        latent_moe_use_norm=True, router_activation="sigmoid", num_expert_group=1, topk_group=1,
        first_k_dense_replace=1, intermediate_size=512, attn_res_block_size=3, situ_beta=4.0,
        situ_linear_beta=25.0, kda_num_heads=4, kda_head_dim=64, short_conv_kernel_size=4,
        gate_lower_bound=-5.0, full_attn_layers=(4, 8), kda_layers=(1, 2, 3, 5, 6, 7),
        bos_token_id=tokenizer.bos_id, eos_token_ids=tuple(tokenizer.eos_ids),
    )


def default_model_dir() -> Path:
    """The embedded default model's folder, generated on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_dir(default_tokenizer_dir())
    logger.info("generating the default model in %s (first use only)", target)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        write_random_checkpoint(default_model_config(tokenizer), staging, seed=DEFAULT_MODEL_SEED,
                                tokenizer_dir=default_tokenizer_dir())
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass
class LoadedModel:
    model: K3Model | FamilyModel
    checkpoint: Checkpoint | None  # None for the other families (their tensors are read through the family)
    tokenizer: Tokenizer | HFTokenizer | None
    path: Path

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = list(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            ids += list(self.tokenizer.eos_ids)
        return tuple(dict.fromkeys(ids))


# Below this hidden size a trunk matmul is too small to gain from several BLAS threads, and idle OpenBLAS threads
# spinning after each call take the cores from the numba expert kernels (measured: -15% decode at batch 16).
SINGLE_THREAD_BLAS_MAX_HIDDEN = 1024


def configure_threads(hidden_size: int) -> None:
    """Give small models' matmuls one BLAS thread, leaving the cores to the parallel expert kernels."""
    if hidden_size <= SINGLE_THREAD_BLAS_MAX_HIDDEN:
        threadpool_limits(limits=1, user_api="blas")


def load_model(path: str | Path | None = None, expert_precision: str = "native", stream=None) -> LoadedModel:
    """Open a checkpoint folder (or the default model) with the resident weight source.

    K3 checkpoints go to `K3Model`; Kimi Linear, DeepSeek-V3 / Kimi K2, Qwen3-MoE and Qwen3-Next checkpoints
    (by their config's model_type) to the family models, whose bf16 experts may be quantized at load."""
    from k3serve.weights.store import is_packed_store

    if stream is not None or (path is not None and is_packed_store(path)):
        # a packed store, or any streaming option (`stream`: k3serve.stream.source.StreamOptions)
        from k3serve.stream.loading import load_streaming
        from k3serve.stream.source import StreamOptions

        return load_streaming(path, stream if stream is not None else StreamOptions())
    folder = Path(path) if path is not None else default_model_dir()
    if is_family_checkpoint(folder):
        family = load_family(folder, expert_precision=expert_precision)
        family_tokenizer = None
        if (folder / "tiktoken.model").exists():
            try:
                family_tokenizer = Tokenizer.from_dir(folder)
            except TokenizerError as exc:
                logger.warning("%s: tokenizer not usable (%s); pass token ids instead", folder, exc)
        elif (folder / "tokenizer.json").exists():
            try:
                family_tokenizer = HFTokenizer.from_dir(folder)
            except TokenizerError as exc:
                logger.warning("%s: tokenizer not usable (%s); pass token ids instead", folder, exc)
        return LoadedModel(model=family, checkpoint=None, tokenizer=family_tokenizer, path=folder)
    if expert_precision not in ("native", "mxfp4"):
        raise ConfigError(f"K3 experts ship as MXFP4; --expert-precision {expert_precision!r} applies to the other "
                          "families")
    checkpoint = Checkpoint(folder)
    tokenizer = Tokenizer.from_dir(checkpoint.tokenizer_dir) if checkpoint.tokenizer_dir else None
    if tokenizer is not None and tokenizer.vocab_size > checkpoint.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {checkpoint.config.vocab_size}"
        )
    model = K3Model(ResidentSource(checkpoint))
    configure_threads(checkpoint.config.hidden_size)
    warmup_kernels()  # compile (or load the cached) numba kernels now, not inside the first request
    return LoadedModel(model=model, checkpoint=checkpoint, tokenizer=tokenizer, path=folder)
