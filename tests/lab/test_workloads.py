"""Engine workloads: the waste meter over the real pools, and copy-on-write sharing seen through it."""

from __future__ import annotations

import math

from k3serve.config import tiny_config
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.workloads import WasteMeter, ZeroRowsModel, run_all


def _engine(block_size: int, **kw) -> LLMEngine:
    config = EngineConfig(block_size=block_size, enable_prefix_caching=False, max_model_len=512, **kw)
    return LLMEngine(ZeroRowsModel(tiny_config()), config)


def _waste(block_size: int) -> WasteMeter:
    engine = _engine(block_size)
    for length in (20, 33, 70):
        engine.add_request(list(range(3, 3 + length)), SamplingParams(max_tokens=10, ignore_eos=True))
    meter = WasteMeter(engine, 512)
    final = run_all(engine, meter)
    engine.check_integrity()
    assert len(final) == 3
    return meter


def test_paged_waste_shrinks_with_the_block_and_reservation_wastes_more():
    one, sixteen = _waste(1), _waste(16)
    assert one.result()["paged_pct"] == 0.0 and one.paged == one.filled
    assert sixteen.paged > sixteen.filled == one.filled
    result = sixteen.result()
    assert 0 < result["paged_pct"] < result["reserve_max_len_pct"]
    assert 0 < result["reserve_prompt_plus_max_tokens_pct"] < result["reserve_max_len_pct"]


def test_forked_completions_share_the_prompt_blocks():
    prompt, n, new, block = 64, 4, 8, 16
    engine = _engine(block, max_seqs=n)
    engine.add_request(list(range(3, 3 + prompt)), SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=new,
                                                                  ignore_eos=True))
    meter = WasteMeter(engine, 512)
    run_all(engine, meter)
    engine.check_integrity()
    shared_prompt = prompt // block  # full prompt blocks, held once
    assert meter.peak_used_blocks <= shared_prompt + n * math.ceil(new / block + 1)
    assert meter.peak_used_blocks < n * math.ceil((prompt + new) / block)
