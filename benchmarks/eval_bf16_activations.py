"""How far the opt-in bf16-activation path (`K3SERVE_BF16_ACTIVATIONS=bf16`, kernels section "bf16 weights x bf16
activations") moves a model's logits from the float path: the logits of every position of one prompt (a prefill)
through both, in one process; their relative RMS difference and how often the top token agrees. A third run rounds
only the activations of the same matrix products to bf16 and keeps the float path's arithmetic (numpy, float32), to
tell the rounding of x, which is the path's definition, from the kernel's own summation; a fourth moves each such
activation by one float32 step at random, to show how much any tiny change grows through the model. Last, how far
the prompt's last logits from one prefill are from those of one token at a time, on each path.

    PYTHONPATH=src .venv/bin/python benchmarks/eval_bf16_activations.py [--model embedded|qwen3_moe|deepseek_v3|...]
                                                                        [--tokens 64]
"embedded": the trained K3 model the package ships (its trunk is bf16); a family name: a random tiny checkpoint of
that family stored in bf16 (`write_random_family(..., bf16=True)`). Prints one summary line, then a JSON record.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile

import numpy as np

# the modules that import `linear` by name (the third run swaps it there)
LINEAR_USERS = ("k3serve.model.k3", "k3serve.model.moe", "k3serve.model.mla", "k3serve.model.kda",
                "k3serve.model.families.attention", "k3serve.model.families.decoder",
                "k3serve.model.families.latent_attention", "k3serve.model.families.delta",
                "k3serve.model.families.moe")


def load(name: str):
    if name == "embedded":
        from k3serve.loading import load_model

        return load_model().model
    from k3serve.model.families import load_family
    from k3serve.model.families.synthetic import write_random_family

    return load_family(write_random_family(name, tempfile.mkdtemp(prefix="bf16-eval-"), seed=0, bf16=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from k3serve.model import kernels

    if not kernels.BF16_DOT_AVAILABLE:
        raise SystemExit("this CPU lacks AVX512_BF16")
    model = load(args.model)
    vocab = np.asarray(model.logits([3])).shape[-1]
    ids = [int(i) for i in np.random.default_rng(0).integers(3, vocab, args.tokens)]
    logits = {}
    for mode in ("f32", "bf16"):
        kernels.BF16_ACTIVATIONS = mode
        logits[mode] = np.asarray(model.logits(ids), np.float64).reshape(args.tokens, -1)  # [T, V]
    kernels.BF16_ACTIVATIONS = "f32"
    float_linear = kernels.linear

    def rounded_x(x, w):  # the float path on bf16-rounded activations, where the bf16 path would run
        if isinstance(w, np.ndarray) and w.dtype == np.uint16:
            return float_linear(kernels.widen_bf16(kernels.round_to_bf16(x)), w)
        return float_linear(x, w)

    noise = np.random.default_rng(1)

    def nudged_x(x, w):  # the float path on x moved by one float32 step at random: how much any tiny change grows
        if isinstance(w, np.ndarray) and w.dtype == np.uint16:
            x = np.asarray(x, np.float32)
            toward = np.where(noise.random(x.shape) < 0.5, -np.inf, np.inf).astype(np.float32)
            return float_linear(np.nextafter(x, toward), w)
        return float_linear(x, w)

    users = [importlib.import_module(name) for name in LINEAR_USERS]
    for label, swapped in (("rounded x", rounded_x), ("nudged x", nudged_x)):
        for module in users:
            module.linear = swapped
        try:
            logits[label] = np.asarray(model.logits(ids), np.float64).reshape(args.tokens, -1)
        finally:
            for module in users:
                module.linear = float_linear

    def compare(a: np.ndarray, b: np.ndarray) -> dict:
        return {"relative_rms": float(np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2))),
                "top_token_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1)))}

    from k3serve.model.interface import ForwardItem

    steps_apart = {}  # the last logits of one prefill against one token at a time, on each path
    for mode in ("f32", "bf16"):
        kernels.BF16_ACTIVATIONS = mode
        whole = np.asarray(model.forward([ForwardItem(np.array(ids), model.new_cache())]).logits[0])[-1]
        cache = model.new_cache()
        for token in ids:
            last = np.asarray(model.forward([ForwardItem(np.array([token]), cache)]).logits[0])[-1]
        steps_apart[mode] = float(np.max(np.abs(whole - last)))
    kernels.BF16_ACTIVATIONS = "f32"
    record = {"model": args.model, "prefill vs one token at a time (max abs)": steps_apart, "tokens": args.tokens, "bf16 vs f32": compare(logits["f32"], logits["bf16"]),
              "rounded x vs f32": compare(logits["f32"], logits["rounded x"]),
              "bf16 vs rounded x": compare(logits["rounded x"], logits["bf16"]),
              "nudged x vs f32": compare(logits["f32"], logits["nudged x"])}
    print(f"{args.model}, {args.tokens} positions: bf16 vs f32 logits relative RMS "
          f"{record['bf16 vs f32']['relative_rms']:.1e}, top token agrees at "
          f"{record['bf16 vs f32']['top_token_agreement']:.1%}; float path on bf16-rounded x vs f32 "
          f"{record['rounded x vs f32']['relative_rms']:.1e}; bf16 kernels vs that "
          f"{record['bf16 vs rounded x']['relative_rms']:.1e}; x moved one float32 step vs f32 "
          f"{record['nudged x vs f32']['relative_rms']:.1e}; last logits of the prefill against one token at a time "
          f"{steps_apart['f32']:.1e} (f32) / {steps_apart['bf16']:.1e} (bf16) apart")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
