"""Requests and their state: the serving engine and everything it owns.

    engine.py        LLMEngine (add_request / step / abort, thread-safe submission) and the offline LLM
    background.py    EngineRunner (the step loop on a thread) and RequestStream (sync and async consumption)
    scheduler.py     continuous batching under a token budget, chunked prefill, preemption by recompute
    paged_kv.py      the MLA block pool: reference counts, copy-on-write, hash index of cached blocks
    state_pool.py    the KDA state slot pool
    paged_cache.py   PagedSequenceCache: the model's SequenceCache over a block table and a state slot
    prefix_cache.py  hybrid prefix caching: chained block hashes + KDA checkpoints at exact positions
    request.py       Request, Sequence and the streamed RequestOutput
    sampling.py      SamplingParams and the per-sequence Sampler
    metrics.py       the one metrics registry
    config.py        EngineConfig
    generate.py      the single-sequence generation loop used by the CLI
"""
