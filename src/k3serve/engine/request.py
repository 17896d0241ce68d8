"""Requests, the sequences they run as, and the outputs they stream.

A `Request` is what a client asked for: a prompt, sampling parameters, `n` completions, a tenant and cache salt.
It runs as `n` `Sequence`s. With n > 1 only the first one prefills the prompt; when its prompt is done the others
fork from it (sharing every attention block, copy-on-write, with a copy of the recurrent state), so the prompt is computed once.

A sequence's tokens are the prompt then the generated ones; `num_computed_tokens` of them have been through the
model. A step schedules some of the rest; when all are computed, the last position's logits give a new token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from k3serve.engine.io_usage import IOUsage
from k3serve.engine.paged_cache import PagedSequenceCache
from k3serve.engine.sampling import Sampler, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from k3serve.engine.speculative import SequenceSpeculation, SpeculativeConfig

StopHook = Callable[[list[int]], bool]
"""Called with a sequence's generated token ids after each new token; True finishes it (reason 'stop'). The
server's stop strings go here: it detokenizes, looks for the string, and trims the text itself."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no memory (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds a block table and a state slot
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token id, or the stop hook
    LENGTH = "length"  # max_tokens, or the context limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # this request failed; the others carried on


@dataclass(frozen=True)
class RequestSpec:
    """A request as its client asked for it: built once where it enters (serve's API) and passed down unchanged
    through the serving backend, the cluster's replica and the engine runner to `LLMEngine.submit`, so a new
    request option is one field here and code only where it is read. Picklable (it crosses to Ray replicas): the
    stop strings and the grammar travel as text, bound to the tokenizer of whichever process runs them."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = "default"
    cache_salt: str | None = None
    stop: tuple[str, ...] = ()  # stop strings (serve/text.py turns them into a stop hook over the tokenizer)
    speculative: SpeculativeConfig | bool | str | None = None  # None: the engine's default (LLMEngine.add_request)
    grammar: str | None = None  # a grammar in llguidance's serialised form (engine/constraints.py)
    streamed: bool = True  # the client sees outputs as they come (False: one whole response, so it may start over)


@dataclass
class CompletionOutput:
    """One of the n completions of a request, as of this output."""

    index: int
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # the tokens generated since the previous output of this request
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced so far; streamed once per step in which it changed."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when finish_reason is ERROR
    num_cached_tokens: int = 0  # prompt positions served by the prefix cache (first admission of completion 0)
    ttft_seconds: float | None = None  # arrival to first token
    bytes_read: int = 0  # bytes read from the store, charged to this request (engine/io_usage.py: its share of
    # each step's tokens)
    expert_misses: int = 0  # on-demand expert reads, charged the same way
    io_wait_ms: float = 0.0  # milliseconds the compute thread waited on reads, charged the same way


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    cache_salt: str | None
    root_hash: bytes  # prefix-cache parent hash of the first block (tenant + salt)
    stop_ids: frozenset[int]
    stop_hook: StopHook | None = None
    on_output: Callable[[RequestOutput], None] | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    sequences: list[Sequence] = field(default_factory=list)
    pending_forks: list[Sequence] = field(default_factory=list)  # n > 1: wait for sequence 0's prompt
    first_token_time: float | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    speculative: SpeculativeConfig | None = None  # speculative decoding for this request (None: off)
    io: IOUsage = field(default_factory=IOUsage)  # disk reads charged to it (engine/io_usage.py)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.sequences)


class Sequence:
    """One completion being generated: its tokens, progress, memory and sampler."""

    def __init__(self, seq_id: int, request: Request, index: int, sampler: Sampler, max_total_tokens: int) -> None:
        self.seq_id = seq_id  # global admission order: lower is older (FCFS, preempt the newest)
        self.request = request
        self.index = index
        self.sampler = sampler
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.max_total_tokens = max_total_tokens  # prompt + generated, the context limit for this sequence
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.cache: PagedSequenceCache | None = None
        self.block_hashes: list[bytes] = []  # chain hashes of full blocks, grown as blocks fill
        self.num_registered_blocks = 0  # blocks of the block table indexed in the prefix cache
        self.checkpoint_targets: list[int] = []  # positions at which to save the recurrent state
        self.waited_for_prefix = False  # held back once for a shared prefix a running sequence was computing
        self.finish_reason: FinishReason | None = None
        self.num_emitted = 0  # generated tokens already streamed
        self.num_preemptions = 0
        self.suspect = False  # its last batched forward failed: run it alone until it succeeds
        self.logprobs: list[TokenLogprob] = []  # one per generated token when the request asked for logprobs
        self.last_token_time: float | None = None
        self.speculation: SequenceSpeculation | None = None  # drafter, adaptive length and this step's draft
        self.cached_logits: np.ndarray | None = None  # [V] admitted whole from the prefix cache: the logits after
        # its last token, sampled from instead of a forward
        self.predicted_experts: np.ndarray | None = None  # [L, TOPK] its last forward's last token's experts per
        # MoE layer (--batch-by-experts: the prediction of its next step's)
        self.num_passed_over = 0  # steps in a row --batch-by-experts left it out where the baseline would run it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens this sequence may still generate: under both max_tokens and the context limit."""
        return min(self.request.params.max_tokens - self.num_output_tokens, self.max_total_tokens - self.num_tokens)

    @property
    def draft_tokens(self) -> list[int]:
        """This step's speculative drafts, verified after the last token (none without speculation)."""
        draft = self.speculation.draft if self.speculation is not None else None
        return draft.tokens if draft is not None else []

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def next_checkpoint(self, position: int) -> int | None:
        """The nearest checkpoint position after `position` (prefill chunks stop there so the state can be
        saved at exactly that position)."""
        for target in self.checkpoint_targets:
            if target > position:
                return target
        return None

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, {self.status.value}, "
                f"{self.num_computed_tokens}/{self.num_tokens} computed)")
