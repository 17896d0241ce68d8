"""One engine replica as a Ray actor: its own model source (resident, or streamed under its RAM budget), its own
`LLMEngine` on a background thread, and one thread for the math (each actor holds one CPU).

`generate` is a streaming actor method: it yields the request's `RequestOutput`s as the engine produces them. The
front cancels it (`ray.cancel`) when the client goes away, which aborts the request in the engine.
"""

from __future__ import annotations

import logging
import os
from typing import AsyncIterator

import ray

from k3serve.cluster.spec import ReplicaInfo, ReplicaSpec
from k3serve.engine.fairness import TenantShare
from k3serve.engine.request import RequestOutput, RequestSpec


logger = logging.getLogger(__name__)

@ray.remote
class EngineReplica:
    def __init__(self, spec: ReplicaSpec, index: int) -> None:
        from threadpoolctl import threadpool_limits

        from k3serve.engine.background import EngineRunner
        from k3serve.engine.engine import LLMEngine
        from k3serve.errors import K3Error
        from k3serve.loading import load_model

        threadpool_limits(limits=1)
        loaded = load_model(spec.model, stream=spec.stream)
        if not loaded.architecture.cluster_replicas:
            raise K3Error(f"{loaded.path} is a {loaded.architecture.name} model: the cluster's replicas run K3 "
                          "models only")
        drafters = None
        if spec.speculative is not None:
            from k3serve.engine.speculative import DrafterFactory

            draft = load_model(spec.draft_model).model if spec.draft_model is not None else None
            drafters = DrafterFactory(loaded.model, draft)
        self.engine = LLMEngine(loaded.model, spec.engine, stop_ids=loaded.stop_ids, speculative=spec.speculative,
                                drafters=drafters)
        self.runner = EngineRunner(self.engine)
        self.tokenizer = loaded.tokenizer
        self.shares: dict[str, TenantShare] = {}
        self.info_ = ReplicaInfo(index=index, pid=os.getpid(), model_name=loaded.name,
                                 vocab_size=loaded.model.config.vocab_size, max_context=self.engine.max_context,
                                 max_seqs=spec.engine.max_seqs, block_size=spec.engine.block_size)
        logger.info("replica %d ready (pid %d)", index, os.getpid())

    def info(self) -> ReplicaInfo:
        return self.info_

    def set_tenant_shares(self, shares: dict[str, TenantShare]) -> None:
        self.engine.set_tenant_shares(shares)
        self.shares = dict(shares)

    def tenant_shares(self) -> dict[str, TenantShare]:
        """The shares last given to this process's engine ({} in a process Ray has just restarted, until the front
        sends them again)."""
        return self.shares

    def share_capacity(self, kv_share: float) -> tuple[int, int]:
        return self.engine.share_capacity(kv_share)

    def metrics(self) -> dict[str, float]:
        """The engine's counters and gauges by name (its /metrics without histograms and tenant families): what the
        front shows per replica."""
        return {name: value for name, value in self.engine.metrics.snapshot().items()
                if isinstance(value, (int, float))}

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        from k3serve.engine.constraints import bound_grammar
        from k3serve.serve.text import stop_hook_for

        # the grammar was checked by the front against the same model's tokenizer; bound here to this one's
        stream = self.runner.submit(spec, stop_hook=stop_hook_for(self.tokenizer, list(spec.stop)),
                                    constraint=bound_grammar(spec.grammar, self.tokenizer))
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:  # cancelled by the front: the client went away
                stream.abort()

    def shutdown(self) -> None:
        self.runner.shutdown()
