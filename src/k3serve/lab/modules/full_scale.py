"""16. Full-scale projection: the full K3 (2.78T parameters) under a RAM budget, through k3serve's streaming code
on a machine model (the simulator of k3serve.sim.full), against the C engine's published split.

The RAM ladder (2..128 GiB) has one series for k3serve lossless (bf16 trunk, every routed expert, one drive, no
speculation) and, when any lever of issue 34 is switched on, one with the chosen levers: trunk precision (q8_0,
mxfp4), expert top-p (or a mean number of experts kept), drives striped, I/O-aware speculation. Beside them: the
C engine's published split simulated on the same machine model, and the engines' own published figures
(ANCHORS.md: the kimi-k3-in-c README on the ladder, colibri in the notes), which are not simulated. The cost column prices a token on the C
engine's machine, a laptop and a cluster of laptops at one price per box-hour:

    $ per million tokens = s/token x boxes x price per hour / 3600 x 1e6
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from k3serve.config import full_k3_config
from k3serve.errors import K3Error
from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.verdict import crossing, judge, sentence_case
from k3serve.sim.calibrate import LADDER, c_engine_run
from k3serve.sim.cluster import ClusterConfig, simulate_cluster
from k3serve.sim.full import DEFAULT_PRICE_PER_HOUR, SimConfig, SimResult, simulate
from k3serve.sim.presets import PRESETS, resolve_machine, resolve_network
from k3serve.sim.routing import MEASURED_KEPT, kept_from_histogram, kept_from_mean
from k3serve.stream.budget import BudgetError

GIB = 2**30
RUNGS_GB = (2, 8, 16, 32, 64, 128)
HEADLINE_GB = (8, 64)  # the overview's figures: the C engine's smallest published run and a workstation
TOP_PS = ("1.0", "0.9", "0.8", "0.7")
DRAFT_CAP = 4  # I/O-aware speculation chooses k <= this many drafts per step
CLUSTER_NODES, CLUSTER_NODE_GIB, CLUSTER_NETWORK = 8, 8, "25gbe"  # the cost column's cluster: laptops, expert parallel

# Published full-K3 figures (/work/shared/ANCHORS.md, "Full K3 engines"): each engine on its own machine, not
# simulated here. The README's ladder is in GB; its last rung is "128 GB or more".
C_ENGINE_README = ((8, 26.5), (32, 24.2), (64, 19.8), (128, 5.6))
COLIBRI = (("colibri, all 16 experts (trunk quantized, resident)", 9.4),
           ("colibri, K3_TOPP=0.7 (~8.1 of 16 experts)", 3.0))

# What the lossy levers cost in quality, from docs/STREAMING.md's tables (held-out loss deltas in nats per token on
# the embedded 6.9M-parameter model: code, prose); colibri's perplexity is the only full-K3 figure
TRUNK_QUALITY = {"q8_0": "held-out loss -0.003 code / -0.003 prose, logit rel. RMS 0.024 vs bf16",
                 "mxfp4": "held-out loss +0.057 code / +0.041 prose, logit rel. RMS 0.131 vs bf16"}
TOP_P_QUALITY = {"0.9": "held-out loss -0.0004 code / +0.0029 prose", "0.8": "held-out loss +0.0001 code / +0.0082 "
                 "prose, copying 59.8% -> 43.9%", "0.7": "held-out loss +0.0208 code / +0.0138 prose, copying 59.8% -> "
                 "50.4%"}
COLIBRI_QUALITY = "colibri on the full K3 at ~8.1 of 16 kept: perplexity 2.694 -> 2.811 (+0.042 nats)"
QUALITY_CAVEAT = ("a 6.9M-parameter model's loss delta bounds nothing for the 2.78T model (docs/STREAMING.md): "
                  "what carries over is the bytes, not the quality figure")


@dataclass(frozen=True)
class Levers:
    """Issue 34's levers on the bytes a token reads; `Levers()` is k3serve lossless, the default."""

    trunk_dtype: str = "bf16"
    expert_top_p: str = "1.0"
    experts_kept: float = 16.0  # a mean of the 16 (colibri's K3_TOPP=0.7: 8.1); 16: all
    drives: int = 1
    speculative_io_aware: bool = False
    acceptance: float = 0.7

    @property
    def lossless(self) -> bool:
        return self.trunk_dtype in ("bf16", "float32") and self.expert_top_p == "1.0" and self.experts_kept >= 16

    def kept(self) -> tuple[float, ...]:
        """P(n experts kept), n = 1..16, as `k3serve sim k3 --expert-top-p / --experts-kept` gives it (() : all)."""
        top_k = full_k3_config().num_experts_per_token
        if self.experts_kept < top_k:
            return kept_from_mean(self.experts_kept, top_k)
        if self.expert_top_p != "1.0":
            measured_top_k, histogram = MEASURED_KEPT[float(self.expert_top_p)]
            return kept_from_histogram(histogram, measured_top_k, top_k)
        return ()

    def sim_kwargs(self) -> dict:
        spec = {"speculative": DRAFT_CAP, "speculative_io_aware": True, "acceptance": self.acceptance} \
            if self.speculative_io_aware else {}
        return {"trunk_dtype": self.trunk_dtype, "experts_kept": self.kept(), "drives": self.drives, **spec}

    def describe(self) -> str:
        parts = [f"trunk {self.trunk_dtype}"]
        if self.experts_kept < 16:
            parts.append(f"{self.experts_kept:g} of 16 experts kept")
        elif self.expert_top_p != "1.0":
            parts.append(f"expert top-p {self.expert_top_p}")
        if self.drives > 1:
            parts.append(f"{self.drives} drives")
        if self.speculative_io_aware:
            parts.append(f"I/O-aware speculation (k <= {DRAFT_CAP}, acceptance {self.acceptance:g})")
        return ", ".join(parts)

    def cli_flags(self) -> str:
        flags = [f"--trunk-dtype {self.trunk_dtype}"]
        if self.experts_kept < 16:
            flags.append(f"--experts-kept {self.experts_kept:g}")
        elif self.expert_top_p != "1.0":
            flags.append(f"--expert-top-p {self.expert_top_p}")
        if self.drives > 1:
            flags.append(f"--drives {self.drives}")
        if self.speculative_io_aware:
            flags.append(f"--speculative {DRAFT_CAP} --speculative-io-aware --acceptance {self.acceptance:g}")
        return " ".join(flags)


LOSSLESS = Levers()


def levers_of(params) -> Levers:
    return Levers(params["trunk_dtype"], params["expert_top_p"], params["experts_kept"], params["drives"],
                  params["speculative_io_aware"], params["acceptance"])


def _c_engine_rung(ram_gb: float):
    """The C engine's published split (label, total GB, pinned layers, cache GB) at the largest rung <= ram_gb;
    None below its smallest published run (8 GB)."""
    fitting = [r for r in LADDER if r[1] <= ram_gb]
    return fitting[-1] if fitting else None


def _figures(result) -> dict[str, float]:
    return {"s_per_token": result.s_per_token, "bytes_per_token": result.bytes_per_token,
            "expert_bytes_per_token": result.expert_bytes_per_token, "io_wait_s": result.io_seconds_per_token,
            "compute_s": result.compute_seconds_per_token, "retention_pct": 100 * result.retention,
            "prefetch_served_pct": 100 * result.prefetch_hit_share,
            "dollars_per_million_tokens": result.dollars_per_million_tokens}


class Projection:
    """The simulations of one run, each made once: k3serve at a RAM budget with given levers on a machine, and the
    C engine's published split (its own machine model, or the module's)."""

    def __init__(self, params) -> None:
        self.params = params
        self._k3: dict = {}
        self._c: dict = {}
        self.refused = ""  # the budget splitter's last refusal

    def k3serve(self, ram_gb: float, levers: Levers, machine: str | None = None) -> SimResult | None:
        """None: k3serve does not fit this budget (the budget splitter refuses it)."""
        p = self.params
        key = (ram_gb, levers, machine or p["machine"])
        if key not in self._k3:
            try:
                self._k3[key] = simulate(SimConfig(
                    machine=resolve_machine(key[2]), ram_bytes=int(ram_gb * GIB), policy=p["policy"],
                    prefetch=p["prefetch"], batch=p["batch"], tokens=p["tokens"], seed=0,
                    price_per_hour=p["price_per_hour"], **levers.sim_kwargs()))
            except BudgetError as exc:
                self._k3[key] = None
                self.refused = str(exc)
        return self._k3[key]

    def c_engine(self, rung, machine: str | None = None) -> SimResult:
        key = (rung[1], machine or self.params["machine"])
        if key not in self._c:
            result = c_engine_run(resolve_machine(key[1]), rung[1], rung[2], rung[3], routing="skewed", steady=True)
            self._c[key] = dataclasses.replace(
                result, dollars_per_million_tokens=result.s_per_token * self.params["price_per_hour"] / 3600 * 1e6)
        return self._c[key]

    def cluster(self, ram_gb: float, levers: Levers) -> float | None:
        """s/token of an expert-parallel cluster: a laptop front at ram_gb (trunk, globals) and CLUSTER_NODES laptop
        owners of CLUSTER_NODE_GIB each, over CLUSTER_NETWORK; None where it does not fit. One step after one of
        warm-up: the owners' LRU caches hold no reuse to speak of at 8 GiB (sim cluster's 12 warm-up steps give
        the same s/token within 0.1%)."""
        p = self.params
        kwargs = levers.sim_kwargs()
        kwargs.pop("speculative", None), kwargs.pop("speculative_io_aware", None), kwargs.pop("acceptance", None)
        try:
            front = SimConfig(machine=resolve_machine("laptop"), ram_bytes=int(ram_gb * GIB), prefetch="none",
                              batch=p["batch"], tokens=1, warmup=1, seed=0, **kwargs)
            return simulate_cluster(ClusterConfig(front=front, num_nodes=CLUSTER_NODES,
                                                  node_ram_bytes=CLUSTER_NODE_GIB * GIB,
                                                  network=resolve_network(CLUSTER_NETWORK))).s_per_token
        except (BudgetError, K3Error):
            return None


def _dollars(s_per_token: float | None, boxes: int, price_per_hour: float) -> float | None:
    return None if s_per_token is None else s_per_token * boxes * price_per_hour / 3600 * 1e6


def _quality_notes(levers: Levers) -> list[str]:
    notes = []
    if levers.trunk_dtype in TRUNK_QUALITY:
        notes.append(f"quality of trunk {levers.trunk_dtype} (docs/STREAMING.md, embedded model): "
                     f"{TRUNK_QUALITY[levers.trunk_dtype]}; {QUALITY_CAVEAT}")
    if levers.experts_kept < 16 or levers.expert_top_p != "1.0":
        measured = TOP_P_QUALITY.get(levers.expert_top_p) if levers.experts_kept >= 16 else None
        notes.append("quality of fewer experts (docs/STREAMING.md): "
                     + (f"top-p {levers.expert_top_p} on the embedded model: {measured}; " if measured else "")
                     + f"{COLIBRI_QUALITY}; {QUALITY_CAVEAT}")
    return notes


def run(params, progress, cancel, lab) -> LabResult:
    sim = Projection(params)
    chosen_levers = levers_of(params)
    with_levers = chosen_levers != LOSSLESS
    price = params["price_per_hour"]
    ram = params["ram_gb"]
    notes = []

    progress(0.05, f"k3serve at {ram:g} GiB")
    chosen = sim.k3serve(ram, chosen_levers)
    if chosen is None:
        notes.append(f"k3serve does not run at {ram:g} GiB ({chosen_levers.describe()}): {sim.refused}")
    rung = _c_engine_rung(ram * GIB / 1e9)  # its ladder is in GB
    below_smallest = rung is None
    rung = rung or LADDER[0]
    cancel.check()
    progress(0.1, f"the C engine's published split at {rung[1]} GB")
    baseline = sim.c_engine(rung)

    series = {"lossless": [], "levers": [], "c": []}
    rungs = RUNGS_GB if params["ladder"] else ()
    for i, gb in enumerate(rungs):
        cancel.check()
        progress(0.15 + 0.6 * i / len(rungs), f"the memory ladder: {gb} GiB")
        lossless = sim.k3serve(gb, LOSSLESS)
        series["lossless"].append(None if lossless is None else lossless.s_per_token)  # None: does not fit
        if with_levers:
            levered = sim.k3serve(gb, chosen_levers)
            series["levers"].append(None if levered is None else levered.s_per_token)
        c = _c_engine_rung(gb * GIB / 1e9)
        series["c"].append(None if c is None else sim.c_engine(c).s_per_token)  # no published split below 8 GB
    ours = series["levers"] if with_levers else series["lossless"]

    source = (f"simulated: the full K3 ({full_k3_config().num_parameters()['total'] / 1e12:.2f}T parameters) through "
              f"k3serve's budget splitter, ExpertCache and I/O coalescing on the '{params['machine']}' machine model, "
              f"synthetic skewed routing, {params['tokens']} decode steps; the published figures are the engines' own "
              f"on their own machines (not simulated)")
    xs = list(rungs)
    traces = [{"name": f"k3serve lossless (trunk bf16, all experts, 1 drive; {params['policy']}, prefetch "
                       f"{params['prefetch']}; a gap: does not fit)", "x": xs, "y": series["lossless"]}]
    if with_levers:
        traces.append({"name": f"k3serve with the levers ({chosen_levers.describe()})", "x": xs,
                       "y": series["levers"]})
    traces += [{"name": "C engine, its published split simulated (LRU, no prefetch; none below 8 GB)", "x": xs,
                "y": series["c"]},
               {"name": "kimi-k3-in-c README, published on its machine (not simulated; GB)",
                "x": [gb for gb, _ in C_ENGINE_README], "y": [s for _, s in C_ENGINE_README]}]
    figures = []
    if rungs:
        figures.append(Figure("Seconds per token vs RAM", "line", False, source, traces,
                              x_label="RAM budget (GiB)", y_label="time per token (s/token)",
                              highlight=traces[1]["name"] if with_levers else traces[0]["name"]))
    if chosen is not None:
        figures.append(Figure(f"Where a token's time goes at {ram:g} GiB", "bar", False, source,
                              [{"name": name, "x": ["I/O wait", "compute", "I/O floor", "compute floor"],
                                "y": [r.io_seconds_per_token, r.compute_seconds_per_token, r.floor_io_s_per_token,
                                      r.floor_compute_s_per_token]}
                               for name, r in (("k3serve", chosen), ("C engine", baseline))],
                              y_label="time per token (s/token)"))
        notes.append(f"plan: {chosen.plan['summary']}")
        if chosen.speculation:
            notes.append(f"I/O-aware speculation chose k = {chosen.speculation['chosen_k']} drafts "
                         f"({chosen.speculation['tokens_per_step']:.2f} tokens per step at acceptance "
                         f"{chosen_levers.acceptance:g})")

    cost_rows = []
    if params["costs"]:
        cancel.check()
        progress(0.8, "the cost column")
        cost_rows = _cost_rows(sim, ram, chosen_levers, with_levers, price)
        names = ["k3serve lossless"] + (["k3serve with the levers"] if with_levers else [])
        figures.append(Figure(f"Cost per million tokens at ${price:g} per box-hour, {ram:g} GiB", "bar", False,
                              source, [{"name": name, "x": [row[0] for row in cost_rows],
                                        "y": [row[1 + i] for row in cost_rows]} for i, name in enumerate(names)],
                              y_label="cost per million tokens ($/Mtok)"))
    if below_smallest:
        notes.append(f"the C engine published no run below 8 GB (its 8 GB run peaked at 8.24 GB RSS): the baseline "
                     f"at {ram:g} GiB is its 8 GB split")
    notes.append(f"C engine baseline: {rung[0]} (pinned {rung[2]} layers, {rung[3]} GB cache), published "
                 f"{rung[4]} s/token on its own machine")
    # NOTE: colibri states no RAM budget for its figures, so they stand here, not at a rung of the ladder
    notes.append("published, not simulated: kimi-k3-in-c README " + ", ".join(f"{s} s/token at {gb} GB" for gb, s in
                 C_ENGINE_README) + " (the last: 128 GB or more); " + "; ".join(f"{name}: {s} s/token" for
                 name, s in COLIBRI))
    notes += _quality_notes(chosen_levers)
    if params["costs"]:
        notes.append(f"cost: s/token x boxes x ${price:g} per box-hour (an assumed round price, "
                     f"DEFAULT_PRICE_PER_HOUR in sim/full.py) / 3600 x 1e6; the cluster is {CLUSTER_NODES} laptop "
                     f"expert owners of {CLUSTER_NODE_GIB} GiB and a laptop front at {ram:g} GiB over "
                     f"{CLUSTER_NETWORK} ({CLUSTER_NODES + 1} boxes; no speculation, no prefetch on the front); "
                     "a missing bar: does not fit")

    nan = {k: math.nan for k in _figures(baseline)}
    metrics = _figures(chosen) if chosen is not None else dict(nan)
    base = _figures(baseline)
    for gb in HEADLINE_GB if params["ladder"] else ():  # the headline cards: k3serve lossless
        s = series["lossless"][RUNGS_GB.index(gb)]
        metrics[f"s_per_token_at_{gb}_gib"] = math.nan if s is None else s
        base[f"s_per_token_at_{gb}_gib"] = series["c"][RUNGS_GB.index(gb)]
    verdict = _verdict(params, chosen_levers, with_levers, ours, series["c"], metrics, base, rung, chosen is None)
    labels = {"s_per_token": "seconds per token", "bytes_per_token": "bytes read per token",
              "expert_bytes_per_token": "expert bytes read per token", "io_wait_s": "I/O wait per token (s)",
              "compute_s": "compute per token (s)", "retention_pct": "experts resident before their step (%)",
              "prefetch_served_pct": "expert requests served by a prefetch (%)",
              "dollars_per_million_tokens": f"$ per million tokens at ${price:g} per machine-hour"}
    labels.update({f"s_per_token_at_{gb}_gib": f"seconds per token at {gb} GiB, k3serve lossless (n/a: does not fit)"
                   for gb in HEADLINE_GB})
    progress(1.0, "done")
    name = f"k3serve at {ram:g} GiB" + (f" ({chosen_levers.describe()})" if with_levers else " (lossless)")
    return LabResult(metrics, base, figures, labels, verdict=verdict, metrics_name=f"{name} (simulated)",
                     baseline_name=f"C engine, published {rung[1]} GB split (simulated)", notes=notes,
                     related_commands=[f"k3serve sim k3 --ram {ram:g}G --machine {params['machine']} "
                                       f"{chosen_levers.cli_flags()} --policy {params['policy']} --prefetch "
                                       f"{params['prefetch']} --price-per-hour {price:g}", "k3serve sim calibrate"])


def _cost_rows(sim: Projection, ram: float, levers: Levers, with_levers: bool, price: float) -> list[list]:
    """[category, $/Mtok lossless, $/Mtok with the levers (if any)]: k3serve on the C engine's machine, on a laptop,
    on a cluster of laptops, and the C engine's own split on its machine."""
    variants = [LOSSLESS] + ([levers] if with_levers else [])
    rows = []
    for machine, label in (("c-engine", "k3serve, C engine's machine"), ("laptop", "k3serve, laptop")):
        rows.append([label] + [_dollars(None if (r := sim.k3serve(ram, v, machine)) is None else r.s_per_token, 1,
                                        price) for v in variants])
    rows.append([f"k3serve, cluster of {CLUSTER_NODES + 1} laptops"]
                + [_dollars(sim.cluster(ram, v), CLUSTER_NODES + 1, price) for v in variants])
    rung = _c_engine_rung(ram * GIB / 1e9) or LADDER[0]
    c = sim.c_engine(rung, "c-engine").dollars_per_million_tokens
    rows.append([f"C engine, its {rung[1]} GB split, its machine"] + [c for _ in variants])
    return rows


def _verdict(params, levers: Levers, with_levers: bool, ours: list, theirs: list, metrics: dict, base: dict, rung,
             refused: bool):
    ram = params["ram_gb"]
    who = "k3serve" + (f" with {levers.describe()}" if with_levers else " lossless")
    if params["ladder"]:
        flip = crossing(list(RUNGS_GB), ours, theirs, higher_is_better=False)
        fits = [gb for gb, s, c in zip(RUNGS_GB, ours, theirs) if s is not None and c is not None]
        if flip is not None:
            flips_when = f"{who} and the C engine's split meet at about {flip:.0f} GiB on the RAM ladder"
        elif not fits:
            flips_when = (f"{who} fits at no rung of the ladder where the C engine has a split ({RUNGS_GB[0]} to "
                          f"{RUNGS_GB[-1]} GiB)")
        else:
            ahead = all(k <= c for k, c in zip(ours, theirs) if k is not None and c is not None)
            smallest = next(gb for gb, s in zip(RUNGS_GB, ours) if s is not None)
            flips_when = (f"{who} is {'ahead' if ahead else 'behind'} at every rung where both run ({fits[0]} to "
                          f"{fits[-1]} GiB; k3serve's smallest rung {smallest} GiB), so the ladder shows no flip")
    else:
        flips_when = "the RAM ladder is off (ladder=false), so there is no sweep to say where it flips"
    mechanism = f"k3serve at {ram:g} GiB" + (f" ({levers.describe()})" if with_levers else "")
    verdict = judge(mechanism, f"the C engine's published {rung[1]} GB split", "s_per_token",
                    "time per token", metrics["s_per_token"], base["s_per_token"], higher_is_better=False,
                    flips_when=flips_when)
    if refused:  # it does not run: that is a loss, not a missing figure
        verdict = dataclasses.replace(verdict, outcome="lost", sentence=f"{who} lost here: it does not fit "
                                      f"{ram:g} GiB, where the C engine's split takes {base['s_per_token']:.1f} s per "
                                      f"token. {sentence_case(flips_when)}.")
    return verdict


def check(values) -> None:
    if values["experts_kept"] < 16 and values["expert_top_p"] != "1.0":
        raise LabParamError("experts_kept", "give expert_top_p or experts_kept, not both (as --expert-top-p and "
                                            "--experts-kept)")


MODULE = LabModule(
    id="full_scale", number=16, title="Full-scale projection: K3 at 2.78T",
    summary="The full K3 under a RAM budget on a machine model, through k3serve's own streaming code, with issue 34's "
            "levers as switches.",
    explanation=(
        "The full K3 is 1.56 TB; no machine here holds it, so this module runs k3serve's real budget splitter, "
        "expert cache, prefetch and I/O coalescing over a virtual store with the full model's exact blob sizes, "
        "with each read timed by the machine's disk curve t(bytes, queue depth) and each matmul by max(bytes / "
        "memory bandwidth, FLOPs / FLOP rate), on a discrete-event clock (k3serve.sim.full). s/token = max over "
        "the critical path of I/O and compute; the floors are the bytes that must move at the device's best "
        "bandwidth and the FLOPs at the machine's rate. The baseline is the C engine's published RAM split on "
        "the same machine model (the simulator is calibrated against its published figures: k3serve sim "
        "calibrate). The levers cut the bytes a token reads: a q8_0 or mxfp4 trunk (34 or 17 bytes per 32 "
        "weights against bf16's 64), fewer experts by top-p, the store striped over several drives, and I/O-aware "
        "speculation (k drafts chosen from the measured bytes per window position). bf16 and float32 are "
        "lossless; the others cost quality, which the notes quote from docs/STREAMING.md. Cost per million "
        "tokens = s/token x boxes x price per box-hour / 3600 x 1e6."),
    params=(Param("ram_gb", "float", 32.0, "RAM budget for weights", min=1.0, max=4096.0, unit="GiB"),
            Param("machine", "choice", "laptop", "machine model", choices=tuple(sorted(PRESETS))),
            Param("trunk_dtype", "choice", "bf16", "trunk precision (bf16: lossless, as stored; float32: widened in "
                  "RAM; q8_0 / mxfp4: a store packed with --trunk-precision, lossy)",
                  choices=("bf16", "float32", "q8_0", "mxfp4")),
            Param("expert_top_p", "choice", "1.0", "keep experts as --expert-top-p P kept them (1.0: all 16; lossy "
                  "below)", choices=TOP_PS),
            Param("experts_kept", "float", 16.0, "or a mean number of the 16 experts kept (colibri's K3_TOPP=0.7: "
                  "8.1; 16: all)", min=1.0, max=16.0, unit="experts"),
            Param("drives", "int", 1, "drives the store is striped over (pack --stripe)", min=1, max=16),
            Param("speculative_io_aware", "bool", False, f"I/O-aware speculation: k <= {DRAFT_CAP} drafts chosen "
                  "from the measured bytes per window position"),
            Param("acceptance", "float", 0.7, "per-draft acceptance, when speculating", min=0.0, max=0.99),
            Param("price_per_hour", "float", DEFAULT_PRICE_PER_HOUR, "price per box-hour for the cost column",
                  min=0.0, max=1000.0, unit="$"),
            Param("costs", "bool", True, "the cost column: the C engine's machine, a laptop, a cluster"),
            Param("policy", "choice", "lfu", "expert cache policy", choices=("lru", "lfu", "s3fifo", "none")),
            Param("prefetch", "choice", "none", "next-layer router prefetch (none: the engine's default)",
                  choices=("none", "next-layer")),
            Param("batch", "int", 1, "sequences decoded together", min=1, max=64),
            Param("tokens", "int", 3, "decode steps simulated", min=1, max=32),
            Param("ladder", "bool", True, f"also simulate the RAM ladder {', '.join(map(str, RUNGS_GB))} GiB")),
    kind="simulated", run=run, check=check)
