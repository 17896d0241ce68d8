"""The ladder of opt-in levers for the full K3 (docs/SIMULATOR.md, "Levers"): each lever alone and together,
simulated on the C engine's machine with v1.0.0 compute (`c-engine-v1`, one NVMe), decode at batch 1, beside the
published anchor figures, with a cost column at `--price-per-hour` (default $1, an assumption).

k3serve rows use the bf16 trunk, LFU and next-layer prefetch (the projections' settings), 2 decode steps after 1
warm-up step, seed 0. k3serve's minimum is 9.06 GiB, so its "8 GiB" rows run at 10 GiB; the C engine's policy
(its published split, no prefetch) runs at 8 GB. Top-p: the embedded model's kept counts at P = 0.7 (min 2) scaled
to 16 (11.3 of 16), or colibri's K3 figure, 8.1 of 16 at K3_TOPP=0.7. Speculation: acceptance 0.7 per draft,
drafter free. Prefill: a 512-token prompt in one step (chunk union) vs token at a time.

    PYTHONPATH=src .venv/bin/python benchmarks/sim_levers.py [--price-per-hour 1.0] [--json docs/sim/levers.json]
"""

from __future__ import annotations

import argparse
import json
import time

from k3serve.sim.full import SimConfig, simulate
from k3serve.sim.presets import c_engine_v1
from k3serve.sim.routing import MEASURED_KEPT, kept_from_histogram, kept_from_mean

GiB = 1 << 30
TOP_P_07 = kept_from_histogram(MEASURED_KEPT[0.7][1], MEASURED_KEPT[0.7][0], 16)
COLIBRI_08_1 = kept_from_mean(8.1, 16)

# (label, published s/token, source, the C engine's split to simulate it with: (GB, pinned layers, cache GB) from
# sim/calibrate.py's ladder, or None where the simulator cannot model the configuration)
ANCHORS = (
    ("kimi-k3-in-c README, 8 GB", 26.5, "its README ladder", (8, 0, 0.49)),
    ("kimi-k3-in-c README, 32 GB", 24.2, "its README ladder", (32, 11, 10.80)),
    ("kimi-k3-in-c README, 64 GB", 19.8, "its README ladder", (64, 27, 23.59)),
    ("kimi-k3-in-c README, >= 128 GB", 5.6, "its README ladder", (128, 93, 13.0)),
    ("colibri, O_DIRECT parallel reads, quantized trunk resident", 9.4, "its README", None),
    ("colibri, K3_TOPP=0.7 (~8.1 of 16 kept)", 3.0, "its README; perplexity 2.694 -> 2.811", None),
)


def levers(ram: int) -> list[tuple[str, dict]]:
    base = dict(ram_bytes=ram, trunk_dtype="bf16", prefetch="next-layer")  # the settings its figures were made with
    return [
        ("k3serve, no lever", base),
        ("+ top-p 0.7 (embedded model's kept share: 11.3 of 16)", {**base, "experts_kept": TOP_P_07}),
        ("+ top-p at colibri's K3 figure (8.1 of 16)", {**base, "experts_kept": COLIBRI_08_1}),
        ("+ speculation, fixed k = 3", {**base, "speculative": 3}),
        ("+ speculation, fixed k = 8", {**base, "speculative": 8}),
        ("+ I/O-aware speculation (k <= 8)", {**base, "speculative": 8, "speculative_io_aware": True}),
        ("+ top-p 8.1 of 16 + I/O-aware speculation", {**base, "experts_kept": COLIBRI_08_1, "speculative": 8,
                                                       "speculative_io_aware": True}),
    ]


def c_engine_rows() -> list[tuple[str, dict]]:
    split = dict(engine="c-engine", ram_bytes=8 * 10**9, pinned_layers=0, cache_bytes=490_000_000,
                 prefetch="none")
    resident = dict(engine="c-engine", ram_bytes=128 * 10**9, pinned_layers=93, cache_bytes=13 * 10**9,
                    prefetch="none")
    return [("C engine's policy, 8 GB", split),
            ("C engine's policy, 8 GB + top-p 8.1 of 16", {**split, "experts_kept": COLIBRI_08_1}),
            ("C engine's policy, 8 GB + top-p 8.1 + I/O-aware speculation (k <= 8)",
             {**split, "experts_kept": COLIBRI_08_1, "speculative": 8, "speculative_io_aware": True}),
            ("C engine's policy, 128 GB, trunk resident", resident),
            ("C engine's policy, 128 GB, trunk resident + top-p 8.1 of 16",
             {**resident, "experts_kept": COLIBRI_08_1}),
            ("C engine's policy, 128 GB, trunk resident + top-p 8.1 + I/O-aware speculation (k <= 8)",
             {**resident, "experts_kept": COLIBRI_08_1, "speculative": 8, "speculative_io_aware": True})]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--price-per-hour", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    machine = c_engine_v1()
    price = args.price_per_hour
    rows = []
    for label, published, source, split in ANCHORS:
        row = {"group": "anchor", "label": label, "s_per_token": published, "source": source,
               "dollars_per_million_tokens": published * price / 3600 * 1e6}
        if split is not None:
            gb, pinned, cache_gb = split
            r = simulate(SimConfig(machine=machine, engine="c-engine", ram_bytes=gb * 10**9, pinned_layers=pinned,
                                   cache_bytes=int(cache_gb * 1e9), prefetch="none", tokens=2, warmup=1,
                                   price_per_hour=price))
            row.update(simulated_s_per_token=r.s_per_token, simulated_gb_per_token=r.bytes_per_token / 1e9)
            print(f"anchor {label:<40} published {published:5.1f} s/token, simulated {r.s_per_token:6.2f} "
                  f"({row['simulated_gb_per_token']:.1f} GB/token)", flush=True)
        rows.append(row)
    plans = [("10 GiB", label, cfg) for label, cfg in levers(10 * GiB)] + \
            [("64 GiB", label, cfg) for label, cfg in levers(64 * GiB)] + \
            [("128 GB" if "128 GB" in label else "8 GB", label, cfg) for label, cfg in c_engine_rows()]
    for ram, label, cfg in plans:
        started = time.perf_counter()
        r = simulate(SimConfig(machine=machine, tokens=2, warmup=1, price_per_hour=price, **cfg))
        row = {"group": ram, "label": label, "s_per_token": r.s_per_token, "gb_per_token": r.bytes_per_token / 1e9,
               "expert_gb_per_token": r.expert_bytes_per_token / 1e9, "experts_kept": r.experts_kept_per_token,
               "dollars_per_million_tokens": r.dollars_per_million_tokens, "speculation": r.speculation}
        rows.append(row)
        print(f"{ram:>7} {label:<60} {r.s_per_token:7.2f} s/token {row['gb_per_token']:6.1f} GB/token "
              f"${row['dollars_per_million_tokens']:,.0f}/M ({time.perf_counter() - started:.0f} s)", flush=True)
    for chunk in (None, 1):
        cfg = dict(engine="c-engine", ram_bytes=8 * 10**9, pinned_layers=0, cache_bytes=490_000_000, prefetch="none",
                   prompt_tokens=512, prefill_chunk=chunk, tokens=1, warmup=0)
        r = simulate(SimConfig(machine=machine, price_per_hour=price, **cfg))
        p = r.prefill
        rows.append({"group": "prefill 8 GB", "label": "512-token prompt, " + ("one chunk (union)" if chunk is None
                                                                                else "token at a time"),
                     "s_per_token": p["s_per_token"], "expert_gb_per_token": p["expert_bytes_per_token"] / 1e9,
                     "gb_per_token": (p["expert_bytes"] + p["trunk_bytes"]) / p["tokens"] / 1e9,
                     "dollars_per_million_tokens": p["s_per_token"] * price / 3600 * 1e6})
        print(f"prefill chunk {chunk}: experts {p['expert_bytes_per_token'] / 1e9:.2f} GB/token, "
              f"{p['s_per_token']:.3f} s/token", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.name, "price_per_hour": price, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
