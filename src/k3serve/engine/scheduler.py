"""The scheduler: which sequences run in the next forward, and how many of their tokens.

Every step has a token budget (`max_batch_tokens`) and a seat limit (`max_seqs`). A sequence asks for the tokens
it has not computed yet: one for a decode, up to the whole rest of the prompt for a prefill. Chunked prefill cuts
a prefill to what fits in the budget, so long prompts share steps with decodes instead of stalling them. Chunks
also stop at the sequence's next state checkpoint position, since a recurrent state can only be saved at the end of
a forward.

Order (the policy between tenants, engine/fairness.py, picks the sequences; with `fcfs` this is first come first
served):
  1. running sequences, oldest first; each reserves the blocks its new tokens need. When the pool runs dry the
     policy's victim (the newest running sequence under fcfs; a tenant over its KV share first) is preempted (its
     memory freed, its tokens to be recomputed; the prefix cache usually brings most of them back) until the
     sequence fits. Under `fair`/`priority`, prefill chunks of tenants ranked behind the best waiting one are
     deferred to step 3;
  2. then waiting sequences in the policy's order, while budget, seats, state slots and blocks last (none are
     admitted in a step that preempted; a tenant at its share is skipped). Admission looks up the prefix cache. A
     sequence that finds no seat, slot or blocks may displace one running sequence the policy names (a lower
     priority class, or a tenant over its share). A sequence whose prompt shares at least `prefix_wait_tokens`
     more tokens with a running sequence's (same tenant and salt) than the cache holds, while that one is still
     computing them, waits: the running one saves a checkpoint where the two part and the waiting one hits there
     instead of computing the same tokens beside it (in-flight prefix sharing; SGLang's in-batch prefix caching);
  3. deferred prefill chunks take the budget left over (work-conserving), without preempting.
With `defer_io_heavy`, the tenants `IOSeparation` leaves out this step (I/O-heavy ones beside light ones, or the
light ones when the heavy have waited their bound) take no part in 1-3; a step that would then run nothing runs
them after all.
A sequence whose batched forward failed is `suspect` and next runs alone, so one bad request cannot fail others.

Decodes per forward: with `max_decode_seqs` below the ready decodes, the first ones in the policy's order run and the
rest hold their memory and wait; with `batch_by_experts`, those whose previous step's experts overlap most run instead, within the rank tiers and a starvation bound
(engine/expert_batching.py).

`schedule_urgent` is the decision for a forward that runs while another is paused at a pause point, or at a step
boundary ahead of the running set (`EngineConfig.step_interruption`): only waiting sequences the policy lets
interrupt, nothing preempted.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from itertools import islice
from dataclasses import dataclass, field

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.errors import IntegrityError
from k3serve.engine.expert_batching import Candidate, choose_by_experts
from k3serve.engine.fairness import IOSeparation, TenantUsage, make_policy
from k3serve.engine.metrics import Counter as MetricCounter
from k3serve.engine.metrics import Histogram, MetricsRegistry
from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.paged_kv import BlockPool
from k3serve.engine.prefix_cache import PrefixCache, PrefixMatch
from k3serve.engine.prefix_disk import PrefixDiskTier
from k3serve.engine.request import Sequence, SequenceStatus
from k3serve.engine.state_pool import StatePool
from k3serve.errors import ConfigError
from k3serve.model.cache import CacheLayout


PREFIX_WAIT_SCAN = 64  # queued sequences an admission compares its prompt with (in-flight prefix sharing)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # including draft tokens
    num_draft_tokens: int = 0  # speculative drafts after the last token (the first num_draft_tokens of
    # seq.draft_tokens), verified in this forward

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens (its logits then give a new token)."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting queue, running set, and the memory they hold (blocks, state slots, prefix cache)."""

    def __init__(self, config: EngineConfig, layout: CacheLayout, metrics: MetricsRegistry,
                 model_identity: str | None = None) -> None:
        """`model_identity` (the model's store or checkpoint checksum) keys the prefix cache's disk tier: needed
        with `config.prefix_cache_dir`."""
        self.config = config
        self.layout = layout
        self.blocks = BlockPool(config.resolve_num_blocks(layout), config.block_size, len(layout.attention_layers),
                                layout.row_width)
        self.states = StatePool(layout, config.state_slots)
        disk = None
        if config.prefix_cache_dir is not None:
            if not model_identity:
                raise ConfigError("the prefix cache's disk tier needs the model's identity (its store or checkpoint "
                                  "checksum), so that another model never reads its entries")
            disk = PrefixDiskTier(config.prefix_cache_dir, config.prefix_cache_disk_bytes, layout, model_identity,
                                  config.prefix_cache_policy, metrics)
        self.prefix_cache = PrefixCache(config, layout, self.blocks, metrics, disk) \
            if config.enable_prefix_caching else None
        self.watermark_blocks = max(1, int(config.admission_watermark * self.blocks.num_blocks)) \
            if config.admission_watermark > 0 else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._m_preemptions = metrics.counter("preemptions", "sequences preempted (memory freed, to recompute)")
        self._m_prefix_waits = metrics.counter(
            "prefix_waits", "sequences held back to hit a shared prefix a running sequence was still computing")
        self.policy = make_policy(config.scheduling, config.output_cost,
                                  config.io_cost if config.charge == "io" else 0.0)
        self.io_separation = IOSeparation(config.io_heavy_step_tokens, hold_s=config.tenant_cache_hold_s) \
            if config.defer_io_heavy else None
        self._step_tokens = config.max_batch_tokens  # this step's token budget (smaller for I/O-heavy tenants)
        self.preemptions_by_tenant: Counter[str] = Counter()
        self._tenant_seqs: Counter[str] = Counter()  # queued + running sequences per tenant (the active ones)
        self._m_tenant_preemptions = metrics.family(
            MetricCounter, "tenant_preemptions", "sequences preempted, per tenant", ("tenant",))
        self._m_queue_time = metrics.family(Histogram, "tenant_queue_seconds",
                                            "arrival to first admission, per tenant", ("tenant",))

    @property
    def capacity_tokens(self) -> int:
        """Positions the whole block pool holds: no sequence may grow past it."""
        return self.blocks.num_blocks * self.config.block_size

    # ---- queue operations -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        tenant = seq.request.tenant
        if not self._tenant_seqs[tenant]:
            self.policy.activate(tenant, self.active_tenants())
        self._tenant_seqs[tenant] += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def active_tenants(self) -> set[str]:
        """Tenants with a queued or running sequence."""
        return {tenant for tenant, count in self._tenant_seqs.items() if count}

    def _leave(self, seq: Sequence) -> None:
        self._tenant_seqs[seq.request.tenant] -= 1
        if not self._tenant_seqs[seq.request.tenant]:
            del self._tenant_seqs[seq.request.tenant]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, save_state: bool) -> None:
        """Take a sequence out (finished, aborted or failed) and free its memory; with `save_state` its state
        after the last computed token is offered to the prefix cache (the next turn of a conversation hits)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._leave(seq)
            if save_state:
                self._save_state(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self._leave(seq)
        seq.status = SequenceStatus.FINISHED

    def after_forward(self, seq: Sequence, num_new_tokens: int, pending_tokens: list[int] | None = None,
                      logits: np.ndarray | None = None) -> None:
        """Book `num_new_tokens` as computed; index full blocks and save a checkpoint if one is due here.
        `pending_tokens` are computed positions past `seq.token_ids` (a verify window's accepted drafts, which the
        engine appends as it emits them): the blocks and checkpoint are keyed by token_ids + pending_tokens.
        `logits` [V] are the next-token logits at the new position: a checkpoint at the prompt's end keeps them."""
        seq.num_computed_tokens += num_new_tokens
        if seq.cache is None or seq.cache.num_tokens != seq.num_computed_tokens:
            raise IntegrityError(f"{seq}: the cache position disagrees with the computed count after a forward")
        if self.prefix_cache is not None:
            due = seq.num_computed_tokens in seq.checkpoint_targets
            fills = seq.cache.num_tokens // self.config.block_size > seq.num_registered_blocks
            # the copy only when a block or checkpoint is keyed by the pending tokens (not at every window)
            tokens = seq.token_ids + pending_tokens if pending_tokens and (due or fills) else seq.token_ids
            if (due or fills) and len(tokens) < seq.num_computed_tokens:
                raise IntegrityError(f"{seq}: {seq.num_computed_tokens} positions computed but {len(tokens)} tokens")
            self._register(seq, tokens)
            if due:
                at_prompt_end = seq.num_computed_tokens == seq.num_prompt_tokens
                self.prefix_cache.save_checkpoint(seq.request.root_hash, tokens, seq.block_hashes, seq.cache,
                                                  logits if at_prompt_end else None)

    def reset_for_recompute(self, seq: Sequence) -> None:
        """Drop a running sequence's memory and queue it again at the front, to be recomputed (preemption, or
        a failed forward whose partial writes cannot be trusted)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start `child` as a copy of running `parent` (shared blocks, copied recurrent state). False when no seat or
        state slot is free; the caller then queues the child to prefill on its own."""
        if parent.cache is None or len(self.running) >= self.config.max_seqs or self.states.num_free_slots == 0:
            return False
        child.cache = parent.cache.fork()
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self._tenant_seqs[child.request.tenant] += 1
        return True

    # ---- the decision ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        suspect = next((s for s in self.waiting if s.suspect), None)
        if suspect is not None:
            self._schedule_alone(suspect, out)
            return out
        capped = any(share.kv_share < 1 for share in self.policy.shares.values())
        left_out = self._decodes_left_out()
        waits = set()
        if self.io_separation is not None:
            with_work: dict[str, int] = {}  # tenant -> positions it has to compute
            for seq in [*self.running, *self.waiting]:
                with_work[seq.request.tenant] = with_work.get(seq.request.tenant, 0) + seq.num_uncomputed_tokens
            waits = self.io_separation.left_out(with_work)
            tenants = set(with_work) - waits
            self._step_tokens = min(self.config.max_batch_tokens,
                                    self.io_separation.step_tokens(tenants) or self.config.max_batch_tokens)
        try:
            self._fill(out, capped, left_out, waits)
            if waits and out.empty and not out.preempted:  # the others had nothing to run: work-conserving
                self._fill(out, capped, left_out, set())
        finally:
            self._step_tokens = self.config.max_batch_tokens
        if self.io_separation is not None:
            self.io_separation.ran({s.seq.request.tenant for s in out.scheduled}, waits)
        return out

    def _fill(self, out: SchedulerOutput, capped: bool, left_out: set[int], waits: set[str]) -> None:
        """Steps 1-3 of the module docstring into `out`, leaving out the decodes `left_out` and the tenants
        `waits`."""
        best = self.policy.pick_waiting(self.waiting, waits)
        deferred: list[Sequence] = []
        for seq in list(self.running):
            if self._budget(out) <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or id(seq) in left_out:  # preempted earlier in this step,
                continue  # or a decode beyond max_decode_seqs
            if seq.request.tenant in waits:
                continue
            if self.policy.defers(seq, best):
                deferred.append(seq)
                continue
            self._schedule_running(seq, out, capped, may_preempt=True)
        if out.preempted:
            return
        stalled = self._admit_waiting(out, capped, waits)
        if stalled is not None:
            usage, limits = self._usage(capped)
            victim = self.policy.displaces(stalled, self.running, usage, limits)
            if victim is not None:
                self._preempt(victim, out)
                return
        for seq in deferred:
            if self._budget(out) <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                self._schedule_running(seq, out, capped, may_preempt=False)

    def schedule_urgent(self, in_flight: set[str]) -> SchedulerOutput:
        """Waiting sequences to run in a forward of their own, ahead of the work of the tenants `in_flight` (those
        of a forward paused at a pause point, or of the running set at a step boundary): those of tenants the
        policy lets interrupt (`interrupts`), in its order, while the budget, seats, state slots and free blocks
        last. Nothing is preempted (paused sequences hold their memory mid-forward), and suspects wait for a step
        boundary to run alone."""
        out = SchedulerOutput()
        if any(s.suspect for s in self.waiting):
            return out
        capped = any(share.kv_share < 1 for share in self.policy.shares.values())
        blocked: set[str] = set()
        while self.waiting and self._budget(out) > 0:
            seq = self.policy.pick_waiting(self.waiting, blocked)
            if seq is None:
                break
            tenant = seq.request.tenant
            if not self.policy.interrupts(tenant, in_flight) or (capped and self._at_share(seq, capped)):
                blocked.add(tenant)
                continue
            if len(self.running) >= self.config.max_seqs or self.states.num_free_slots == 0:
                break
            n = self._admit(seq, self._budget(out), alone=not out.scheduled)
            if n is None:
                blocked.add(tenant)
                continue
            out.scheduled.append(ScheduledSequence(seq, n))
        return out

    def _decodes_left_out(self) -> set[int]:
        """Ids of the running decodes that wait this step: when more are ready than `max_decode_seqs` (k), the
        baseline runs the first k in the policy's order (rank, then running order); `batch_by_experts` runs the k
        whose predicted experts overlap most instead, within the rank tiers and the starvation bound
        (engine/expert_batching.py). The token budget alone never leaves more decodes ready than it takes (a
        sequence is ready only after a step ran it), so the choice needs max_decode_seqs."""
        config = self.config
        k = config.max_decode_seqs
        if k is None:
            return set()
        ready = [s for s in self.running if s.num_uncomputed_tokens == 1]
        if len(ready) <= k:
            for seq in ready:
                seq.num_passed_over = 0
            return set()
        order = sorted(range(len(ready)), key=lambda i: (self.policy.rank(ready[i].request.tenant), i))
        ready = [ready[i] for i in order]
        if not config.batch_by_experts:
            return {id(seq) for seq in ready[k:]}
        candidates = [Candidate(seq.predicted_experts, self.policy.rank(seq.request.tenant),
                                seq.num_passed_over >= config.batch_by_experts_max_wait) for seq in ready]
        chosen = set(choose_by_experts(candidates, k))
        for i, seq in enumerate(ready):
            if i in chosen:
                seq.num_passed_over = 0
            elif i < k:
                seq.num_passed_over += 1
        return {id(seq) for i, seq in enumerate(ready) if i not in chosen}

    def _budget(self, out: SchedulerOutput) -> int:
        return self._step_tokens - out.num_batched_tokens

    def _schedule_running(self, seq: Sequence, out: SchedulerOutput, capped: bool, may_preempt: bool) -> None:
        """Give running `seq` its next chunk (or decode, with drafts) if the budget and memory allow; may preempt
        the policy's victims to make room (possibly `seq` itself)."""
        budget = self._budget(out)
        n = self._chunk(seq, seq.num_computed_tokens, budget, alone=not out.scheduled)
        if n == 1 and seq.draft_tokens and seq.num_uncomputed_tokens == 1:  # a decode with drafts to verify
            n = min(1 + len(seq.draft_tokens), budget)
        if n == 0:
            return
        while seq.cache.num_blocks_to_reserve(n) > self.blocks.num_free_blocks:
            if not may_preempt:
                return
            usage, limits = self._usage(capped)
            victim = self.policy.victim(self.running, usage, limits)
            self._preempt(victim, out)
            if victim is seq:
                return
        seq.cache.reserve(n)
        out.scheduled.append(ScheduledSequence(seq, n, max(0, n - seq.num_uncomputed_tokens)))

    def _admit_waiting(self, out: SchedulerOutput, capped: bool, waits: set[str] = frozenset()) -> Sequence | None:
        """Admit waiting sequences in the policy's order, none of the tenants `waits`. Returns the sequence that
        found no seat, state slot or blocks (a candidate to displace a running one), or None."""
        blocked: set[str] = set(waits)  # tenants at their share, or waiting: none of theirs this step
        held: set[int] = set()  # sequences waiting for a shared prefix that a running one is computing
        while self.waiting and self._budget(out) > 0:
            seq = self.policy.pick_waiting((s for s in self.waiting if id(s) not in held), blocked)
            if seq is None:
                return None
            if capped and self._at_share(seq, capped):
                blocked.add(seq.request.tenant)
                continue
            if self._waits_for_shared_prefix(seq, out):
                held.add(id(seq))
                continue
            if len(self.running) >= self.config.max_seqs or self.states.num_free_slots == 0:
                return seq
            n = self._admit(seq, self._budget(out), alone=not out.scheduled)
            if n is None:
                return seq
            out.scheduled.append(ScheduledSequence(seq, n))
        return None

    def _shared_prefix(self, seq: Sequence, other: Sequence) -> int:
        """Where `seq`'s tokens part from `other`'s (both with their block hashes extended), at most at
        len(seq) - 1 (a hit must leave a token to compute), rounded down to a block where a hit needs full blocks."""
        BS, limit = self.config.block_size, seq.num_tokens - 1
        blocks = 0
        for a, b in zip(seq.block_hashes, other.block_hashes):
            if a != b:
                break
            blocks += 1
        shared = min(blocks * BS, limit)
        end = min(limit, other.num_tokens, (blocks + 1) * BS)
        while shared < end and seq.token_ids[shared] == other.token_ids[shared]:
            shared += 1
        if not self.config.checkpoint_partial_blocks or not self.prefix_cache.needs_state:
            shared -= shared % BS
        return shared

    def _parting_points(self, seq: Sequence, start: int) -> set[int]:
        """Checkpoint targets for `seq`, being admitted from `start`, where its prompt parts from a queued
        sequence of the same tenant and salt by at least `prefix_wait_tokens` tokens past `start`: the queued one
        waits for that checkpoint and hits it (see `_waits_for_shared_prefix`)."""
        wait = self.config.prefix_wait_tokens
        if not wait or not self.prefix_cache.needs_state:
            return set()
        points = set()
        for other in islice(self.waiting, PREFIX_WAIT_SCAN):
            if other is seq or other.request.root_hash != seq.request.root_hash:
                continue
            self.prefix_cache.extend_hashes(other.request.root_hash, other.token_ids, other.block_hashes,
                                            other.num_tokens // self.config.block_size)
            shared = min(self._shared_prefix(other, seq), seq.num_prompt_tokens)
            if shared - start >= wait:
                points.add(shared)
        return points

    def _waits_for_shared_prefix(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Whether waiting `seq` should wait for a running sequence of the same tenant and salt that has not yet
        computed at least `prefix_wait_tokens` tokens of their common prefix beyond the cache's hit for `seq`. A
        pure-attention model reuses the full blocks the running one registers after each forward. A hybrid model's
        state can only be reused where it was saved, so the running one needs a checkpoint target where the two
        part (set at its admission, or here), and a chunk of it scheduled in this step that would run past that
        point stops there."""
        wait = self.config.prefix_wait_tokens
        if self.prefix_cache is None or wait == 0 or seq.num_preemptions or seq.suspect:
            return False
        computing = [other for other in self.running if other.request.root_hash == seq.request.root_hash
                     and other.cache is not None
                     and other.num_computed_tokens < min(seq.num_tokens - 1, other.num_tokens) - wait]
        if not computing:  # the common case: no prefill of the same tenant under way, no lookup needed
            return False
        have = self._lookup(seq).num_tokens
        scheduled = {id(s.seq): s for s in out.scheduled}
        for other in computing:
            shared = self._shared_prefix(seq, other)
            if shared - have < wait or other.num_computed_tokens >= shared:
                continue
            if self.prefix_cache.needs_state:
                entry = scheduled.get(id(other))
                if entry is not None and other.num_computed_tokens + entry.num_new_tokens > shared:
                    if entry.num_draft_tokens:
                        continue
                    entry.num_new_tokens = shared - other.num_computed_tokens  # stop where the two part
                if shared not in other.checkpoint_targets:
                    other.checkpoint_targets = sorted({*other.checkpoint_targets, shared})
            if not seq.waited_for_prefix:
                seq.waited_for_prefix = True
                self._m_prefix_waits.inc()
            return True
        return False

    def _usage(self, capped: bool) -> tuple[dict[str, TenantUsage], dict[str, tuple[int, int]]]:
        """Per-tenant holdings and limits (max seqs, max blocks); empty when no tenant has a share below 1."""
        if not capped:
            return {}, {}
        usage: dict[str, TenantUsage] = {}
        for seq in self.running:
            held = usage.setdefault(seq.request.tenant, TenantUsage())
            held.num_seqs += 1
            held.num_blocks += len(seq.cache.block_table)
        limits = {tenant: self.tenant_limits(tenant) for tenant in usage}
        return usage, limits

    def tenant_limits(self, tenant: str) -> tuple[int, int]:
        return self.share_limits(self.policy.share(tenant).kv_share)

    def share_limits(self, kv_share: float) -> tuple[int, int]:
        """(max running sequences, max blocks) a KV share allows at admission (at least one of each)."""
        seats = min(self.config.max_seqs, self.states.num_slots)
        return max(1, int(kv_share * seats)), max(1, int(kv_share * self.blocks.num_blocks))

    def _at_share(self, seq: Sequence, capped: bool) -> bool:
        """Whether admitting `seq` would put its tenant over its share (never when the tenant runs nothing)."""
        usage, _ = self._usage(capped)
        held = usage.get(seq.request.tenant)
        if held is None:
            return False
        max_seqs, max_blocks = self.tenant_limits(seq.request.tenant)
        first_chunk = min(seq.num_tokens, self.config.max_batch_tokens)
        return held.num_seqs + 1 > max_seqs or held.num_blocks + -(-first_chunk // self.config.block_size) > max_blocks

    def _schedule_alone(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Run one suspect sequence by itself, preempting running sequences if it needs their memory or seat."""
        self.waiting.remove(seq)
        self.waiting.appendleft(seq)
        while self.running and (len(self.running) >= self.config.max_seqs or self.states.num_free_slots == 0
                                or not self._fits(seq, self.config.max_batch_tokens)):
            self._preempt(self.running[-1], out)
        n = self._admit(seq, self.config.max_batch_tokens, alone=True)
        if n is not None:
            out.scheduled.append(ScheduledSequence(self.running[-1], n))

    def _chunk(self, seq: Sequence, start: int, budget: int, alone: bool) -> int:
        """Tokens to compute for `seq` from position `start` this step (0: not this step)."""
        remaining = seq.num_tokens - start
        target = seq.next_checkpoint(start)
        wanted = remaining if target is None else min(remaining, target - start)
        if wanted <= budget:
            return wanted
        if self.config.enable_chunked_prefill:
            return budget
        return wanted if alone else 0  # unchunked: a prefill longer than the budget runs alone

    def _lookup(self, seq: Sequence) -> PrefixMatch | None:
        if self.prefix_cache is None:
            return None
        self.prefix_cache.extend_hashes(seq.request.root_hash, seq.token_ids, seq.block_hashes,
                                        seq.num_tokens // self.config.block_size)
        return self.prefix_cache.match(seq.request.root_hash, seq.token_ids, seq.block_hashes)

    def _fits(self, seq: Sequence, budget: int) -> bool:
        match = self._lookup(seq)
        start = match.num_tokens if match is not None else 0
        n = max(1, min(budget, seq.num_tokens - start))
        return self._blocks_for_admission(match, start, n) <= self.blocks.num_free_blocks

    def _blocks_for_admission(self, match: PrefixMatch | None, start: int, n: int) -> int:
        BS = self.config.block_size
        revived = self.prefix_cache.blocks_to_take(match) if match is not None else 0
        return revived + -(-(start + n) // BS) - start // BS

    def _admit(self, seq: Sequence, budget: int, alone: bool) -> int | None:
        """Admit waiting `seq` if it fits; returns its scheduled token count (None if it did not; 0 when the prefix
        cache held every token and the logits after them: the engine samples without a forward)."""
        match = self._lookup(seq)
        if match is not None and match.disk is not None:  # read the file now: a bad one is a miss, looked up again
            match = self.prefix_cache.load(match, seq.request.root_hash, seq.token_ids, seq.block_hashes)
        start = match.num_tokens if match is not None else 0
        targets = self.prefix_cache.plan_checkpoints(match, seq.num_prompt_tokens, seq.num_tokens) \
            if match is not None else []
        if match is not None:
            targets = sorted({*targets, *self._parting_points(seq, start)})
        seq.checkpoint_targets = targets
        whole = match is not None and start == seq.num_tokens  # an exact repeat: computed, its logits kept
        n = 0 if whole else self._chunk(seq, start, budget, alone)
        # the watermark is waived for a sequence that runs alone: it must be able to make progress
        reserve = 0 if alone and not self.running else self.watermark_blocks
        if (n == 0 and not whole) \
                or self._blocks_for_admission(match, start, max(n, 1)) + reserve > self.blocks.num_free_blocks:
            seq.checkpoint_targets = []
            return None
        self.waiting.remove(seq)
        cache = PagedSequenceCache(self.blocks, self.states)
        if match is not None:
            first_admission = seq.num_preemptions == 0 and not seq.suspect
            if first_admission:
                self.prefix_cache.record_lookup(match, seq.num_tokens)
            self.prefix_cache.restore(match, cache)
            if first_admission and seq.index == 0:
                seq.request.num_cached_tokens = match.num_tokens
            seq.num_registered_blocks = len(match.block_ids)
        if seq.num_preemptions == 0 and not seq.suspect:  # first admission: the tenant is charged its prompt
            self.policy.charge_prompt(seq.request.tenant, seq.num_tokens - start)
            if seq.index == 0:
                self._m_queue_time.labels(seq.request.tenant).observe(time.perf_counter() - seq.request.arrival_time)
        cache.reserve(n)
        seq.cache = cache
        seq.num_computed_tokens = cache.num_tokens
        seq.cached_logits = match.logits if whole else None
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.prefix_cache is not None:
            self._save_state(seq)  # recompute may then restart from here, if the checkpoint survives
        self.reset_for_recompute(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self._m_preemptions.inc()
        self.preemptions_by_tenant[seq.request.tenant] += 1
        self._m_tenant_preemptions.labels(seq.request.tenant).inc()

    # ---- memory ---------------------------------------------------------------------------------------------
    def _register(self, seq: Sequence, tokens: list[int] | None = None) -> None:
        seq.num_registered_blocks = self.prefix_cache.register_blocks(
            seq.request.root_hash, seq.token_ids if tokens is None else tokens, seq.block_hashes, seq.cache,
            seq.num_registered_blocks)

    def _save_state(self, seq: Sequence) -> None:
        if self.prefix_cache is None or seq.cache is None or seq.num_computed_tokens == 0:
            return
        self._register(seq)
        self.prefix_cache.save_checkpoint(seq.request.root_hash, seq.token_ids, seq.block_hashes, seq.cache)

    def _release(self, seq: Sequence) -> None:
        if seq.cache is not None:
            seq.cache.release()
        seq.cache = None
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.checkpoint_targets = []
        seq.cached_logits = None

    # ---- checks ---------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Queues consistent with sequence states, and every pool consistent with the sequences holding it."""
        if len(self.running) > self.config.max_seqs:
            raise IntegrityError(f"{len(self.running)} running sequences exceed max_seqs {self.config.max_seqs}")
        ids = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        if len(set(ids)) != len(ids):
            raise IntegrityError("a sequence is queued twice")
        refs: Counter[int] = Counter()
        slots = []
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING or seq.cache is None:
                raise IntegrityError(f"{seq} is in the running set without running state")
            seq.cache.check_integrity()
            if seq.cache.num_tokens != seq.num_computed_tokens or seq.num_computed_tokens > seq.num_tokens:
                raise IntegrityError(f"{seq}: cache at {seq.cache.num_tokens}")
            refs.update(seq.cache.block_table)
            slots.append(seq.cache.slot)
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.cache is not None or seq.num_computed_tokens:
                raise IntegrityError(f"{seq} is waiting but holds memory or progress")
        queued = Counter(s.request.tenant for s in list(self.running) + list(self.waiting))
        if queued != +self._tenant_seqs:
            raise IntegrityError(f"active tenant counts {dict(self._tenant_seqs)} disagree with the queues "
                                 f"{dict(queued)}")
        self.blocks.check_integrity(refs)
        self.states.check_integrity(slots)
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
