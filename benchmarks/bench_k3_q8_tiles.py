"""K3's routed experts at prefill on the int8 path, tiles against row dot (kernels section "int8 tiles"), in one
process: the widened trained K3 (bench_peers.widened_checkpoint(16, 32)), a prompt of --prompt-len tokens, then
--decode-steps one-token steps, for three variants alternated each round:

    f32        the float path (the default, the reference bits)
    q8-rowdot  K3SERVE_MXFP4_ACTIVATIONS=q8 with kernels.Q8_TILE_TOKENS = 1 (the int8 row dot, one token a pass)
    q8-tiles   K3SERVE_MXFP4_ACTIVATIONS=q8 with the tiles (2 rows x 8 / 4 tokens a pass; the row dot's bits)

CPU seconds (process time, all threads) per prefill and per decode step, medians over --rounds; the last
position's logits of q8 against f32 (relative RMS), and whether the two q8 variants' logits are the same bits.

    PYTHONPATH=src python benchmarks/bench_k3_q8_tiles.py [--prompt-len 512] [--decode-steps 8] [--rounds 3]
Prints one line per variant, a summary line, then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

VARIANTS = {"f32": ("f32", 8), "q8-rowdot": ("q8", 1), "q8-tiles": ("q8", 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from bench_peers import widened_checkpoint
    from k3serve.loading import load_model
    from k3serve.model import kernels
    from k3serve.model.interface import ForwardItem

    if not kernels.Q8_ISAS:
        raise SystemExit("the int8 path needs AVX2 or AVX-512 VNNI, which this CPU lacks")
    model = load_model(widened_checkpoint(16, 32)).model
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len)

    def use(name: str) -> None:
        kernels.MXFP4_ACTIVATIONS, kernels.Q8_TILE_TOKENS = VARIANTS[name]  # both read at each expert call

    for name in VARIANTS:  # compiled and warm
        use(name)
        cache = model.new_cache()
        model.forward([ForwardItem(prompt[:16], cache)])
        model.forward([ForwardItem(prompt[16:17], cache)])
    prefill_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    decode_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    logits: dict[str, np.ndarray] = {}
    for round_index in range(args.rounds):
        for name in VARIANTS:
            use(name)
            cache = model.new_cache()
            start = time.process_time()
            out = model.forward([ForwardItem(prompt, cache)])
            prefill_s[name].append(time.process_time() - start)
            if round_index == 0:
                logits[name] = np.asarray(out.logits[0][-1], np.float32).ravel()
            start = time.process_time()
            for i in range(args.decode_steps):
                model.forward([ForwardItem(prompt[i:i + 1], cache)])
            decode_s[name].append((time.process_time() - start) / args.decode_steps)
    record = {"prompt_len": args.prompt_len, "threads": os.environ.get("NUMBA_NUM_THREADS"), "rounds": args.rounds,
              "prefill_cpu_s": prefill_s, "decode_cpu_s_per_step": decode_s, "load": os.getloadavg()[0]}
    for name in VARIANTS:
        print(f"{name:10s} prefill CPU s {[round(s, 3) for s in prefill_s[name]]} median "
              f"{statistics.median(prefill_s[name]):.3f} | decode CPU ms a step "
              f"{[round(1e3 * s, 2) for s in decode_s[name]]} median {1e3 * statistics.median(decode_s[name]):.2f}")
    reference = logits["f32"]
    errors = {name: float(np.sqrt(np.mean((logits[name] - reference) ** 2) / np.mean(reference ** 2)))
              for name in ("q8-rowdot", "q8-tiles")}
    same_bits = bool(np.array_equal(logits["q8-rowdot"].view(np.uint32), logits["q8-tiles"].view(np.uint32)))
    record.update(logit_error_vs_f32=errors, tiles_equal_row_dot_bits=same_bits)
    tiles, row_dot, float_path = (statistics.median(prefill_s[n]) for n in ("q8-tiles", "q8-rowdot", "f32"))
    print(f"prefill {args.prompt_len} tokens, CPU: tiles {tiles:.3f} s, int8 row dot {row_dot:.3f} s "
          f"({row_dot / tiles:.2f}x), f32 {float_path:.3f} s ({float_path / tiles:.2f}x); logits q8 vs f32 "
          f"{errors['q8-tiles']:.2e} relative RMS; tiles == row dot bits: {same_bits}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
