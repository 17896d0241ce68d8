"""Train a small K3 from scratch on the offline corpus and export a servable checkpoint.

    python -m k3serve.training.train --out DIR [--steps N] [--seconds S] [--device cuda]

Steps: build the corpus (k3serve.training.corpus), train a 1024-token byte-level BPE on its training split, tokenize,
train `K3ForTraining` with AdamW on seeded random windows (the same seed gives the same data order and weights),
evaluate held-out loss against a unigram baseline, export (bf16 trunk, MXFP4 experts) into DIR with the tokenizer,
and write DIR/SHA256SUMS (identical for identical seeds and arguments).
DIR/train_log.json keeps the loss curve. Serve with `k3serve generate --model DIR`.

On CUDA the run uses torch's deterministic algorithms, so the same command on the same kind of device (and
torch version) reproduces the checkpoint. `--corpus-cache DIR` keeps the tokenizer and the token ids, so a
machine whose Python has another standard library (the code corpus) can train on exactly this corpus.
`--time-budget S` times the first steps and then fixes --steps so that the run takes about S seconds; the log
records the number, and rerunning with that --steps (and the same --warmup) reproduces the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from k3serve.config import K3Config, load_config
from k3serve.tokenizer import DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKENS, DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, Tokenizer
from k3serve.tokenizer_training import train_bpe, write_tokenizer
from k3serve.training.corpus import (DEFAULT_CODE_BYTES, DEFAULT_COPY_BYTES, DEFAULT_COPY_PER_MODULE,
                                     DEFAULT_EXTRA_CODE_BYTES, DEFAULT_PROSE_BYTES, build_corpus, copy_documents,
                                     copy_probe)
from k3serve.training.model import K3ForTraining, export, export_tensors, init_weights, load_exported

BPE_VOCAB_SIZE = 1024
BPE_TRAIN_BYTES = 1_500_000  # the first bytes of the training split the BPE merges are learned on
PROBE_MAX_COUNT = 64  # copying-probe examples stored with the corpus (--probe-count uses the first ones)


def training_config(tokenizer: Tokenizer, hidden_size: int = 128, kda_heads: int = 4, mla_heads: int = 4,
                    kv_lora_rank: int = 32, q_lora_rank: int = 64, dense_intermediate: int = 256) -> K3Config:
    """8 layers (KKKM KKKM, layer 0 dense), 64 routed experts top-4 plus one shared, latent MoE, gated MLA.
    The keywords widen the trunk (the routed experts work in the latent space and keep their size)."""
    return K3Config(
        hidden_size=hidden_size, num_layers=8, vocab_size=tokenizer.vocab_size, rms_norm_eps=1e-5,
        num_mla_heads=mla_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32, mla_use_output_gate=True, num_experts=64, num_experts_per_token=4, num_shared_experts=1,
        latent_size=64, moe_intermediate_size=64, routed_scaling_factor=1.0, moe_renormalize=True,
        latent_moe_use_norm=True, router_activation="sigmoid", num_expert_group=1, topk_group=1,
        first_k_dense_replace=1, intermediate_size=dense_intermediate, attn_res_block_size=3, situ_beta=4.0,
        situ_linear_beta=25.0, kda_num_heads=kda_heads, kda_head_dim=32, short_conv_kernel_size=4,
        gate_lower_bound=-5.0, full_attn_layers=(4, 8), kda_layers=(1, 2, 3, 5, 6, 7),
        bos_token_id=tokenizer.bos_id, eos_token_ids=tuple(tokenizer.eos_ids),
    )


def encode_docs(tokenizer: Tokenizer, docs: list[str], eos: bool = False) -> np.ndarray:
    """One stream: BOS before every document, and with `eos` the first end token ([EOS]) after each one."""
    ids: list[int] = []
    for doc in docs:
        ids.append(tokenizer.bos_id)
        ids.extend(tokenizer.encode(doc))
        if eos:
            ids.append(tokenizer.eos_ids[0])
    return np.asarray(ids, dtype=np.int64)


def unigram_loss(train_ids: np.ndarray, heldout_ids: np.ndarray, vocab_size: int) -> float:
    """Held-out cross-entropy (nats/token) of add-one-smoothed training unigram frequencies."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout_ids].mean())


@torch.no_grad()
def heldout_loss(model: K3ForTraining, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        logits = model(batch[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def copy_prefix_shares(model: K3ForTraining, probe: list[tuple[np.ndarray, np.ndarray]], batch_size: int,
                       device: torch.device) -> list[float]:
    """benchmarks/eval_copy.py in one teacher-forced pass: for each (prompt ids, wanted ids), the share of the
    wanted tokens that greedy decoding reproduces before its first mistake. Greedy decoding and the teacher-forced
    argmax agree on every token up to the first mistake, so this is the greedy figure (of these float weights)."""
    model.eval()
    shares = []
    for start in range(0, len(probe), batch_size):
        part = probe[start:start + batch_size]
        length = max(len(p) + len(w) - 1 for p, w in part)
        ids = torch.zeros(len(part), length, dtype=torch.long)  # right-padded: causal, so padding changes nothing
        for row, (prompt, want) in enumerate(part):
            seq = np.concatenate([prompt, want[:-1]])
            ids[row, :len(seq)] = torch.from_numpy(seq)
        guesses = model(ids.to(device)).argmax(-1).cpu().numpy()  # [rows, length]
        for row, (prompt, want) in enumerate(part):
            got = guesses[row, len(prompt) - 1:len(prompt) - 1 + len(want)]
            wrong = np.flatnonzero(got != want)
            shares.append((int(wrong[0]) if len(wrong) else len(want)) / len(want))
    model.train()
    return shares


def sha256_files(folder: Path) -> str:
    """Write folder/SHA256SUMS over the checkpoint files (not the timing log) and return the digest of that list."""
    lines = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in ("SHA256SUMS", "train_log.json")):
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    (folder / "SHA256SUMS").write_text("".join(lines))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def prepare_data(args: argparse.Namespace, out: Path) -> tuple[Tokenizer, np.ndarray, dict[str, np.ndarray], dict,
                                                               dict[str, np.ndarray]]:
    """Corpus, BPE and token ids (written to / read from --corpus-cache when given). Writes the tokenizer into out.
    Returns (tokenizer, training ids, held-out ids per kind, corpus summary, extras), extras holding
    "copy_starts" (where each revision document's BOS is in the training ids) and the copying probe
    ("probe_ids", "probe_prompt_lens", "probe_want_lens": eval_copy.py's prompts and wanted continuations)."""
    corpus_args = {"code_bytes": args.code_bytes, "prose_bytes": args.prose_bytes, "copy_bytes": args.copy_bytes,
                   "copy_per_module": args.copy_per_module, "extra_code_bytes": args.extra_code_bytes,
                   "extra_prose": args.extra_prose, "eos_docs": args.eos_docs, "bpe_vocab": BPE_VOCAB_SIZE,
                   "bpe_bytes": BPE_TRAIN_BYTES}
    if args.copy_strip_docstrings:  # only when used, so caches built before the flag stay valid
        corpus_args["copy_strip_docstrings"] = args.copy_strip_docstrings
    cache = Path(args.corpus_cache) if args.corpus_cache else None
    if cache is not None and (cache / "corpus.json").is_file():
        meta = json.loads((cache / "corpus.json").read_text())
        if meta["args"] != corpus_args:
            raise SystemExit(f"error: --corpus-cache {cache} holds a corpus built with {meta['args']}, "
                             f"not {corpus_args}")
        for file in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(cache / file, out / file)
        tokenizer = Tokenizer.from_dir(out)
        with np.load(cache / "train.npz") as archive:
            train_ids = archive["ids"].astype(np.int64)
        heldout = {kind: np.load(cache / f"heldout_{kind}.npy").astype(np.int64) for kind in meta["heldout_kinds"]}
        extras = {}
        if (cache / "extras.npz").is_file():
            with np.load(cache / "extras.npz") as archive:
                extras = {name: archive[name].astype(np.int64) for name in archive.files}
        print(f"corpus: from the cache {cache} ({meta['summary']})")
        return tokenizer, train_ids, heldout, meta["summary"], extras

    corpus = build_corpus(args.code_bytes, args.prose_bytes, args.copy_bytes, args.copy_per_module,
                          args.extra_code_bytes, bool(args.extra_prose), args.copy_strip_docstrings)
    summary = {"train_documents": len(corpus.train), "heldout_documents": len(corpus.heldout),
               "code_bytes": corpus.num_code_bytes, "prose_bytes": corpus.num_prose_bytes,
               "copy_bytes": corpus.num_copy_bytes, "extra_code_bytes": corpus.num_extra_code_bytes,
               "extra_prose_bytes": corpus.num_extra_prose_bytes, "prose_source": corpus.prose_source,
               "python": platform.python_version()}
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out documents; "
          f"{corpus.num_code_bytes} code + {corpus.num_prose_bytes} prose + {corpus.num_copy_bytes} revision + "
          f"{corpus.num_extra_code_bytes} extra code + {corpus.num_extra_prose_bytes} extra prose bytes "
          f"({corpus.prose_source}; Python {platform.python_version()})")
    bpe_text: list[str] = []
    remaining = BPE_TRAIN_BYTES
    for doc in corpus.train:
        if remaining <= 0:
            break
        bpe_text.append(doc)
        remaining -= len(doc.encode())
    tokens = train_bpe(bpe_text, BPE_VOCAB_SIZE, DEFAULT_PATTERN)
    write_tokenizer(out, tokens, DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKENS,
                    source=f"k3serve.training.train: BPE {BPE_VOCAB_SIZE} on the first {BPE_TRAIN_BYTES} bytes of "
                           f"the training split (stdlib code + {corpus.prose_source})")
    tokenizer = Tokenizer.from_dir(out)
    train_ids = encode_docs(tokenizer, corpus.train, eos=bool(args.eos_docs))
    heldout = {"code": encode_docs(tokenizer, corpus.heldout_code),
               "prose": encode_docs(tokenizer, corpus.heldout_prose)}
    if args.copy_bytes > 0:  # revision documents made from held-out code: does copying generalise?
        heldout["copy"] = encode_docs(tokenizer, copy_documents(corpus.heldout_code, args.copy_bytes))
    bos_positions = np.flatnonzero(train_ids == tokenizer.bos_id)  # one per training document, in order
    probe = [([tokenizer.bos_id] + tokenizer.encode(prompt), tokenizer.encode(rest))
             for prompt, rest in copy_probe(corpus.heldout_code, PROBE_MAX_COUNT)]
    extras = {"copy_starts": bos_positions[corpus.copy_range[0]:corpus.copy_range[1]],
              "probe_ids": np.asarray([t for p, w in probe for t in p + w], dtype=np.int64),
              "probe_prompt_lens": np.asarray([len(p) for p, _ in probe], dtype=np.int64),
              "probe_want_lens": np.asarray([len(w) for _, w in probe], dtype=np.int64)}
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for file in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(out / file, cache / file)
        small = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int64
        np.savez_compressed(cache / "train.npz", ids=train_ids.astype(small))
        for kind, ids in heldout.items():
            np.save(cache / f"heldout_{kind}.npy", ids.astype(small))
        np.savez_compressed(cache / "extras.npz", **extras)
        (cache / "corpus.json").write_text(json.dumps({"args": corpus_args, "heldout_kinds": list(heldout),
                                                       "summary": summary}, indent=2) + "\n")
    return tokenizer, train_ids, heldout, summary, extras


def probe_examples(extras: dict[str, np.ndarray], count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first `count` (prompt ids, wanted ids) pairs of the copying probe that prepare_data stored."""
    if "probe_ids" not in extras:
        return []
    out, at = [], 0
    for prompt_len, want_len in zip(extras["probe_prompt_lens"], extras["probe_want_lens"]):
        ids = extras["probe_ids"][at:at + prompt_len + want_len]
        out.append((ids[:prompt_len], ids[prompt_len:]))
        at += prompt_len + want_len
    return out[:count]


def repeat_windows(ids: np.ndarray, rng: np.random.Generator, count: int, length: int) -> list[np.ndarray]:
    """`count` windows of `length` tokens, each a random span of `ids` (32 tokens to half a window) repeated until the
    window is full. Only the first copy can be predicted without looking back, so these windows reward copying from
    the context (induction) from the first step."""
    out = []
    for _ in range(count):
        span = int(rng.integers(32, max(33, length // 2 + 1)))
        start = int(rng.integers(0, len(ids) - span))
        out.append(np.resize(ids[start:start + span], length))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3serve.training.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder for the exported checkpoint")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (also the LR schedule length)")
    parser.add_argument("--seconds", type=float, default=None, help="stop early after this much training time")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="time the first steps, then set --steps to fit about this many seconds of training")
    parser.add_argument("--stop-step", type=int, default=None,
                        help="stop after this step with the --steps schedule (reproduces a run cut by --seconds)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-len", type=int, default=None, help="held-out window length (default: --seq-len)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decays to lr * this")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: min(50, steps/10 + 1))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--code-bytes", type=int, default=DEFAULT_CODE_BYTES)
    parser.add_argument("--prose-bytes", type=int, default=DEFAULT_PROSE_BYTES)
    parser.add_argument("--copy-bytes", type=int, default=DEFAULT_COPY_BYTES,
                        help="revision documents (a function, then the function again) meant to teach copying; "
                             "0 (the default): none")
    parser.add_argument("--copy-per-module", type=int, default=DEFAULT_COPY_PER_MODULE,
                        help="at most this many revision documents per module")
    parser.add_argument("--copy-strip-docstrings", type=float, default=0.0,
                        help="share of the revision documents whose function loses its docstring, in both copies "
                             "(0, the default: none; the held-out copy split and probe keep theirs)")
    parser.add_argument("--extra-code-bytes", type=int, default=DEFAULT_EXTRA_CODE_BYTES,
                        help="training-only code from the installed torch package's .py files (0: none)")
    parser.add_argument("--extra-prose", type=int, default=0, choices=(0, 1),
                        help="1: also train on the book paragraphs the thinning left out")
    parser.add_argument("--eos-docs", type=int, default=0, choices=(0, 1),
                        help="1: end every training document with [EOS], so that the model learns to stop (the "
                             "held-out windows stay as they were, for comparable losses)")
    parser.add_argument("--copy-share", type=float, default=0.0,
                        help="share of each batch's windows that start at a revision document (0: plain random "
                             "windows of the whole stream, the default)")
    parser.add_argument("--repeat-share", type=float, default=0.0,
                        help="share of each batch's windows that are a random span of the training stream (32 tokens "
                             "to half a window) repeated until the window is full: in-context copying (induction) "
                             "data; 0 (the default): none")
    parser.add_argument("--probe-count", type=int, default=20,
                        help="held-out functions in the copying probe logged at every evaluation (0: none)")
    parser.add_argument("--save-every", type=int, default=0,
                        help="also export the checkpoint (and log) into --out every this many steps (0: only at "
                             "the end); a checkpoint of step k is reproduced with --stop-step k")
    parser.add_argument("--corpus-cache", default=None, help="folder to keep (or reuse) the tokenized corpus in")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--kda-heads", type=int, default=4)
    parser.add_argument("--mla-heads", type=int, default=4)
    parser.add_argument("--kv-lora-rank", type=int, default=32)
    parser.add_argument("--q-lora-rank", type=int, default=64)
    parser.add_argument("--dense-intermediate", type=int, default=256)
    parser.add_argument("--init-from", default=None,
                        help="start from this exported checkpoint's weights (its config must match) instead of the "
                             "seeded initialisation; the router biases come with it")
    parser.add_argument("--device", default="cpu", help="torch device: cpu (reproducible, the default), cuda, auto")
    args = parser.parse_args(argv)
    if not 0.0 <= args.copy_share <= 1.0:
        parser.error("--copy-share must be within [0, 1]")
    if not 0.0 <= args.repeat_share <= 1.0 or args.copy_share + args.repeat_share > 1.0:
        parser.error("--repeat-share must be within [0, 1], and with --copy-share at most 1")
    if not 0.0 <= args.copy_strip_docstrings <= 1.0:
        parser.error("--copy-strip-docstrings must be within [0, 1]")
    if not 0 <= args.probe_count <= PROBE_MAX_COUNT:
        parser.error(f"--probe-count must be within [0, {PROBE_MAX_COUNT}]")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda":  # reproducible on the same kind of device
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = True  # deterministic, and the export rounds to bf16 anyway
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    tokenizer, train_ids, heldout, corpus_summary, extras = prepare_data(args, out)
    copy_starts = extras.get("copy_starts", np.zeros(0, np.int64))
    copy_rows = int(round(args.copy_share * args.batch_size))
    repeat_rows = int(round(args.repeat_share * args.batch_size))
    if copy_rows:
        copy_starts = copy_starts[copy_starts <= len(train_ids) - (args.seq_len + 1)]
        if len(copy_starts) == 0:
            raise SystemExit("error: --copy-share needs revision documents (--copy-bytes > 0) and a --corpus-cache "
                             "built by this version")
    probe = probe_examples(extras, args.probe_count)
    print(f"tokenizer: {tokenizer.vocab_size} tokens; {len(train_ids)} train / {len(heldout['code'])} held-out code / "
          f"{len(heldout['prose'])} held-out prose tokens ({time.perf_counter() - started:.0f} s)")

    config = training_config(tokenizer, args.hidden_size, args.kda_heads, args.mla_heads, args.kv_lora_rank,
                             args.q_lora_rank, args.dense_intermediate)
    model = K3ForTraining(config)
    init_weights(model, args.seed)
    if args.init_from is not None:
        if load_config(args.init_from) != config:
            raise SystemExit(f"error: --init-from {args.init_from} has another config than this run's")
        load_exported(model, args.init_from)
    model.to(device)
    tensors, dtypes = export_tensors(model)
    size_mb = sum(a.size * (2 if dtypes[n] == "BF16" else 4 if dtypes[n] == "F32" else 1)
                  for n, a in tensors.items()) / 1e6
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {config.layer_map}, {config.num_experts} experts top-{config.num_experts_per_token}, "
          f"{num_params / 1e6:.2f} M parameters, export {size_mb:.1f} MB")

    L = args.seq_len + 1
    EL = (args.eval_len or args.seq_len) + 1
    rng = np.random.default_rng(args.seed)
    eval_windows, baselines = {}, {}
    for kind, ids in heldout.items():
        if len(ids) < EL:
            raise SystemExit(f"error: the held-out {kind} split has {len(ids)} tokens, fewer than one window of {EL}; "
                             "raise --code-bytes/--prose-bytes or lower --eval-len/--seq-len")
        eval_starts = np.linspace(0, len(ids) - EL, args.eval_windows).astype(np.int64)
        eval_windows[kind] = torch.from_numpy(np.stack([ids[s:s + EL] for s in eval_starts])).to(device)
        baselines[kind] = unigram_loss(train_ids, ids, config.vocab_size)
    print("held-out unigram baseline: " + ", ".join(f"{k} {v:.3f}" for k, v in baselines.items()) + " nats/token")

    def evaluate() -> dict[str, float]:
        return {kind: heldout_loss(model, windows, args.batch_size) for kind, windows in eval_windows.items()}

    def probe_copying() -> dict[str, float]:
        if not probe:
            return {}
        shares = copy_prefix_shares(model, probe, 8, device)
        return {"copy_prefix_share": sum(shares) / len(shares), "whole_copies": sum(s == 1.0 for s in shares)}

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    warmup = args.warmup if args.warmup is not None else min(50, args.steps // 10 + 1)
    timing_steps = min(50, warmup) if args.time_budget is not None else 0
    steps = args.steps if not timing_steps else 1 << 62  # with --time-budget: set after timing_steps

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        floor = args.min_lr_ratio
        return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    log: list[dict] = []
    first = evaluate()
    log.append({"step": 0, "heldout_loss": first, "seconds": 0.0, **probe_copying()})
    print("step     0  held-out " + " ".join(f"{k} {v:.3f}" for k, v in first.items()), flush=True)

    def write_checkpoint(step: int) -> str:
        export(model, config, out, tokenizer_dir=None)
        (out / "train_log.json").write_text(json.dumps({
            "args": vars(args), "unigram_baseline": baselines, "corpus": corpus_summary,
            "prose_source": corpus_summary["prose_source"], "steps": step, "schedule_steps": steps, "warmup": warmup,
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
            platform.processor() or platform.machine(), "torch": torch.__version__, "parameters": num_params,
            "seconds_per_step": (time.perf_counter() - train_started) / max(step, 1),
            "train_tokens": int(len(train_ids)), "heldout_tokens": {k: int(len(v)) for k, v in heldout.items()},
            "curve": log}, indent=2) + "\n")
        return sha256_files(out)

    train_started = time.perf_counter()
    step = 0
    running = torch.zeros((), device=device)  # summed on the device: no host sync per step
    timed_from = None
    while step < steps:
        step += 1
        starts = rng.integers(0, len(train_ids) - L, size=args.batch_size - copy_rows - repeat_rows)
        if copy_rows:  # windows that begin with a revision document (the same rng: --copy-share 0 draws as before)
            starts = np.concatenate([starts, copy_starts[rng.integers(0, len(copy_starts), size=copy_rows)]])
        rows = [train_ids[s:s + L] for s in starts]
        if repeat_rows:  # a span repeated to the window's end (the same rng: --repeat-share 0 draws as before)
            rows += repeat_windows(train_ids, rng, repeat_rows, L)
        batch = torch.from_numpy(np.stack(rows)).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.update_router_bias(1e-3)
        running += loss.detach()
        elapsed = time.perf_counter() - train_started
        if timing_steps and step == timing_steps // 5:
            timed_from = (step, elapsed)
        if timing_steps and step == timing_steps:  # fix the schedule's length (only the warm-up has run so far)
            per_step = (elapsed - timed_from[1]) / (step - timed_from[0])
            per_step *= 1.0 + 1.0 / args.eval_every * 4  # the held-out evaluations
            steps = max(step + 1, int((args.time_budget - elapsed) / per_step) + step)
            steps = max(timing_steps + 1, steps // 100 * 100)
            print(f"time budget {args.time_budget:.0f} s at {per_step:.3f} s/step: --steps {steps} "
                  f"(rerun with --steps {steps} --warmup {warmup})", flush=True)
        done = (step == steps or (args.seconds is not None and elapsed >= args.seconds)
                or (args.stop_step is not None and step >= args.stop_step))
        if step % args.eval_every == 0 or done:
            loads = torch.stack([m.last_load.float() for m in model.moe_layers()])  # [layers, NE]
            imbalance = float((loads.max(1).values / loads.mean(1)).mean())
            held = evaluate()
            train_loss = float(running) / (step - (log[-1]["step"] if log else 0))
            running.zero_()
            copying = probe_copying()
            log.append({"step": step, "train_loss": train_loss, "heldout_loss": held, "seconds": elapsed,
                        "max_over_mean_expert_load": imbalance, **copying})
            losses = " ".join(f"{k} {v:.3f}" for k, v in held.items())
            copied = f"  copying {copying['copy_prefix_share']:.1%}" if copying else ""
            print(f"step {step:5d}  train {train_loss:.3f}  held-out {losses}{copied}  "
                  f"load max/mean {imbalance:.2f}  {elapsed / step:.2f} s/step", flush=True)
        if done:
            break
        if args.save_every and step % args.save_every == 0:
            print(f"step {step:5d}  saved, SHA256SUMS digest {write_checkpoint(step)}", flush=True)

    digest = write_checkpoint(step)
    print(f"exported {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB); SHA256SUMS digest {digest}; "
          f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
