"""Train a small K3 from scratch on the offline corpus and export a servable checkpoint.

    python -m k3serve.training.train --out DIR [--steps N] [--seconds S]

Steps: build the corpus (k3serve.training.corpus), train a 1024-token byte-level BPE on its training split, tokenize,
train `K3ForTraining` with AdamW on seeded random windows (the same seed gives the same data order and weights),
evaluate held-out loss against a unigram baseline, export (bf16 trunk, MXFP4 experts) into DIR with the tokenizer,
and write DIR/SHA256SUMS (identical for identical seeds and arguments).
DIR/train_log.json keeps the loss curve. Serve with `k3serve generate --model DIR`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from k3serve.config import K3Config
from k3serve.tokenizer import DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKENS, DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, Tokenizer
from k3serve.tokenizer_training import train_bpe, write_tokenizer
from k3serve.training.corpus import (DEFAULT_CODE_BYTES, DEFAULT_COPY_BYTES, DEFAULT_PROSE_BYTES, build_corpus,
                                     copy_documents)
from k3serve.training.model import K3ForTraining, export, export_tensors, init_weights

BPE_VOCAB_SIZE = 1024
BPE_TRAIN_BYTES = 1_500_000  # the first bytes of the training split the BPE merges are learned on


def training_config(tokenizer: Tokenizer) -> K3Config:
    """8 layers (KKKM KKKM, layer 0 dense), 64 routed experts top-4 plus one shared, latent MoE, gated MLA."""
    return K3Config(
        hidden_size=128, num_layers=8, vocab_size=tokenizer.vocab_size, rms_norm_eps=1e-5,
        num_mla_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, mla_use_output_gate=True, num_experts=64, num_experts_per_token=4, num_shared_experts=1,
        latent_size=64, moe_intermediate_size=64, routed_scaling_factor=1.0, moe_renormalize=True,
        latent_moe_use_norm=True, router_activation="sigmoid", num_expert_group=1, topk_group=1,
        first_k_dense_replace=1, intermediate_size=256, attn_res_block_size=3, situ_beta=4.0,
        situ_linear_beta=25.0, kda_num_heads=4, kda_head_dim=32, short_conv_kernel_size=4,
        gate_lower_bound=-5.0, full_attn_layers=(4, 8), kda_layers=(1, 2, 3, 5, 6, 7),
        bos_token_id=tokenizer.bos_id, eos_token_ids=tuple(tokenizer.eos_ids),
    )


def encode_docs(tokenizer: Tokenizer, docs: list[str]) -> np.ndarray:
    """One stream: BOS before every document."""
    ids: list[int] = []
    for doc in docs:
        ids.append(tokenizer.bos_id)
        ids.extend(tokenizer.encode(doc))
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


def sha256_files(folder: Path) -> str:
    """Write folder/SHA256SUMS over the checkpoint files (not the timing log) and return the digest of that list."""
    lines = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in ("SHA256SUMS", "train_log.json")):
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    (folder / "SHA256SUMS").write_text("".join(lines))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3serve.training.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder for the exported checkpoint")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (also the LR schedule length)")
    parser.add_argument("--seconds", type=float, default=None, help="stop early after this much training time")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--code-bytes", type=int, default=DEFAULT_CODE_BYTES)
    parser.add_argument("--prose-bytes", type=int, default=DEFAULT_PROSE_BYTES)
    parser.add_argument("--copy-bytes", type=int, default=DEFAULT_COPY_BYTES,
                        help="revision documents (a function, then the function again) meant to teach copying; "
                             "0 (the default): none")
    parser.add_argument("--device", default="cpu", help="torch device: cpu (reproducible, the default), cuda, auto")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    corpus = build_corpus(args.code_bytes, args.prose_bytes, args.copy_bytes)
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out documents; "
          f"{corpus.num_code_bytes} code + {corpus.num_prose_bytes} prose + {corpus.num_copy_bytes} revision bytes "
          f"({corpus.prose_source}; "
          f"Python {platform.python_version()})")
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
    train_ids = encode_docs(tokenizer, corpus.train)
    heldout = {"code": encode_docs(tokenizer, corpus.heldout_code),
               "prose": encode_docs(tokenizer, corpus.heldout_prose)}
    if args.copy_bytes > 0:  # revision documents made from held-out code: does copying generalise?
        heldout["copy"] = encode_docs(tokenizer, copy_documents(corpus.heldout_code, args.copy_bytes))
    print(f"tokenizer: {tokenizer.vocab_size} tokens; {len(train_ids)} train / {len(heldout['code'])} held-out code / "
          f"{len(heldout['prose'])} held-out prose tokens ({time.perf_counter() - started:.0f} s)")

    config = training_config(tokenizer)
    model = K3ForTraining(config)
    init_weights(model, args.seed)
    model.to(device)
    tensors, dtypes = export_tensors(model)
    size_mb = sum(a.size * (2 if dtypes[n] == "BF16" else 4 if dtypes[n] == "F32" else 1)
                  for n, a in tensors.items()) / 1e6
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {config.layer_map}, {config.num_experts} experts top-{config.num_experts_per_token}, "
          f"{num_params / 1e6:.2f} M parameters, export {size_mb:.1f} MB")

    L = args.seq_len + 1
    rng = np.random.default_rng(args.seed)
    eval_windows, baselines = {}, {}
    for kind, ids in heldout.items():
        if len(ids) < L:
            raise SystemExit(f"error: the held-out {kind} split has {len(ids)} tokens, fewer than one window of {L}; "
                             "raise --code-bytes/--prose-bytes or lower --seq-len")
        eval_starts = np.linspace(0, len(ids) - L, args.eval_windows).astype(np.int64)
        eval_windows[kind] = torch.from_numpy(np.stack([ids[s:s + L] for s in eval_starts])).to(device)
        baselines[kind] = unigram_loss(train_ids, ids, config.vocab_size)
    print("held-out unigram baseline: " + ", ".join(f"{k} {v:.3f}" for k, v in baselines.items()) + " nats/token")

    def evaluate() -> dict[str, float]:
        return {kind: heldout_loss(model, windows, args.batch_size) for kind, windows in eval_windows.items()}

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    warmup = min(50, args.steps // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    log: list[dict] = []
    first = evaluate()
    log.append({"step": 0, "heldout_loss": first, "seconds": 0.0})
    print("step     0  held-out " + " ".join(f"{k} {v:.3f}" for k, v in first.items()))
    train_started = time.perf_counter()
    step = 0
    running = 0.0
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(train_ids) - L, size=args.batch_size)
        batch = torch.from_numpy(np.stack([train_ids[s:s + L] for s in starts])).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.update_router_bias(1e-3)
        running += loss.item()
        elapsed = time.perf_counter() - train_started
        done = step == args.steps or (args.seconds is not None and elapsed >= args.seconds)
        if step % args.eval_every == 0 or done:
            loads = torch.stack([m.last_load.float() for m in model.moe_layers()])  # [layers, NE]
            imbalance = float((loads.max(1).values / loads.mean(1)).mean())
            held = evaluate()
            train_loss = running / (step - (log[-1]["step"] if log else 0))
            running = 0.0
            log.append({"step": step, "train_loss": train_loss, "heldout_loss": held, "seconds": elapsed,
                        "max_over_mean_expert_load": imbalance})
            losses = " ".join(f"{k} {v:.3f}" for k, v in held.items())
            print(f"step {step:5d}  train {train_loss:.3f}  held-out {losses}  "
                  f"load max/mean {imbalance:.2f}  {elapsed / step:.2f} s/step", flush=True)
        if done:
            break

    model.to("cpu")
    export(model, config, out, tokenizer_dir=None)
    (out / "train_log.json").write_text(json.dumps({
        "args": vars(args), "unigram_baseline": baselines, "prose_source": corpus.prose_source, "steps": step,
        "device": str(device), "torch": torch.__version__,
        "seconds_per_step": (time.perf_counter() - train_started) / max(step, 1),
        "train_tokens": int(len(train_ids)), "heldout_tokens": {k: int(len(v)) for k, v in heldout.items()},
        "curve": log}, indent=2) + "\n")
    digest = sha256_files(out)
    print(f"exported {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB); SHA256SUMS digest {digest}; "
          f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
