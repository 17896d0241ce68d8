"""Kimi Linear, Qwen3-MoE and DeepSeek-V3 in k3serve against llama.cpp and transformers, at each precision pair.

    python benchmarks/bench_families_peers.py [--families qwen3_moe,kimi_linear,deepseek_v3] [--rounds 3]

Needs the `test` extra (transformers builds the checkpoints and is the third engine) and the `peers` extra
(llama-cpp-python and its sdist's converter, `--llama-tree`). What it does, per family:
1. The fixture: a random transformers model of the family (`tests/model/families/_hf_tiny.py`'s config, scaled
   by --hidden/--experts/...: realistic MoE proportions, 64 experts top-8 by default), saved in bf16.
2. The GGUFs, with llama.cpp's own tools: `convert_hf_to_gguf.py --outtype bf16` (BF16) and `--outtype q8_0`
   (Q8_0, every matrix), and `llama_model_quantize` of the BF16 file to MXFP4_MOE (MXFP4 experts, the rest
   Q8_0). The vocabulary is written as placeholder tokens (our random models have no tokenizer); ids are fed.
3. The pairs, alternated round by round, one fresh process per run, 2 threads each: k3serve experts bf16 vs
   llama.cpp BF16, int8 vs Q8_0, mxfp4 vs MXFP4_MOE, and transformers in bf16. Each run loads every expert
   (k3serve packs experts on first use; here all before timing, as resident as llama.cpp's), prefills
   --prompt-len tokens and decodes --decode-steps at batch 1; medians.
Agreement: the greedy tokens of k3serve bf16, llama.cpp BF16 and transformers.
Prints one summary line per family and a JSON record on the last line. Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "model" / "families")]
from bench_peers import FAMILY_CONVERT, peak_rss_mib  # noqa: E402
from k3serve.host import defaults_environment  # noqa: E402
WORK = Path(os.environ.get("K3BENCH_FAMILIES_DIR", "/tmp/k3bench-families"))
PAIRS = (("bf16", "BF16"), ("int8", "Q8_0"), ("mxfp4", "MXFP4_MOE"))


def scaled_overrides(family: str, args: argparse.Namespace) -> dict:
    """Config attributes that grow the family's tiny test config to the benchmark size (no dense layer, so
    every layer's MLP is the routed MoE, which is what the precision pairs compare)."""
    H, L, E, K, MI = args.hidden, args.layers, args.experts, args.top_k, args.expert_width
    common = dict(vocab_size=args.vocab, hidden_size=H, intermediate_size=4 * MI, moe_intermediate_size=MI,
                  num_hidden_layers=L, num_attention_heads=H // 64, max_position_embeddings=4096)
    if family == "qwen3_moe":
        return {**common, "num_key_value_heads": H // 128, "head_dim": 64, "num_experts": E,
                "num_local_experts": E,  # transformers 5's name; the tiny config's own value would win otherwise
                "num_experts_per_tok": K, "mlp_only_layers": []}
    if family == "kimi_linear":
        kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L)]  # 3 KDA : 1 MLA
        return {**common, "num_key_value_heads": H // 64, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
                "qk_rope_head_dim": 32, "v_head_dim": 64, "num_local_experts": E, "num_experts": E,
                "num_experts_per_tok": K, "num_experts_per_token": K, "linear_head_dim": 64,
                "linear_num_heads": H // 64, "layer_types": kinds, "mlp_layer_types": ["sparse"] * L,
                "first_k_dense_replace": 0}
    if family == "deepseek_v3":
        return {**common, "num_key_value_heads": H // 64, "q_lora_rank": 192, "kv_lora_rank": 128,
                "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": E,
                "num_experts_per_tok": K, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 0,
                "max_position_embeddings": 4096}
    raise ValueError(family)


def build_checkpoint(family: str, args: argparse.Namespace) -> Path:
    key = f"{family}-h{args.hidden}-l{args.layers}-e{args.experts}k{args.top_k}-w{args.expert_width}-v{args.vocab}"
    folder = WORK / key / "checkpoint"
    if not (folder / "config.json").exists():
        import torch
        import _hf_tiny

        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        print(f"building {key} with transformers (once)...", file=sys.stderr)
        tiny = _hf_tiny.tiny_config(family)  # rebuilt from its arguments, so derived sizes follow the overrides
        fields = {k: v for k, v in tiny.to_dict().items() if k not in ("qk_head_dim", "head_dim")
                  or family == "qwen3_moe"}
        config = type(tiny)(**{**fields, **scaled_overrides(family, args)})
        torch.manual_seed(_hf_tiny.SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        _hf_tiny._perturb(model, torch.Generator().manual_seed(_hf_tiny.SEED + 1))
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        del model
        config = json.loads((folder / "config.json").read_text())
        config.setdefault("num_key_value_heads", config["num_attention_heads"])  # llama.cpp's MLA converters
        if family == "kimi_linear":  # the released layout keys llama.cpp's converter reads (1-based layers)
            kinds = config["layer_types"]
            config["linear_attn_config"] = {
                "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
                "kda_layers": [i + 1 for i, k in enumerate(kinds) if k != "full_attention"],
                "num_heads": config["linear_num_heads"], "head_dim": config["linear_head_dim"],
                "short_conv_kernel_size": config["linear_conv_kernel_dim"]}
            config["first_k_dense_replace"] = 0
            config["moe_router_activation_func"] = "sigmoid"
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# llama.cpp's converter with placeholder vocab (random models have no tokenizer; ids are fed directly), as
# bench_peers.py runs it for every family
CONVERT = FAMILY_CONVERT


def build_ggufs(checkpoint: Path, tree: Path) -> dict[str, Path]:
    out = {kind: checkpoint.parent / f"{kind}.gguf" for _, kind in PAIRS}
    for kind, outtype in (("BF16", "bf16"), ("Q8_0", "q8_0")):
        if not out[kind].exists():
            print(f"converting {checkpoint.parent.name} to {kind} with llama.cpp's converter (once)...",
                  file=sys.stderr)
            subprocess.run([sys.executable, "-c", CONVERT, str(tree), str(checkpoint), "--outfile", str(out[kind]),
                            "--outtype", outtype], check=True, capture_output=True)
    if not out["MXFP4_MOE"].exists():
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(out["BF16"]).encode(), str(out["MXFP4_MOE"]).encode(),
                                          params) != 0:
            raise RuntimeError("llama_model_quantize to MXFP4_MOE failed")
    return out


# ------------------------------------------------------------------------------------------------ one run
def run_k3serve(spec: dict) -> dict:
    from k3serve.loading import load_model
    from k3serve.model.families.moe import MoEBlock
    from k3serve.model.interface import ForwardItem

    model = load_model(spec["checkpoint"], expert_precision=spec["precision"]).model  # as the CLI loads it
    for layer in model.layers:  # resident like llama.cpp's: every expert read and packed before timing
        if isinstance(layer.mlp, MoEBlock):
            for expert in range(layer.mlp.router.weight.shape[0]):
                layer.mlp.experts.get(layer.mlp.layer, expert)
    prompt = np.asarray(spec["prompt"], np.int64)
    warm = model.new_cache()
    model.forward([ForwardItem(prompt, warm)])  # warm-up: every expert packed, every kernel compiled
    model.forward([ForwardItem(prompt[8:9], warm)])
    cache = model.new_cache()
    started = time.perf_counter()
    logits = model.forward([ForwardItem(prompt, cache)]).logits[0][-1]
    prefill_s = time.perf_counter() - started
    token = int(np.argmax(logits))
    greedy = [token]
    started = time.perf_counter()
    for _ in range(spec["decode_steps"]):
        token = int(np.argmax(model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]))
        greedy.append(token)
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": spec["decode_steps"] / decode_s,
            "peak_rss_mib": peak_rss_mib(), "greedy": greedy[:10]}


def run_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.bfloat16).eval()
    prompt = torch.tensor([spec["prompt"]])
    with torch.no_grad():
        model(prompt, use_cache=True)  # warm-up
        started = time.perf_counter()
        out = model(prompt, use_cache=True)
        prefill_s = time.perf_counter() - started
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        greedy = [token]
        started = time.perf_counter()
        for _ in range(spec["decode_steps"]):
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            greedy.append(token)
        decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(spec["prompt"]) / prefill_s, "decode_tok_s": spec["decode_steps"] / decode_s,
            "peak_rss_mib": peak_rss_mib(), "greedy": greedy[:10]}


def run_llama_cpp(spec: dict) -> dict:
    from bench_peers import run_llama_cpp as run

    return run({**spec, "logits": False})


RUNNERS = {"k3serve": run_k3serve, "llama.cpp": run_llama_cpp, "transformers": run_transformers}


def child(engine: str, spec: dict) -> dict:
    env = defaults_environment(spec["threads"])  # not this process's OMP_WAIT_POLICY, which k3serve set
    if engine == "llama.cpp" and spec.get("llama_omp_wait_policy"):  # a second row; the headline is its default
        env["OMP_WAIT_POLICY"] = spec["llama_omp_wait_policy"]
    out = subprocess.run([sys.executable, __file__, "--child", engine, json.dumps(spec)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(RUNNERS[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    from k3serve.host import describe_host

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_moe,kimi_linear,deepseek_v3")
    parser.add_argument("--llama-tree", type=Path,
                        default=Path("/tmp/llama_sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--llama-omp-wait-policy", choices=("ACTIVE", "PASSIVE"), default=None,
                        help="OMP_WAIT_POLICY for llama.cpp (default: none set, llama.cpp at its own default)")
    args = parser.parse_args()

    records = {}
    for family in args.families.split(","):
        checkpoint = build_checkpoint(family, args)
        ggufs = build_ggufs(checkpoint, args.llama_tree)
        prompt = np.random.default_rng(0).integers(3, args.vocab, size=args.prompt_len).tolist()
        base = {"checkpoint": str(checkpoint), "prompt": prompt, "threads": args.threads,
                "decode_steps": args.decode_steps, "llama_omp_wait_policy": args.llama_omp_wait_policy}
        configs = {f"k3serve {ours}": ("k3serve", {**base, "precision": ours}) for ours, _ in PAIRS}
        configs.update({f"llama.cpp {theirs}": ("llama.cpp", {**base, "gguf": str(ggufs[theirs])})
                        for _, theirs in PAIRS})
        configs["transformers bf16"] = ("transformers", base)
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, (engine, spec) in configs.items():
                runs[name].append(child(engine, spec))
        med = {}
        for name, rs in runs.items():
            good = [r for r in rs if "error" not in r]
            med[name] = ({key: statistics.median(r[key] for r in good)
                          for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")} if good
                         else {"error": rs[0]["error"]})
        ratio = {}
        for ours, theirs in PAIRS:
            a, b, hf = med[f"k3serve {ours}"], med[f"llama.cpp {theirs}"], med["transformers bf16"]
            if "error" not in a and "error" not in b:
                ratio[f"{ours} vs {theirs}"] = {k: round(a[k] / b[k], 3) for k in a}
            if "error" not in a and "error" not in hf:
                ratio[f"{ours} vs transformers"] = {k: round(a[k] / hf[k], 3) for k in a}
        first = {name: rs[0].get("greedy") for name, rs in runs.items()}
        records[family] = {"checkpoint": str(checkpoint), "median": med, "ratios": ratio,
                           "greedy_first_round": first, "overrides": scaled_overrides(family, args),
                           "all_runs": {n: [{k: v for k, v in r.items() if k != "greedy"} for r in rs]
                                        for n, rs in runs.items()}}
        line = " | ".join(f"{pair} decode {r['decode_tok_s']:.2f}x prefill {r['prefill_tok_s']:.2f}x"
                          for pair, r in ratio.items())
        print(f"{family}: {line}", flush=True)
    record = {"benchmark": "families_peers", "machine": describe_host(), "rounds": args.rounds,
              "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "threads": args.threads,
              "llama_omp_wait_policy": args.llama_omp_wait_policy or "llama.cpp default", "families": records}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
