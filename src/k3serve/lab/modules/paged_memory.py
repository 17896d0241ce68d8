"""9. Paged memory: KV waste of paged blocks vs reservation, and copy-on-write sharing for n > 1."""

from __future__ import annotations

import math

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.workloads import WasteMeter, ZeroRowsModel, run_all
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.verdict import crossing, judge

BLOCK_SIZES = (8, 16, 32, 64, 128)
MAX_MODEL_LEN = 2048


def waste_run(model_config, block_size: int, num_requests: int, max_prompt: int, seed: int, cancel) -> WasteMeter:
    """Requests with prompts 16..max_prompt and outputs 16..128 tokens through the real scheduler and pools."""
    config = EngineConfig(block_size=block_size, max_seqs=32, max_batch_tokens=4096, max_model_len=MAX_MODEL_LEN,
                          enable_prefix_caching=False, kv_cache_bytes=256 << 20)
    engine = LLMEngine(ZeroRowsModel(model_config, seed), config)
    rng = np.random.default_rng(seed)
    for _ in range(num_requests):
        engine.add_request([int(t) for t in rng.integers(3, model_config.vocab_size, int(rng.integers(16, max_prompt + 1)))],
                           SamplingParams(max_tokens=int(rng.integers(16, 129)), ignore_eos=True))
    meter = WasteMeter(engine, config.max_model_len)
    run_all(engine, meter, between=cancel.check)
    engine.check_integrity()
    return meter


def fork_run(model_config, block_size: int, n: int, prompt_tokens: int, max_tokens: int, cancel) -> int:
    """Peak blocks in use for one request with n completions (forked from one prefill, copy-on-write)."""
    config = EngineConfig(block_size=block_size, max_seqs=max(n, 1), enable_prefix_caching=False,
                          max_model_len=MAX_MODEL_LEN, kv_cache_bytes=256 << 20)
    engine = LLMEngine(ZeroRowsModel(model_config, 1), config)
    engine.add_request(list(range(3, 3 + prompt_tokens)),
                       SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True))
    meter = WasteMeter(engine, config.max_model_len)
    run_all(engine, meter, between=cancel.check)
    engine.check_integrity()
    return meter.peak_used_blocks


def run(params, progress, cancel, lab) -> LabResult:
    config = lab.config
    block = params["block_size"]
    rows = {}
    sizes = sorted(set(BLOCK_SIZES) | {block})
    for i, size in enumerate(sizes):
        progress(0.05 + 0.6 * i / len(sizes), f"{params['requests']} requests with block size {size}")
        rows[size] = waste_run(config, size, params["requests"], params["max_prompt"], 11, cancel).result()
    at = rows[block]
    progress(0.7, f"one request, n = {params['n']} completions")
    n, prompt, new = params["n"], params["prompt_tokens"], params["max_tokens"]
    shared = fork_run(config, block, n, prompt, new, cancel)
    unshared = n * math.ceil((prompt + new) / block)
    source = ("the engine's real scheduler, block pool and state pool on a stand-in model that writes zero rows "
              "(memory depends only on lengths), on this machine")
    figures = [
        Figure("KV positions reserved but empty", "bar", True, source + f"; {params['requests']} requests, prompts "
               f"16..{params['max_prompt']}, outputs 16..128", [{"name": "waste %", "x": [
                   f"paged blocks of {block}", "reserve prompt + max_tokens", f"reserve max_model_len {MAX_MODEL_LEN}"],
                   "y": [at["paged_pct"], at["reserve_prompt_plus_max_tokens_pct"], at["reserve_max_len_pct"]]}],
               y_label="reserved positions left empty (%)"),
        Figure("Paged waste vs block size", "line", True, source,
               [{"name": "paged", "x": sizes, "y": [rows[s]["paged_pct"] for s in sizes]}],
               x_label="block size (positions)", y_label="reserved positions left empty (%)"),
        Figure(f"Blocks for one prompt of {prompt} tokens with n = {n} completions of {new}", "bar", True,
               "peak blocks in use, measured in the engine; without sharing: n full copies (computed)",
               [{"name": "blocks", "x": ["copy-on-write (measured)", "n copies (computed)"], "y": [shared, unshared]}],
               y_label="peak blocks in use (blocks)"),
    ]
    # positions reserved per position filled = 1 / (1 - waste): the memory a server must hold for the same work
    metrics = {"waste_pct": at["paged_pct"], "reserved_per_filled": 100 / (100 - at["paged_pct"]),
               "blocks_for_n": float(shared)}
    baseline = {"waste_pct": at["reserve_max_len_pct"], "reserved_per_filled": 100 / (100 - at["reserve_max_len_pct"]),
                "blocks_for_n": float(unshared)}
    labels = {"waste_pct": "reserved but empty positions (%)",
              "reserved_per_filled": "positions reserved per position filled",
              "blocks_for_n": f"blocks for n = {n} completions"}
    exact = [rows[s]["reserve_prompt_plus_max_tokens_pct"] for s in sizes]
    flip = crossing(sizes, [rows[s]["paged_pct"] for s in sizes], exact, higher_is_better=False)
    if flip is not None:
        against_exact = (f"from blocks of about {flip:.0f} positions (the block-size sweep) paging wastes more than "
                         f"even an exact reservation of prompt + max_tokens")
    else:
        against_exact = (f"paging wastes less than even an exact reservation of prompt + max_tokens "
                         f"({at['reserve_prompt_plus_max_tokens_pct']:.1f}%, which needs the output length up front) "
                         f"at every block size swept ({sizes[0]} to {sizes[-1]} positions)")
    verdict = judge("Paged blocks", f"reserving max_model_len ({MAX_MODEL_LEN})", "reserved_per_filled",
                    "KV memory for the same sequences", metrics["reserved_per_filled"], baseline["reserved_per_filled"],
                    higher_is_better=False,
                    flips_when=f"reserving max_model_len only matches it when every sequence fills all {MAX_MODEL_LEN} "
                               f"positions; {against_exact}")
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name="paged + copy-on-write", verdict=verdict,
                     baseline_name=f"reserve max_model_len; n copies",
                     notes=[f"reserving prompt + max_tokens exactly wastes {at['reserve_prompt_plus_max_tokens_pct']}% "
                            f"(it needs to know the output length, which a server does not)",
                            "pools pass check_integrity() after every run"],
                     related_commands=["python benchmarks/bench_engine.py --quick"])


MODULE = LabModule(
    id="paged_memory", number=9, title="Paged memory and copy-on-write",
    summary="KV memory reserved but unused by paged blocks vs per-sequence reservation; sharing for n > 1.",
    explanation=(
        "Reserving each sequence's longest possible cache up front wastes what it never fills. Paged memory hands "
        "out fixed blocks of B positions as the sequence grows, so at most B - 1 positions per sequence are empty: "
        "waste = 1 - filled / (blocks x B). For n completions of one prompt the prompt's blocks are shared with "
        "reference counts and copied only when a completion writes into a shared block (copy-on-write): the prompt "
        "is stored once instead of n times."),
    params=(Param("block_size", "int", 16, "positions per block", min=1, max=256),
            Param("requests", "int", 32, "requests in the waste workload", min=1, max=512),
            Param("max_prompt", "int", 1024, "longest prompt in the workload", min=16, max=1900, unit="tokens"),
            Param("n", "int", 4, "completions per request for the sharing figure", min=1, max=16),
            Param("prompt_tokens", "int", 256, "prompt of the sharing figure", min=1, max=1500, unit="tokens"),
            Param("max_tokens", "int", 32, "tokens per completion", min=1, max=256, unit="tokens")),
    kind="measured", run=run)
