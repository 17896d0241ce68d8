"""A returning prompt at full scale: its prefix restored from the prefix cache's disk tier against recomputed.

A user comes back to an N-token conversation whose KDA state checkpoint and MLA latent rows have left RAM. The
engine either reads them back from the disk tier (engine/prefix_disk.py) or prefills all N positions again. One
checkpoint file at position p holds, in float32 as the engine writes it,

    MLA rows     LA x p x (KL + DR)                        LA MLA layers, KL latent, DR k_rope part
    KDA state    LK x (NH x D x D  +  (K - 1) x 3P)        LK KDA layers: S and the short conv's tail of q, k, v
    logits       V                                         only at a prompt's end (an exact repeat hits whole)

behind one 4 KiB header page, each part padded to 4 KiB (O_DIRECT). The full K3 (LA 24, LK 69, NH 96, D 128,
K 4, P 12,288, KL + DR 576): 464.6 MB of KDA state whatever p, plus 55,296 bytes per position.

Time to first token of the returning prompt (N cached positions, then M new ones):

    restore     = file bytes / the disk's rate for one read that size (the tier reads a file in one request)
                  + file bytes / checksum rate (blake2b-128 over the payload, checked on every hit)
                  + the prefill step of the M new positions (the simulator, through streamed experts)
    recompute   = the prefill of all N + M positions, in steps of `prefill_chunk` (the engine's max_batch_tokens)

Both prefills run on the same simulated machine and budget from a cold expert cache (the trunk pinned as the plan
says). Not modelled: the copy of the restored arrays into the pools (memory bandwidth, well under the read), and
whether the checkpoint's own RAM fits beside the weights' budget (the sim's budget covers weights only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from k3serve.config import K3Config
from k3serve.sim.full import SimConfig, SimConfigError, simulate

FLOAT32_BYTES = 4
PAGE = 4096  # the disk tier's alignment: one header page, the payload padded to a page
# blake2b-128 over a payload: hashlib on this project's 2-core VM (AMD EPYC), best of 3 over 256 MiB under load
# from other jobs (0.33-0.54 GB/s); a quiet core is faster, so this overstates a restore's checksum time
CHECKSUM_BYTES_PER_S = 0.54e9
ENGINE_PREFILL_CHUNK = 2048  # EngineConfig.max_batch_tokens: prompt positions per step


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass(frozen=True)
class CheckpointBytes:
    """One disk-tier checkpoint at `position`, by part (payload bytes, unpadded) and as a file."""

    position: int
    mla_row_bytes: int  # every MLA layer's latent rows for positions [0, position)
    kda_state_bytes: int  # every KDA layer's S and conv tail
    logits_bytes: int

    @property
    def payload_bytes(self) -> int:
        return self.mla_row_bytes + self.kda_state_bytes + self.logits_bytes

    @property
    def file_bytes(self) -> int:
        """The file as the tier writes it: one header page (the tail of < one block of token ids fits) and the
        payload padded to a page."""
        return PAGE + _pages(self.payload_bytes)


def checkpoint_bytes(config: K3Config, position: int, with_logits: bool = False) -> CheckpointBytes:
    """The bytes of one checkpoint at `position` for a model of `config`'s shapes (the module docstring)."""
    if position < 0:
        raise SimConfigError(f"a checkpoint position must be >= 0, got {position}")
    row = config.kv_lora_rank + config.qk_rope_head_dim  # KL + DR, one MLA layer's row per position
    state = config.kda_num_heads * config.kda_head_dim * config.kda_head_dim  # S [NH, D, D]
    conv_tail = (config.short_conv_kernel_size - 1) * 3 * config.kda_num_heads * config.kda_head_dim  # [K-1, 3P]
    return CheckpointBytes(
        position=position,
        mla_row_bytes=FLOAT32_BYTES * len(config.mla_layer_ids) * position * row,
        kda_state_bytes=FLOAT32_BYTES * len(config.kda_layer_ids) * (state + conv_tail),
        logits_bytes=FLOAT32_BYTES * config.vocab_size if with_logits else 0)


@dataclass(frozen=True)
class ReturningPrompt:
    """Restore against recompute for one returning prompt on one machine and budget (seconds, bytes)."""

    prompt_tokens: int  # N: the positions the checkpoint holds
    new_tokens: int  # M: computed after the restore, in both arms
    checkpoint: CheckpointBytes
    read_seconds: float
    checksum_seconds: float
    new_tokens_seconds: float  # the prefill step of the M new positions after a restore
    new_tokens_expert_bytes: float
    recompute_seconds: float  # the prefill of N + M positions
    recompute_expert_bytes: float
    recompute_steps: int

    @property
    def restore_seconds(self) -> float:
        return self.read_seconds + self.checksum_seconds + self.new_tokens_seconds

    @property
    def speedup(self) -> float:
        return self.recompute_seconds / self.restore_seconds

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["checkpoint"]["file_bytes"] = self.checkpoint.file_bytes
        out.update(restore_seconds=self.restore_seconds, speedup=self.speedup)
        return out

    def lines(self) -> list[str]:
        c = self.checkpoint
        gb = 1e9
        return [
            f"checkpoint        at {self.prompt_tokens} positions: {c.file_bytes / gb:.3f} GB on disk (KDA state "
            f"{c.kda_state_bytes / gb:.3f} GB, MLA rows {c.mla_row_bytes / gb:.3f} GB)",
            f"restore           read {self.read_seconds:.3f} s + checksum {self.checksum_seconds:.3f} s + "
            f"{self.new_tokens} new position(s) {self.new_tokens_seconds:.3f} s = TTFT {self.restore_seconds:.3f} s",
            f"recompute         {self.prompt_tokens + self.new_tokens} positions in {self.recompute_steps} step(s): "
            f"TTFT {self.recompute_seconds:.3f} s (experts {self.recompute_expert_bytes / gb:.1f} GB read)",
            f"restore vs recompute  {self.speedup:.1f}x less time to first token",
        ]


def simulate_returning(cfg: SimConfig, prompt_tokens: int, new_tokens: int = 1,
                       prefill_chunk: int = ENGINE_PREFILL_CHUNK,
                       checksum_bytes_per_s: float = CHECKSUM_BYTES_PER_S) -> ReturningPrompt:
    """Restore against recompute for a returning `prompt_tokens` prompt with `new_tokens` after it, on `cfg`'s
    machine, budget and policies (its batch must be 1; its own prompt and decode settings are replaced)."""
    if prompt_tokens < 1 or new_tokens < 1:
        raise SimConfigError(f"a returning prompt needs >= 1 cached and >= 1 new position, got {prompt_tokens} "
                             f"and {new_tokens}")
    if cfg.batch != 1:
        raise SimConfigError("a returning prompt is simulated for one sequence (batch 1)")
    if not checksum_bytes_per_s > 0:
        raise SimConfigError(f"the checksum rate must be positive, got {checksum_bytes_per_s}")
    from k3serve.config import full_k3_config

    model = cfg.model or full_k3_config()
    checkpoint = checkpoint_bytes(model, prompt_tokens)
    size = checkpoint.file_bytes
    read = size / (cfg.drives * cfg.machine.disk.bandwidth(size // cfg.drives, 1))

    def prefill(positions: int) -> dict:
        step = dataclasses.replace(cfg, prompt_tokens=positions, prefill_chunk=min(prefill_chunk, positions),
                                   tokens=1, warmup=0, count_prefill=False, speculative=0,
                                   speculative_io_aware=False)
        return simulate(step).prefill

    after_restore = prefill(new_tokens)
    recompute = prefill(prompt_tokens + new_tokens)
    return ReturningPrompt(
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, checkpoint=checkpoint, read_seconds=read,
        checksum_seconds=checkpoint.payload_bytes / checksum_bytes_per_s,
        new_tokens_seconds=after_restore["seconds"], new_tokens_expert_bytes=after_restore["expert_bytes"],
        recompute_seconds=recompute["seconds"], recompute_expert_bytes=recompute["expert_bytes"],
        recompute_steps=recompute["steps"])
