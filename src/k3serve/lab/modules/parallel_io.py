"""8. Parallel I/O: mmap vs pread vs O_DIRECT, and the queue depth."""

from __future__ import annotations

import mmap
import time

import numpy as np

from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.timing import WARM_UP_MESSAGE, repeats_param
from k3serve.lab.streaming import WIDENINGS
from k3serve.lab.verdict import crossing, judge
from k3serve.stream.io import Extent, IOEngine
from k3serve.weights.store import PackedStore

DEPTHS = (1, 2, 4, 8, 16, 32)


def read_batch(store: PackedStore, mode: str, depth: int, keys: list[tuple[int, int]], cold: bool) -> float:
    """Seconds to read the experts `keys` [(layer, expert)] in one submission, page cache dropped first if `cold`."""
    engine = IOEngine(store.expert_path, mode=mode, queue_depth=depth)
    try:
        if cold:
            engine.drop_page_cache()
        buffers = [mmap.mmap(-1, store.expert_stride) for _ in keys]  # page-aligned, as O_DIRECT needs
        extents = [Extent(int(store.expert_offset(layer, e)), memoryview(b), tag=i)
                   for i, ((layer, e), b) in enumerate(zip(keys, buffers))]
        started = time.perf_counter()
        futures = engine.submit(extents)
        for future in set(futures.values()):
            future.result()
        seconds = time.perf_counter() - started
        for extent, buffer in zip(extents, buffers):
            extent.buffer.release()
            buffer.close()
        return seconds
    finally:
        engine.close()


def limits(lab) -> dict[str, tuple[int, int]]:
    config = lab.config  # widening keeps the experts' number
    return {"experts_per_batch": (1, len(config.moe_layer_ids) * config.num_experts)}


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.02, "preparing the widened store (first use only)")
    store = PackedStore(lab.packed("natural", *WIDENINGS[params["experts"]]))
    config = store.config
    rng = np.random.default_rng(params["seed"])
    everything = [(layer, e) for layer in config.moe_layer_ids for e in range(config.num_experts)]
    count = params["experts_per_batch"]
    if count > len(everything):  # NOTE: validate() with the lab refuses these already (`limits`)
        raise LabParamError("experts_per_batch", f"must be <= {len(everything)} (the store's experts), got {count}")
    cold = params["page_cache"] == "dropped"
    depths = [d for d in DEPTHS if d <= params["max_queue_depth"]]
    results: dict[str, list[float]] = {"pread": [], "direct": []}
    mmap_mbps: list[float] = []
    total = params["repeats"] * (1 + 2 * len(depths))
    done = 0
    megabytes = count * store.expert_blob_size / 2**20
    samples = {("mmap", 1): [], **{(m, d): [] for m in results for d in depths}}
    progress(0.03, WARM_UP_MESSAGE)
    for mode, depth in samples:  # untimed: each I/O path's first submission (thread pools, O_DIRECT buffers)
        cancel.check()
        read_batch(store, mode, depth, everything[:depth], cold)
    for repeat in range(params["repeats"]):  # alternated: every configuration once per repeat
        keys = [everything[i] for i in rng.choice(len(everything), count, replace=False)]
        for mode, depth in samples:
            cancel.check()
            progress(0.05 + 0.9 * done / total, f"{mode} queue depth {depth}, repeat {repeat + 1}")
            samples[(mode, depth)].append(megabytes / read_batch(store, mode, depth, keys, cold))
            done += 1
    median = {k: float(np.median(v)) for k, v in samples.items()}
    for mode in results:
        results[mode] = [median[(mode, d)] for d in depths]
    mmap_mbps = [median[("mmap", 1)]] * len(depths)
    best_direct = max(results["direct"])
    best_pread = max(results["pread"])
    source = (f"{count} random experts of {store.expert_blob_size / 1024:.0f} KiB from the {params['experts']} "
              f"widened store on this machine's disk, page cache {params['page_cache']}, median of "
              f"{params['repeats']}")
    figures = [Figure("Read throughput vs queue depth", "line", True, source,
                      [{"name": "pread (thread pool)", "x": depths, "y": results["pread"]},
                       {"name": "O_DIRECT (thread pool)", "x": depths, "y": results["direct"]},
                       {"name": "mmap copy (one thread, baseline)", "x": depths, "y": mmap_mbps}],
                      x_label="queue depth, reads in flight (reads)", y_label="read throughput (MiB/s)")]
    metrics = {"direct_best_mib_s": best_direct, "pread_best_mib_s": best_pread,
               "direct_qd1_mib_s": results["direct"][0], "best_queue_depth": float(depths[int(np.argmax(
                   results["direct"]))])}
    baseline = {"direct_best_mib_s": mmap_mbps[0], "pread_best_mib_s": mmap_mbps[0], "direct_qd1_mib_s": mmap_mbps[0],
                "best_queue_depth": 1.0}
    labels = {"direct_best_mib_s": "O_DIRECT, best depth (MiB/s)", "pread_best_mib_s": "pread, best depth (MiB/s)",
              "direct_qd1_mib_s": "O_DIRECT at depth 1 (MiB/s)", "best_queue_depth": "best O_DIRECT depth"}
    flip = crossing(depths, results["direct"], mmap_mbps, higher_is_better=True)
    if flip is not None:
        flips_when = f"the pool and the mmap copy meet at a queue depth of about {flip:.1f} (the depth sweep)"
    else:
        above = results["direct"][0] >= mmap_mbps[0]
        flips_when = (f"O_DIRECT {'beat' if above else 'trailed'} the mmap copy at every depth swept (1 to "
                      f"{depths[-1]}; {results['direct'][0] / max(mmap_mbps[0], 1e-9):.2f}x at depth 1, best at "
                      f"{metrics['best_queue_depth']:.0f} reads in flight)"
                      + ("; with the page cache warm (page_cache=warm) the mmap copy reads from memory instead"
                         if cold else ""))
    verdict = judge("O_DIRECT through a thread pool", "an mmap copy", "direct_best_mib_s", "read throughput",
                    best_direct, mmap_mbps[0], higher_is_better=True, words=("more", "less"), flips_when=flips_when)
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name="pread / O_DIRECT pool", verdict=verdict,
                     baseline_name="mmap copy",
                     notes=["page cache dropped with posix_fadvise(DONTNEED) before each batch: the file is re-read "
                            "from the device (a virtual disk here)" if cold else
                            "page cache warm: this measures system-call and copy cost, not the device"],
                     related_commands=["k3serve generate --prompt 'def f(x):' --ram-budget 32M --io direct "
                                       "--queue-depth 16"])


MODULE = LabModule(
    id="parallel_io", number=8, title="Parallel I/O: mmap vs pread vs O_DIRECT",
    summary="Read a batch of expert blobs with each I/O mode and queue depth; MiB/s on this machine's disk.",
    explanation=(
        "A decode step's expert misses are known at once (after the router), so they can all be in flight together. "
        "mmap faults pages in one at a time on the computing thread; pread and O_DIRECT through a pool of "
        "`queue depth` threads keep several reads outstanding, which an SSD needs to reach its bandwidth "
        "(throughput ~ depth x block / latency until the device saturates). O_DIRECT bypasses the page cache, so "
        "the RAM budget is really the budget; blobs are 4 KiB-aligned for it."),
    params=(Param("experts_per_batch", "int", 64, "expert blobs read per batch (at most the store's)", min=1,
                  max=4096),
            Param("max_queue_depth", "int", 16, "deepest queue tried", min=1, max=32),
            Param("page_cache", "choice", "dropped", "drop the file's page cache before each batch",
                  choices=("dropped", "warm")),
            Param("experts", "choice", "4x", "experts widened (exactly): bigger blobs", choices=tuple(WIDENINGS)),
            repeats_param(maximum=20),
            Param("seed", "int", 0, "which experts", min=0, max=2**31 - 1)),
    kind="measured", run=run, limits=limits)
