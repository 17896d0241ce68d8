"""How far the opt-in int8 expert path (`K3SERVE_MXFP4_ACTIVATIONS=q8`, kernels section "MXFP4 x int8") moves a
K3 model's logits from the float path: the same prompt and decode tokens (teacher-forced) through both, in one
process, per step the logits' relative RMS difference and whether the top token agrees.

    PYTHONPATH=src .venv/bin/python benchmarks/eval_mxfp4_q8.py [--model DIR | --model embedded] [--steps 16]
Default model: the widened trained K3 (bench_peers.widened_checkpoint(16, 32)). Prints one summary line, then a
JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def run(model, tokens: np.ndarray, prompt_len: int, activations: str) -> list[np.ndarray]:
    from k3serve.model import kernels
    from k3serve.model.interface import ForwardItem

    kernels.MXFP4_ACTIVATIONS = activations  # read at each expert call
    cache = model.new_cache()
    out = [model.forward([ForwardItem(tokens[:prompt_len], cache)]).logits[0][-1]]
    for token in tokens[prompt_len:]:
        out.append(model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1])
    return [np.asarray(x, np.float64) for x in out]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    from bench_peers import widened_checkpoint
    from k3serve.loading import default_model_dir, load_model

    checkpoint = args.model or widened_checkpoint(16, 32)
    if args.model == Path("embedded"):
        checkpoint = Path(default_model_dir())
    model = load_model(checkpoint).model
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len + args.steps)
    float_logits = run(model, tokens, args.prompt_len, "f32")
    q8_logits = run(model, tokens, args.prompt_len, "q8")
    errors = [float(np.sqrt(np.mean((q - f) ** 2) / np.mean(f ** 2))) for q, f in zip(q8_logits, float_logits)]
    agree = [int(np.argmax(q) == np.argmax(f)) for q, f in zip(q8_logits, float_logits)]
    print(f"summary: {checkpoint.parent.name}: logits relative RMS q8 vs f32 median {np.median(errors):.2e} max "
          f"{max(errors):.2e}; top token agrees at {sum(agree)} of {len(agree)} positions")
    print(json.dumps({"benchmark": "eval_mxfp4_q8", "model": str(checkpoint), "prompt_len": args.prompt_len,
                      "steps": args.steps, "relative_rms": errors, "top1_agree": agree}))


if __name__ == "__main__":
    main()
