"""The engine configuration: one frozen dataclass built at the entry point and passed down.

Memory for the attention rows is a pool of `num_blocks` blocks of `block_size` positions; give either
`num_blocks` or `kv_cache_bytes` (the number of blocks is then derived from the model's `CacheLayout`). The
recurrent state pool has one slot per running sequence (`max_seqs` by default); the prefix cache keeps up to
`num_state_checkpoints` state checkpoints beside the cached attention blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.config import DEFAULT_MAX_MODEL_LEN
from k3serve.errors import ConfigError
from k3serve.model.cache import CacheLayout

PREFIX_CACHE_POLICIES = ("lru", "slru")  # state checkpoint replacement (engine/prefix_cache.py)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # positions per attention cache block
    num_blocks: int | None = None  # attention cache blocks; None = derive from kv_cache_bytes
    kv_cache_bytes: int = 64 << 20  # attention cache budget when num_blocks is None (allocated up front)
    max_batch_tokens: int = 2048  # tokens per forward step (prefill chunks + decodes)
    max_seqs: int = 64  # running sequences per step
    max_decode_seqs: int | None = None  # decodes per forward (None: every running one the token budget allows);
    # below max_seqs, running sequences beyond it hold their memory and wait a step (engine/expert_batching.py)
    batch_by_experts: bool = False  # among more ready decodes than a step takes, prefer those whose predicted
    # experts overlap (engine/expert_batching.py; --batch-by-experts)
    batch_by_experts_max_wait: int = 4  # steps in a row a decode the baseline would run may be passed over
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # prompt + generated tokens of one sequence
    enable_chunked_prefill: bool = True  # split long prompts across steps under max_batch_tokens
    enable_prefix_caching: bool = True
    num_state_checkpoints: int = 64  # recurrent state checkpoints the prefix cache may hold
    checkpoint_partial_blocks: bool = True  # checkpoints at any position (tail rows kept in the checkpoint);
    # False = only at block boundaries (like vLLM's 'align' mode), which cannot hit below one block
    checkpoint_every_blocks: int = 0  # also checkpoint every N full blocks of prefill (0 = never)
    prefix_wait_tokens: int = 32  # a waiting sequence waits while a running one of the same tenant and salt still
    # computes at least this many tokens of their shared prefix beyond the cache's hit, then hits there (0 = never)
    prefix_cache_policy: str = "slru"  # checkpoint replacement: lru, or slru (hit ones protected from one-shot ones;
    # engine/prefix_cache.py)
    prefix_cache_dir: str | None = None  # the prefix cache's disk tier: checkpoints that leave RAM are written
    # here and restored by a later hit (engine/prefix_disk.py); None = RAM only
    prefix_cache_disk_bytes: int = 0  # the disk tier's size (required with prefix_cache_dir)
    num_state_slots: int | None = None  # recurrent state slots; None = max_seqs
    admission_watermark: float = 0.01  # fraction of blocks (at least one) left free when admitting a sequence,
    # so that running sequences can grow a little before anyone is preempted (avoids admit-preempt thrashing)
    scheduling: str = "fcfs"  # between tenants: fcfs, fair (Virtual Token Counter) or priority (engine/fairness.py)
    output_cost: float = 2.0  # fair/priority: an output token's charge relative to a prompt token
    charge: str = "tokens"  # what advances a tenant's virtual counter: tokens, or io (tokens and seconds waiting
    # on the disk, engine/io_usage.py)
    io_cost: float = 1000.0  # charge='io': tokens one second of waiting on reads costs
    tenant_cache_shares: bool = False  # each active tenant owns a share of the expert cache (by weight): its misses
    # evict its own experts once it holds its share (stream/expert_cache.py; --tenant-cache-shares)
    tenant_cache_hold_s: float = 10.0  # a tenant counts as around this long after its last sequence left: it keeps
    # its expert cache share, and (defer_io_heavy) heavy-only steps stay short for it
    defer_io_heavy: bool = False  # charge='io': a tenant whose recent misses per position are far above another's
    # runs in steps of its own (engine/fairness.py `IOSeparation`; --defer-io-heavy)
    io_heavy_step_tokens: int | None = 32  # defer_io_heavy: positions a step of I/O-heavy tenants only may compute
    # while a light tenant is around (None: max_batch_tokens)
    step_interruption: bool | str = False  # fair/priority: a forward pauses at a pause point for an arrival of a
    # tenant ranked no worse than every other tenant in it, which runs in a forward of its own first (engine.py);
    # "auto" (the server's default): on under fair and priority when the model allows a nested forward

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batch_tokens", "max_seqs", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        for name in ("num_blocks", "num_state_slots", "max_decode_seqs", "io_heavy_step_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"EngineConfig.{name} must be a positive integer or None, got {value!r}")
        for name in ("kv_cache_bytes", "num_state_checkpoints", "checkpoint_every_blocks", "prefix_wait_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"EngineConfig.{name} must be an integer >= 0, got {value!r}")
        if self.step_interruption != "auto" and not isinstance(self.step_interruption, bool):
            raise ConfigError("EngineConfig.step_interruption must be true, false or 'auto' (on under fair and "
                              f"priority scheduling when the model allows a nested forward), got "
                              f"{self.step_interruption!r}")
        if isinstance(self.batch_by_experts_max_wait, bool) or not isinstance(self.batch_by_experts_max_wait, int) \
                or self.batch_by_experts_max_wait < 0:
            raise ConfigError("EngineConfig.batch_by_experts_max_wait must be an integer >= 0, got "
                              f"{self.batch_by_experts_max_wait!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "checkpoint_partial_blocks",
                     "batch_by_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.batch_by_experts and self.max_decode_seqs is None:
            raise ConfigError("EngineConfig.batch_by_experts chooses among more ready decodes than a forward takes: "
                              "it needs max_decode_seqs (--max-decode-seqs)")
        if isinstance(self.admission_watermark, bool) or not isinstance(self.admission_watermark, (int, float)) \
                or not 0 <= self.admission_watermark < 1:
            raise ConfigError(f"EngineConfig.admission_watermark must be in [0, 1), got {self.admission_watermark!r}")
        if self.prefix_cache_policy not in PREFIX_CACHE_POLICIES:
            raise ConfigError(f"EngineConfig.prefix_cache_policy must be one of {', '.join(PREFIX_CACHE_POLICIES)}, "
                              f"got {self.prefix_cache_policy!r}")
        if self.scheduling not in ("fcfs", "fair", "priority"):
            raise ConfigError(f"EngineConfig.scheduling must be fcfs, fair or priority, got {self.scheduling!r}")
        if isinstance(self.output_cost, bool) or not isinstance(self.output_cost, (int, float)) \
                or not self.output_cost >= 0:
            raise ConfigError(f"EngineConfig.output_cost must be a number >= 0, got {self.output_cost!r}")
        if self.prefix_cache_dir is not None:
            if not isinstance(self.prefix_cache_dir, str) or not self.prefix_cache_dir:
                raise ConfigError(f"EngineConfig.prefix_cache_dir must be a folder path, got {self.prefix_cache_dir!r}")
            if isinstance(self.prefix_cache_disk_bytes, bool) or not isinstance(self.prefix_cache_disk_bytes, int) \
                    or self.prefix_cache_disk_bytes <= 0:
                raise ConfigError("EngineConfig.prefix_cache_dir needs a positive prefix_cache_disk_bytes, got "
                                  f"{self.prefix_cache_disk_bytes!r}")
            if not self.enable_prefix_caching:
                raise ConfigError("EngineConfig.prefix_cache_dir is the prefix cache's disk tier: it needs "
                                  "enable_prefix_caching")
        if self.charge not in ("tokens", "io"):
            raise ConfigError(f"EngineConfig.charge must be tokens or io, got {self.charge!r}")
        if isinstance(self.io_cost, bool) or not isinstance(self.io_cost, (int, float)) or not self.io_cost >= 0:
            raise ConfigError(f"EngineConfig.io_cost must be a number >= 0, got {self.io_cost!r}")
        for name in ("tenant_cache_shares", "defer_io_heavy"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.tenant_cache_hold_s, bool) or not isinstance(self.tenant_cache_hold_s, (int, float)) \
                or not self.tenant_cache_hold_s >= 0:
            raise ConfigError(f"EngineConfig.tenant_cache_hold_s must be a number >= 0, got {self.tenant_cache_hold_s!r}")
        if self.defer_io_heavy and (self.charge != "io" or self.scheduling == "fcfs"):
            raise ConfigError("EngineConfig.defer_io_heavy separates tenants by the disk reads --charge io measures: it "
                              "needs charge='io' under fair or priority scheduling")
        if self.num_blocks is None and self.kv_cache_bytes == 0:
            raise ConfigError("EngineConfig needs num_blocks or a positive kv_cache_bytes")
        if self.num_state_slots is not None and self.num_state_slots < self.max_seqs:
            raise ConfigError(
                f"num_state_slots ({self.num_state_slots}) is below max_seqs ({self.max_seqs}): every running "
                "sequence holds one state slot"
            )

    @property
    def state_slots(self) -> int:
        return self.num_state_slots if self.num_state_slots is not None else self.max_seqs

    def block_bytes(self, layout: CacheLayout) -> int:
        """Bytes of one block: block_size positions x every attention layer x W float32 values."""
        return self.block_size * layout.position_bytes

    def resolve_num_blocks(self, layout: CacheLayout) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        if not layout.attention_layers:
            # rows take no memory: blocks only count positions, enough for every seat at full length
            return self.max_seqs * -(-self.max_model_len // self.block_size)
        blocks = self.kv_cache_bytes // self.block_bytes(layout)
        if blocks < 1:
            raise ConfigError(
                f"kv_cache_bytes = {self.kv_cache_bytes} holds no block of {self.block_bytes(layout)} bytes"
            )
        return blocks
