"""Prefix caching for a hybrid model: attention blocks by chained hash, recurrent state by checkpoint at exact
positions. Built from the model's `CacheLayout`: MLA and GQA rows alike, KDA and DeltaNet states alike.

Attention rows of a position depend only on the tokens up to it, so a full block can be reused by any sequence that
starts with the same tokens: block j is keyed by
    h_j = H(h_{j-1}, tokens of block j),    h_{-1} = H("root", tenant, cache_salt)
(blake2b, 128 bits), so tenants and salts never share an entry. A recurrent state, though, summarises the whole
prefix and exists only at the position where it was taken. So a hit at position p needs BOTH
    - the attention blocks covering [0, p): the full blocks 0 .. p//BS - 1 in the block pool's hash index, and the
      p % BS rows of the partial block after them, which the checkpoint keeps itself (its "tail"), and
    - a state checkpoint taken at exactly p, keyed by (h_{p//BS - 1}, the tokens after that block).
The usable hit is the longest such p with p <= len(tokens) - 1: at least one token is always computed, since its
logits are needed. A model without recurrent layers (pure attention) also hits at every block boundary covered by
cached blocks, without a checkpoint.

Which positions get a checkpoint (admission, after Marconi, MLSys'25): only where reuse is likely
    - branch points: where a new sequence leaves the cached token tree (a prefix shared by two requests is likely
      shared by a third: a long system prompt);
    - the end of every prompt;
    - after the last generated token (the next turn of a conversation starts with this one's tokens);
    - optionally every `checkpoint_every_blocks` full blocks of a prefill;
within a budget of `num_state_checkpoints` slots (a checkpoint is copied out on a hit, never referenced, so every
one is evictable). Replacement (`prefix_cache_policy`): "lru" evicts the least recently used; "slru" (segmented LRU,
Karedla, Love and Wherry 1994) admits a new checkpoint to a probation segment and moves it to a protected segment of
at most PROTECTED_FRACTION of the slots once it is hit, evicting from probation first. Most checkpoints are used at
most once (a prompt's end that no later request extends), and under LRU each one pushes a recurring prefix (a
system prompt shared by a group of requests) one place nearer eviction; under SLRU they only displace each other.
A hit protects a checkpoint when the hitting sequence forks there (it leaves every cached path at exactly the
checkpoint's position: two different continuations now share it, as a system prompt's do), or on its second hit
(like a page on Linux's inactive list); any other first hit only refreshes it within probation, as LRU would. The
usual one is a conversation's next turn hitting the last reply's checkpoint: its only expected use, after which
the turn saves a later checkpoint of its own. Protecting on every first hit filled the protected segment with such
states, never asked for again (multi-turn chat on one replica: hit rate 0.49 against LRU's 0.76).
A checkpoint can also be evicted before its first hit comes, when several requests in flight each save two or three
one-shot states; its prefix is then computed again and the same checkpoint saved again. So slru remembers the keys
of the last 2 x `num_state_checkpoints` evicted checkpoints (2Q's A1out list, Johnson and Shasha 1994), and a
checkpoint saved again while its key is remembered goes straight to the protected segment: it recurs.

Disk tier (`EngineConfig.prefix_cache_dir`, engine/prefix_disk.py): a checkpoint that leaves RAM (the slot's
victim, or a block under it reused) is written to disk with every attention row under it, when those rows are
still in the block pool, in the segment it held in RAM. A lookup that finds a longer hit on disk than in RAM
restores from the file: the rows are written into fresh blocks (registered again as the sequence's own after its
next forward) and the state into the sequence's slot. A file that fails its checksum is a miss.

With `checkpoint_partial_blocks=False` checkpoints are only taken at block boundaries (as vLLM's 'align' mode does);
prompts that fit in one block can then never hit, which the cache reports with a warning and the
`prefix_cache_cannot_hit` flag rather than silently.

Shapes: LA attention layers, BS block size, W row width, NC checkpoint slots.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.errors import IntegrityError
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.paged_kv import BlockPool
from k3serve.engine.prefix_disk import CheckpointPayload, DiskEntry, PrefixDiskTier
from k3serve.engine.state_pool import StatePool
from k3serve.model.cache import CacheLayout

logger = logging.getLogger(__name__)

WARN_EVERY = 100  # repeat the cannot-hit warning once per this many affected requests
PROTECTED_FRACTION = 0.8  # slru: share of the checkpoint slots that hit entries may keep (Caffeine's main region)
GHOSTS_PER_SLOT = 2  # slru: evicted checkpoints' keys remembered, per slot (ARC keeps as many as it caches, per list)


def root_hash(tenant: str, cache_salt: str | None) -> bytes:
    """The parent hash of a sequence's first block: it carries the tenant and the salt into every key."""
    text = f"root\x00{tenant}\x00{'' if cache_salt is None else cache_salt}".encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class StateCheckpoint:
    """A recurrent state saved at `position`, plus the attention rows of the partial block before it (the slot's
    tail rows)."""

    slot: int
    parent: bytes  # chain hash of the last full block before `position` (the root hash if none)
    tail: tuple[int, ...]  # the tokens after that block, position % BS of them
    position: int
    num_hits: int = 0
    logits: np.ndarray | None = None  # [V] the next-token logits at `position` (kept at a prompt's end): a request
    # with exactly these tokens restores all of them and samples its first token without a forward
    root: bytes = b""  # the sequence's root hash (tenant and salt): where the chain of blocks under it starts


class SegmentedLRU:
    """Recency order of the checkpoints, in two segments: `probation` (entries never hit since they were saved)
    and `protected` (entries hit at least once), each least recent first. A hit moves an entry to protected's most
    recent end; protected's least recent entries beyond `protected_capacity` go back to probation's most recent
    end; the victim is probation's least recent entry, or protected's when probation is empty. A first hit that is
    not a fork leaves the entry in probation, as its most recent. With `protected_capacity = 0` every hit is
    demoted at once: plain LRU."""

    def __init__(self, protected_capacity: int) -> None:
        self.protected_capacity = protected_capacity
        self.probation: OrderedDict[int, StateCheckpoint] = OrderedDict()  # slot -> checkpoint
        self.protected: OrderedDict[int, StateCheckpoint] = OrderedDict()

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def get(self, slot: int) -> StateCheckpoint | None:
        return self.probation.get(slot) or self.protected.get(slot)

    def values(self) -> list[StateCheckpoint]:
        return [*self.probation.values(), *self.protected.values()]

    def add(self, checkpoint: StateCheckpoint) -> None:
        self.probation[checkpoint.slot] = checkpoint

    def hit(self, slot: int, fork: bool) -> None:
        """The entry was reused: protect it if this is a fork or its second hit, demoting protected's least recent
        beyond capacity."""
        checkpoint = self.probation.pop(slot, None) or self.protected.pop(slot)
        checkpoint.num_hits += 1
        if checkpoint.num_hits < 2 and not fork:
            self.probation[slot] = checkpoint
            return
        self._protect(slot, checkpoint)

    def promote(self, slot: int) -> None:
        """Protect an entry without a hit (a checkpoint saved again soon after its eviction: it recurs)."""
        self._protect(slot, self.probation.pop(slot, None) or self.protected.pop(slot))

    def _protect(self, slot: int, checkpoint: StateCheckpoint) -> None:
        self.protected[slot] = checkpoint
        while len(self.protected) > self.protected_capacity:
            demoted, entry = self.protected.popitem(last=False)
            self.probation[demoted] = entry

    def touch(self, slot: int) -> None:
        """Make an entry its own segment's most recent, without promoting it."""
        (self.probation if slot in self.probation else self.protected).move_to_end(slot)

    def remove(self, slot: int) -> None:
        if self.probation.pop(slot, None) is None:
            del self.protected[slot]

    def victim(self) -> StateCheckpoint:
        return next(iter(self.probation.values() if self.probation else self.protected.values()))


class EvictedKeys:
    """The keys of the last `capacity` evicted entries (2Q's A1out list): an entry saved again while its key is
    remembered recurs."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[object, None] = OrderedDict()

    def remember(self, key: object) -> None:
        self._keys[key] = None
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def recurs(self, key: object) -> bool:
        """True (and the key forgotten) when `key` is remembered."""
        return self._keys.pop(key, False) is None

    def clear(self) -> None:
        self._keys.clear()


@dataclass
class PrefixMatch:
    """What the cache holds for a sequence: the usable hit and where the sequence leaves the cached tree."""

    num_tokens: int  # p: positions restored from the cache (0 = miss)
    block_ids: list[int]  # the full blocks covering [0, p - p % BS)
    checkpoint: StateCheckpoint | None
    branch_point: int | None  # where this sequence leaves a path the cache has seen (None: no such path)
    num_block_tokens: int  # positions covered by cached attention blocks alone (what a pure-attention model reuses)
    disk: DiskEntry | None = None  # a hit in the disk tier (longer than any in RAM): block_ids and checkpoint empty
    payload: CheckpointPayload | None = None  # its arrays, once read (`PrefixCache.load`)

    @property
    def logits(self) -> np.ndarray | None:
        """The next-token logits of a hit that covers every token (the prompt is then computed: no forward)."""
        if self.disk is not None:
            return self.payload.logits if self.payload is not None else None
        return self.checkpoint.logits if self.checkpoint is not None else None


class PrefixCache:
    """Block hashes in the `BlockPool`, state checkpoints in a slot pool of their own, and the match logic."""

    def __init__(self, engine: EngineConfig, layout: CacheLayout, blocks: BlockPool, metrics: MetricsRegistry,
                 disk: PrefixDiskTier | None = None) -> None:
        self.config = engine
        self.block_size = engine.block_size
        self.blocks = blocks
        self.metrics = metrics
        self.store = StatePool(layout, engine.num_state_checkpoints)
        self.num_attention_layers = len(layout.attention_layers)
        self.needs_state = bool(layout.recurrent_layers)  # False: full cached blocks alone are a hit
        self.tails = np.zeros((engine.num_state_checkpoints, max(self.num_attention_layers, 1), engine.block_size,
                               layout.row_width), np.float32)  # [NC, LA, BS, W]
        protected = int(PROTECTED_FRACTION * engine.num_state_checkpoints) if engine.prefix_cache_policy == "slru" \
            else 0
        self._recency = SegmentedLRU(protected)  # every checkpoint, by slot, in eviction order
        # slru: the (parent, tail) keys of the last evicted checkpoints, GHOSTS_PER_SLOT per slot (2Q's A1out)
        self._ghosts = EvictedKeys(GHOSTS_PER_SLOT * engine.num_state_checkpoints) if protected else None
        self._index: dict[bytes, dict[tuple[int, ...], StateCheckpoint]] = {}  # parent hash -> tail -> checkpoint
        self._children: dict[bytes, dict[bytes, tuple[int, ...]]] = {}  # parent -> child block hash -> tokens
        self._parent_of: dict[bytes, bytes] = {}
        self._num_cannot_hit = 0
        self.disk = disk
        self.checkpoint_limit = engine.num_state_checkpoints  # checkpoints kept now (`resize_checkpoints`)
        # shadow counts for the RAM controller (`track_shadow`): evicted checkpoints' keys -> position, most recent
        # last; per recurrence, (depth, position); this interval's restored positions per checkpoint slot
        self._shadow: OrderedDict[tuple, int] = OrderedDict()
        self._shadow_capacity = 0
        self.shadow_recurrences: list[tuple[int, int]] = []
        self.interval_hit_tokens: dict[int, int] = {}
        # and for the KV pool: hashes of cached blocks evicted lately; per lookup that would have matched more
        # blocks had they stayed, (depth, positions)
        self._block_ghost: OrderedDict[bytes, None] = OrderedDict()
        self._block_ghost_capacity = 0
        self.block_shadow_hits: list[tuple[int, int]] = []
        self._pending_block_hit: tuple[int, int] | None = None
        self.block_shadow_prefixes: set[bytes] = set()  # the distinct prefixes (last ghost block) those hits end at
        self._pending_ghost_prefix = b""
        blocks.add_eviction_listener(self._on_block_evicted)
        self._m_queries = metrics.counter("prefix_cache_queries", "sequences looked up at admission")
        self._m_hits = metrics.counter("prefix_cache_hits", "lookups that restored at least one position")
        self._m_query_tokens = metrics.counter("prefix_cache_query_tokens", "tokens of the sequences looked up")
        self._m_hit_tokens = metrics.counter("prefix_cache_hit_tokens", "positions restored (tokens saved)")
        self._m_block_tokens = metrics.counter(
            "prefix_cache_block_only_tokens",
            "positions whose attention blocks were cached, with or without a recurrent state")
        self._m_saved = metrics.counter("prefix_cache_checkpoints_saved", "state checkpoints admitted")
        self._m_evicted = metrics.counter("prefix_cache_checkpoints_evicted", "state checkpoints evicted or dropped")
        self._m_readmitted = metrics.counter(
            "prefix_cache_checkpoints_recurring",
            "checkpoints saved again soon after their eviction, admitted straight to slru's protected segment")
        self._m_disk_hits = metrics.counter("prefix_cache_disk_hits", "lookups restored from the disk tier")
        self._m_disk_hit_tokens = metrics.counter("prefix_cache_disk_hit_tokens",
                                                  "positions restored from the disk tier")
        self._m_spill_skipped = metrics.counter(
            "prefix_cache_disk_spills_skipped",
            "checkpoints that left RAM after a block under them: too little left to write to the disk tier")
        self._m_cannot_hit = metrics.counter(
            "prefix_cache_unhittable_requests", "requests that can never hit under the current settings")
        self._m_flag = metrics.gauge(
            "prefix_cache_cannot_hit", "1 when hybrid prefix caching is enabled but cannot hit (see the log)")
        if engine.enable_prefix_caching and engine.num_state_checkpoints == 0 and self.needs_state:
            logger.warning(
                "prefix caching is enabled but num_state_checkpoints = 0: attention blocks are cached, but without "
                "a recurrent state checkpoint this hybrid model can never reuse them, so every request misses"
            )
            self._m_flag.set(1)

    # ---- hashing --------------------------------------------------------------------------------------------
    def extend_hashes(self, root: bytes, tokens: list[int], hashes: list[bytes], num_blocks: int) -> None:
        """Grow `hashes` (the chain hashes of a sequence's full blocks) to `num_blocks` entries."""
        BS = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else root, tokens[j * BS:(j + 1) * BS]))

    # ---- lookup ---------------------------------------------------------------------------------------------
    def match(self, root: bytes, tokens: list[int], hashes: list[bytes]) -> PrefixMatch:
        """The longest usable hit for `tokens` and the branch point: p <= len(tokens) - 1 (the last token is
        computed for its logits), or p = len(tokens) from a checkpoint that kept its logits (an exact repeat).
        `hashes` must cover every full block of `tokens` (see `extend_hashes`)."""
        BS, limit, full = self.block_size, len(tokens) - 1, len(tokens)
        matched: list[int] = []
        for block_hash in hashes:
            block = self.blocks.lookup(block_hash)
            if block is None:
                break
            matched.append(block)
        if self._block_ghost_capacity:
            self._pending_block_hit = self._block_ghost_run(hashes[len(matched):])
        hit: StateCheckpoint | None = None
        for j in range(min(len(matched), full // BS), -1, -1):
            group = self._index.get(hashes[j - 1] if j else root)
            if not group:
                continue
            for tail, checkpoint in group.items():
                end = j * BS + len(tail)
                usable = end <= limit or (end == full and checkpoint.logits is not None)
                if usable and (hit is None or end > hit.position) and tuple(tokens[j * BS:end]) == tail:
                    hit = checkpoint
            if hit is not None:
                break
        branch = self._branch_point(root, tokens, hashes, len(matched))
        if branch is None and self._pending_block_hit is not None:
            # the prompt repeats recently evicted cached blocks (the RAM controller's ghosts): their end is where a
            # path seen before stops, so a checkpoint there lets the next repeat hit a round earlier
            end = len(matched) * BS + self._pending_block_hit[1]
            branch = end if end < len(tokens) else None
        block_hit = 0 if self.needs_state else min(len(matched), limit // BS) * BS
        best = max(block_hit, hit.position if hit is not None else 0)
        on_disk = self._match_disk(root, tokens, hashes, best) if self.disk is not None else None
        if on_disk is not None:
            return PrefixMatch(on_disk.position, [], None, branch, len(matched) * BS, disk=on_disk)
        if hit is None or block_hit > hit.position:  # pure attention: the cached blocks alone are a hit
            return PrefixMatch(block_hit, matched[: block_hit // BS], None, branch, len(matched) * BS)
        return PrefixMatch(hit.position, matched[: hit.position // BS], hit, branch, len(matched) * BS)

    def _match_disk(self, root: bytes, tokens: list[int], hashes: list[bytes], better_than: int
                    ) -> DiskEntry | None:
        """The disk tier's longest usable entry for `tokens` past position `better_than`, or None."""
        BS, limit, full = self.block_size, len(tokens) - 1, len(tokens)
        for j in range(min(len(hashes), full // BS), -1, -1):
            if (j + 1) * BS <= better_than:
                return None
            best: DiskEntry | None = None
            for tail, entry in self.disk.group(hashes[j - 1] if j else root).items():
                end = j * BS + len(tail)
                usable = end <= limit or (end == full and entry.has_logits)
                if usable and end > better_than and (best is None or end > best.position) \
                        and entry.root == root and tuple(tokens[j * BS:end]) == tail:
                    best = entry
            if best is not None:
                return best
        return None

    def load(self, match: PrefixMatch, root: bytes, tokens: list[int], hashes: list[bytes]) -> PrefixMatch:
        """Read a disk hit's file (`match.payload`); a file that fails its checks is removed and the lookup is made
        again without it (a miss there, never a wrong answer)."""
        while match.disk is not None and match.payload is None:
            payload = self.disk.read(match.disk)
            if payload is not None:
                match.payload = payload
                break
            match = self.match(root, tokens, hashes)
        return match

    def _branch_point(self, root: bytes, tokens: list[int], hashes: list[bytes], num_matched: int) -> int | None:
        """Where `tokens` part from a path the cache has seen (a cached child block or checkpoint tail under the
        last matched block that agrees with them for a while and then differs), or None if there is no such
        path: the cache merely ends there, which is no evidence that the position will be shared."""
        BS = self.block_size
        start = num_matched * BS
        parent = hashes[num_matched - 1] if num_matched else root
        rest = tokens[start:start + BS]
        best: int | None = None
        candidates = list(self._children.get(parent, {}).values()) + list(self._index.get(parent, {}).keys())
        if self._shadow_capacity:  # recently evicted checkpoints' tails are paths the cache has seen too
            candidates += [tail for shadow_parent, tail in self._shadow if shadow_parent == parent]
        for seen in candidates:
            common = 0
            for a, b in zip(rest, seen):
                if a != b:
                    break
                common += 1
            if common < min(len(seen), len(rest)) and (best is None or common > best):
                best = common
        if best is None or start + best >= len(tokens):
            return None
        return start + best

    def record_lookup(self, match: PrefixMatch, num_tokens: int) -> None:
        """Count one admission's lookup in the metrics (hits are counted by `restore`), and warn when this
        sequence could never hit under the current settings."""
        self._m_queries.inc()
        self._m_query_tokens.inc(num_tokens)
        if self._pending_block_hit is not None:
            self.block_shadow_hits.append(self._pending_block_hit)
            self.block_shadow_prefixes.add(self._pending_ghost_prefix)
            self._pending_block_hit = None
        self._m_block_tokens.inc(min(match.num_block_tokens, num_tokens - 1))
        if self.needs_state and not self.config.checkpoint_partial_blocks and num_tokens - 1 < self.block_size:
            self._report_cannot_hit(num_tokens)

    def _report_cannot_hit(self, length: int) -> None:
        self._m_cannot_hit.inc()
        self._m_flag.set(1)
        if self._num_cannot_hit % WARN_EVERY == 0:
            logger.warning(
                "hybrid prefix caching cannot hit: a %d-token sequence is shorter than block_size + 1 = %d and "
                "checkpoint_partial_blocks is off, so no state checkpoint can ever serve it (%d such requests so far); "
                "lower block_size or enable checkpoint_partial_blocks",
                length, self.block_size + 1, self._num_cannot_hit + 1,
            )
        self._num_cannot_hit += 1

    def restore(self, match: PrefixMatch, cache: PagedSequenceCache) -> None:
        """Load a hit into an empty cache: share the full blocks, write the tail rows, copy the recurrent state."""
        if match.num_tokens == 0:
            return
        if match.disk is not None:
            self._restore_from_disk(match, cache)
            return
        for block in match.block_ids:
            self.blocks.acquire(block)
        cache.adopt_prefix(match.block_ids, len(match.block_ids) * self.block_size)
        checkpoint = match.checkpoint
        if checkpoint is not None:
            cache.write_rows(self.tails[checkpoint.slot, : self.num_attention_layers, : len(checkpoint.tail)])
            cache.states.copy_slot(checkpoint.slot, cache.slot, source_pool=self.store)
            self._recency.hit(checkpoint.slot, fork=match.branch_point == checkpoint.position)
            if self._shadow_capacity:
                self.interval_hit_tokens[checkpoint.slot] = (self.interval_hit_tokens.get(checkpoint.slot, 0)
                                                             + match.num_tokens)
        self._m_hits.inc()
        self._m_hit_tokens.inc(match.num_tokens)

    def _restore_from_disk(self, match: PrefixMatch, cache: PagedSequenceCache) -> None:
        payload = match.payload
        if payload is None:
            raise IntegrityError("a disk hit is restored before its file was read (PrefixCache.load)")
        cache.write_rows(payload.rows)  # fresh blocks: [LA, p, W]
        for layer, state, conv_tail in zip(cache.layout.recurrent_layers, payload.states, payload.conv_tails):
            cache.states.write(cache.slot, layer, state, conv_tail)
        self.disk.hit(match.disk, fork=match.branch_point == match.disk.position)
        self._m_hits.inc()
        self._m_hit_tokens.inc(match.num_tokens)
        self._m_disk_hits.inc()
        self._m_disk_hit_tokens.inc(match.num_tokens)

    def blocks_to_take(self, match: PrefixMatch) -> int:
        """Pool blocks a restore removes from what allocation can use (cached blocks it revives; a disk hit's full
        blocks, all new)."""
        if match.num_tokens == 0:
            return 0
        if match.disk is not None:
            return match.num_tokens // self.block_size
        return sum(self.blocks.is_cached(block) for block in match.block_ids)

    # ---- admission ------------------------------------------------------------------------------------------
    def plan_checkpoints(self, match: PrefixMatch, num_prompt_tokens: int, num_tokens: int) -> list[int]:
        """Positions past the hit where this sequence should save its state (see the module docstring)."""
        if self.config.num_state_checkpoints == 0:
            return []
        BS = self.block_size
        targets = {num_prompt_tokens} if match.branch_point is None else {match.branch_point, num_prompt_tokens}
        every = self.config.checkpoint_every_blocks
        if every:
            targets.update(range(every * BS, num_prompt_tokens + 1, every * BS))
        if not self.config.checkpoint_partial_blocks:
            targets = {t - t % BS for t in targets}
        return sorted(t for t in targets if match.num_tokens < t <= num_tokens)

    def register_blocks(self, root: bytes, tokens: list[int], hashes: list[bytes],
                        cache: PagedSequenceCache, registered: int) -> int:
        """Index the sequence's newly full blocks; returns how many of its blocks are now registered."""
        num_full = cache.num_tokens // self.block_size
        self.extend_hashes(root, tokens, hashes, num_full)
        for j in range(registered, num_full):
            if self.blocks.register(cache.block_table[j], hashes[j]):
                parent = hashes[j - 1] if j else root
                self._parent_of[hashes[j]] = parent
                self._children.setdefault(parent, {})[hashes[j]] = tuple(tokens[j * self.block_size:
                                                                                 (j + 1) * self.block_size])
        return max(registered, num_full)

    def save_checkpoint(self, root: bytes, tokens: list[int], hashes: list[bytes],
                        cache: PagedSequenceCache, logits: np.ndarray | None = None) -> bool:
        """Save the recurrent state of `cache` at its current position (its full blocks must be registered), with
        `logits` [V], the next-token logits there, when given (a prompt's end: an exact repeat then hits whole)."""
        BS, position = self.block_size, cache.num_tokens
        if self.config.num_state_checkpoints == 0 or position == 0:
            return False
        if not self.config.checkpoint_partial_blocks and position % BS:
            return False
        j = position // BS
        self.extend_hashes(root, tokens, hashes, j)
        if any(self.blocks.lookup(hashes[i]) is None for i in range(j)):
            return False  # a block under it was never indexed (or is gone): the checkpoint could not hit
        parent = hashes[j - 1] if j else root
        tail = tuple(tokens[j * BS:position])
        existing = self._index.get(parent, {}).get(tail)
        if existing is not None:  # often the same sequence again (a one-token reply, a preemption): not a hit
            self._recency.touch(existing.slot)
            if existing.logits is None and logits is not None:
                existing.logits = np.array(logits, dtype=np.float32)
            return False
        if self.checkpoint_limit == 0:  # resized to none: kept only as a shadow (saved, evicted at once)
            if self._shadow_capacity:
                self._note_recurrence(parent, tail, position)
                self._shadow[(parent, tail)] = position
                while len(self._shadow) > self._shadow_capacity:
                    self._shadow.popitem(last=False)
            return False
        while self.store.num_free_slots == 0 or len(self._recency) >= self.checkpoint_limit:
            self._drop(self._recency.victim())
        if self._shadow_capacity:
            self._note_recurrence(parent, tail, position)
        slot = self.store.allocate()
        self.store.copy_slot(cache.slot, slot, source_pool=cache.states)
        self.tails[slot, : self.num_attention_layers, : len(tail)] = cache.tail_rows(position)
        checkpoint = StateCheckpoint(slot, parent, tail, position, root=root,
                                     logits=None if logits is None else np.array(logits, dtype=np.float32))
        self._recency.add(checkpoint)
        self._index.setdefault(parent, {})[tail] = checkpoint
        self._m_saved.inc()
        if self._ghosts is not None and self._ghosts.recurs((parent, tail)):
            self._recency.promote(slot)  # computed again within two caches' worth of evictions: it recurs
            self._m_readmitted.inc()
        return True

    # ---- eviction -------------------------------------------------------------------------------------------
    def _drop(self, checkpoint: StateCheckpoint, spill: bool = True) -> None:
        if spill and self.disk is not None:
            self._spill(checkpoint)
        self._recency.remove(checkpoint.slot)
        group = self._index[checkpoint.parent]
        del group[checkpoint.tail]
        if not group:
            del self._index[checkpoint.parent]
        self.store.free(checkpoint.slot)
        self.interval_hit_tokens.pop(checkpoint.slot, None)
        self._m_evicted.inc()
        if self._shadow_capacity:
            self._shadow[(checkpoint.parent, checkpoint.tail)] = checkpoint.position
            self._shadow.move_to_end((checkpoint.parent, checkpoint.tail))
            while len(self._shadow) > self._shadow_capacity:
                self._shadow.popitem(last=False)
        if self._ghosts is not None:
            self._ghosts.remember((checkpoint.parent, checkpoint.tail))

    def _spill(self, checkpoint: StateCheckpoint) -> None:
        """Write a checkpoint that leaves RAM to the disk tier, with the rows of every block under it (found by
        walking the prefix tree up from its parent to its root), if all of them are still in the pool."""
        if self.disk.contains(checkpoint.parent, checkpoint.tail):
            self.disk.touch(checkpoint.parent, checkpoint.tail)
            return
        chain: list[int] = []  # block ids, last block first
        block_hash = checkpoint.parent
        while block_hash != checkpoint.root:
            block = self.blocks.lookup(block_hash)
            parent = self._parent_of.get(block_hash)
            if block is None or parent is None:
                self._m_spill_skipped.inc()
                return
            chain.append(block)
            block_hash = parent
        BS, LA = self.block_size, self.num_attention_layers
        if len(chain) * BS + len(checkpoint.tail) != checkpoint.position:
            raise IntegrityError(f"a checkpoint at {checkpoint.position} sits on {len(chain)} blocks")
        full = self.blocks.storage[:LA, chain[::-1]]  # [LA, nb, BS, W]
        rows = np.concatenate([full.reshape(LA, len(chain) * BS, full.shape[-1]),
                               self.tails[checkpoint.slot, :LA, :len(checkpoint.tail)]], axis=1)  # [LA, p, W]
        store = self.store
        states = [array[checkpoint.slot] for array in store.states]
        conv_tails = [array[checkpoint.slot] for array in store.conv_tails]
        protected = checkpoint.slot in self._recency.protected
        self.disk.write(checkpoint.root, checkpoint.parent, checkpoint.tail, checkpoint.position,
                        CheckpointPayload(rows, states, conv_tails, checkpoint.logits), protected)

    def _on_block_evicted(self, block_hash: bytes) -> None:
        """A cached block was reused: checkpoints right under it can no longer hit, and it leaves the tree."""
        if self._block_ghost_capacity:
            self._block_ghost[block_hash] = None
            self._block_ghost.move_to_end(block_hash)
            while len(self._block_ghost) > self._block_ghost_capacity:
                self._block_ghost.popitem(last=False)
        for checkpoint in list(self._index.get(block_hash, {}).values()):
            self._drop(checkpoint)
        parent = self._parent_of.pop(block_hash, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.pop(block_hash, None)
                if not siblings:
                    del self._children[parent]

    def clear(self) -> None:
        """Drop every checkpoint and every cached (unreferenced) block."""
        for checkpoint in self._recency.values():
            self._drop(checkpoint, spill=False)
        if self._ghosts is not None:
            self._ghosts.clear()
        self.blocks.evict_all_cached()

    # ---- resizing and shadow counts (the RAM controller, engine/ram_controller.py) -------------------------------
    @property
    def checkpoint_bytes(self) -> int:
        """RAM of one checkpoint slot: its recurrent state and its tail rows."""
        return self.store.slot_bytes + self.tails[0].nbytes if self.store.num_slots else 0

    def track_shadow(self, ghost_checkpoints: int) -> None:
        """Remember the keys of the last `ghost_checkpoints` evicted checkpoints: one saved again while remembered
        was computed again, which a cache that many checkpoints larger would have saved. 0: off."""
        self._shadow_capacity = max(0, ghost_checkpoints)
        while len(self._shadow) > self._shadow_capacity:
            self._shadow.popitem(last=False)

    def take_shadow(self, num_checkpoints: int) -> tuple[list[tuple[int, int]], float]:
        """(this interval's recurrences as (depth, position): a checkpoint computed again that `depth` more
        checkpoints would have kept, positions `num_checkpoints` fewer would have cost) since the last call, which
        starts a new interval. A recurrence counts its whole position (an upper bound: part of the prefix may have
        been restored from an earlier checkpoint); losses are the recent restored positions (decayed by half per
        interval) of the checkpoints hit least."""
        recurrences = self.shadow_recurrences
        counts = sorted(self.interval_hit_tokens.get(c.slot, 0) for c in self._recency.values())
        lost = sum(counts[:num_checkpoints]) / 2  # decayed by half per interval: twice one interval's, steady
        self.shadow_recurrences = []
        self.interval_hit_tokens = {slot: tokens / 2 for slot, tokens in self.interval_hit_tokens.items()
                                    if tokens >= 1}
        return recurrences, lost

    def _note_recurrence(self, parent: bytes, tail: tuple[int, ...], position: int) -> None:
        if (parent, tail) in self._shadow:
            keys = list(self._shadow)
            self.shadow_recurrences.append((len(keys) - keys.index((parent, tail)), position))
            del self._shadow[(parent, tail)]

    def track_block_shadow(self, ghost_blocks: int) -> None:
        """Remember the hashes of the last `ghost_blocks` cached blocks evicted: a lookup whose match would have gone
        on through them is a reuse a pool that many blocks larger would have had. 0: off."""
        self._block_ghost_capacity = max(0, ghost_blocks)
        while len(self._block_ghost) > self._block_ghost_capacity:
            self._block_ghost.popitem(last=False)

    def _block_ghost_run(self, hashes: list[bytes]) -> tuple[int, int] | None:
        """(blocks more needed, positions) of the evicted blocks that continue a match, or None."""
        run = 0
        for block_hash in hashes:
            if block_hash not in self._block_ghost:
                break
            run += 1
        if not run:
            return None
        keys = list(self._block_ghost)
        depth = max(len(keys) - keys.index(h) for h in hashes[:run])
        self._pending_ghost_prefix = hashes[run - 1]
        return depth, run * self.block_size

    def take_block_shadow(self) -> tuple[list[tuple[int, int]], set[bytes]]:
        """This interval's block ghost hits as (depth in blocks, positions), and the distinct prefixes they end at
        (the hash of each one's last block: on a hybrid model each needs a checkpoint there to hit); starts a new
        interval."""
        hits, self.block_shadow_hits = self.block_shadow_hits, []
        prefixes, self.block_shadow_prefixes = self.block_shadow_prefixes, set()
        return hits, prefixes

    def resize_checkpoints(self, num_checkpoints: int) -> int:
        """Keep at most `num_checkpoints` checkpoints (clamped to [0, the slot pool]); a shrink evicts the
        replacement policy's victims now (to the disk tier when there is one). Returns the limit reached."""
        self.checkpoint_limit = max(0, min(int(num_checkpoints), self.store.num_slots))
        while len(self._recency) > self.checkpoint_limit:
            self._drop(self._recency.victim())
        return self.checkpoint_limit

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def num_checkpoints(self) -> int:
        return len(self._recency)

    @property
    def num_protected_checkpoints(self) -> int:
        """Checkpoints in the slru protected segment (hit since they were saved); 0 under lru."""
        return len(self._recency.protected)

    def checkpoint_positions(self) -> list[int]:
        return sorted(c.position for c in self._recency.values())

    def check_integrity(self) -> None:
        """The recency segments, the index and the slot pool describe the same checkpoints; tree links are
        consistent."""
        recency = self._recency
        if recency.probation.keys() & recency.protected.keys():
            raise IntegrityError("a checkpoint is in both the probation and the protected segment")
        if len(recency.protected) > recency.protected_capacity:
            raise IntegrityError(f"{len(recency.protected)} protected checkpoints exceed the segment's "
                                 f"{recency.protected_capacity}")
        self.store.check_integrity([c.slot for c in recency.values()])
        if len(recency) > self.checkpoint_limit:
            raise IntegrityError(f"{len(recency)} checkpoints exceed the limit {self.checkpoint_limit}")
        indexed = [c for group in self._index.values() for c in group.values()]
        if len(indexed) != len(recency) or any(recency.get(c.slot) is not c for c in indexed):
            raise IntegrityError("prefix-cache checkpoint index and recency segments disagree")
        for checkpoint in indexed:
            if len(checkpoint.tail) != checkpoint.position % self.block_size:
                raise IntegrityError(f"checkpoint at {checkpoint.position} has a tail of {len(checkpoint.tail)}")
            if not self._index[checkpoint.parent]:
                raise IntegrityError("an empty checkpoint group was kept")
        for child, parent in self._parent_of.items():
            if child not in self._children.get(parent, {}):
                raise IntegrityError("a cached block is missing from its parent's children")
            if self.blocks.lookup(child) is None:
                raise IntegrityError("the prefix tree names a block the pool no longer indexes")
        if sum(len(c) for c in self._children.values()) != len(self._parent_of):
            raise IntegrityError("prefix tree children and parents disagree")
        if self.disk is not None:
            self.disk.check_integrity()
