"""12. Speculative decoding: a drafter proposes, one forward verifies; acceptance and speed-up."""

from __future__ import annotations

import statistics

import numpy as np

from k3serve.engine.generate import generate
from k3serve.lab.replay_drafter import ReplayDrafter, ReplayFactory
from k3serve.engine.sampling import SamplingParams
from k3serve.engine.speculative import DEFAULT_DRAFT_TOKENS, SpeculativeConfig
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.timing import WARM_UP_MESSAGE, repeats_param
from k3serve.lab.verdict import judge


def grounded_prompt(lab, excerpt_tokens: int) -> list[int]:
    """A held-out code excerpt, then its first tokens again: a continuation that quotes the context (what n-gram
    drafting needs), as when a user asks for the same code with a change."""
    window = lab.windows(1, excerpt_tokens + 1, skip=6, kind="code")[0]
    return window + window[1:1 + min(8, excerpt_tokens)]


def tokens_per_window(acceptance: float, drafts: float) -> float:
    """Tokens a verify window yields when each of `drafts` drafts is accepted with probability `acceptance` (up to
    the first rejection, plus the target's own token): (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1.0)) / (1.0 - acceptance)


def break_even_acceptance(window_cost: float, drafts: float) -> float | None:
    """The acceptance at which a window's tokens pay for its cost (`window_cost` plain decode steps): solves
    tokens_per_window(a, k) = window_cost by bisection (it rises from 1 at a = 0 to k + 1 at a = 1). 0.0 when even
    a rejected window pays; None when no acceptance does."""
    if window_cost <= 1.0:
        return 0.0
    if window_cost >= drafts + 1.0:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_window(middle, drafts) < window_cost else (low, middle)
    return (low + high) / 2


def verdict(stats, plain_s: list[float], spec_s: list[float], tokens: int, rate: float, plain_rate: float):
    windows = max(stats.windows, 1)
    plain_step = statistics.median(plain_s) / max(tokens - 1, 1)
    window_cost = statistics.median(spec_s) / windows / plain_step  # in plain steps, drafting included
    drafts = stats.drafted / windows
    flip = break_even_acceptance(window_cost, drafts)
    if flip is None:
        flips_when = (f"a window costs {window_cost:.2f} plain steps here, more than its {drafts:.1f} drafts can "
                      "return at any acceptance")
    elif flip == 0.0:
        flips_when = f"a window costs no more than a plain step here ({window_cost:.2f}x), so it pays at any acceptance"
    else:
        ahead = rate >= plain_rate
        flips_when = (f"it would {'lose' if ahead else 'win'} {'below' if ahead else 'above'} "
                      f"{flip:.0%} acceptance (now {stats.acceptance_rate:.0%}): a window of {drafts:.1f} drafts costs "
                      f"{window_cost:.2f} plain steps here and yields (1 - a^(k+1)) / (1 - a) tokens")
    return judge("Speculative decoding", "plain greedy", "tok_per_s", "decoding", rate, plain_rate,
                 higher_is_better=True, words=("faster", "slower"), flips_when=flips_when)


def run(params, progress, cancel, lab) -> LabResult:
    loaded = lab.loaded()
    model = loaded.model
    prompt = grounded_prompt(lab, params["excerpt_tokens"]) if params["prompt"] == "grounded" else \
        lab.windows(1, params["excerpt_tokens"], skip=9, kind="prose")[0]
    sampling = SamplingParams(max_tokens=params["tokens"], ignore_eos=True)
    spec = SpeculativeConfig(drafter="ngram" if params["drafter"] == "replay" else params["drafter"],
                             num_draft_tokens=params["num_draft_tokens"], adaptive=params["adaptive"],
                             rollback=params["rollback"])
    factory = None
    if params["drafter"] == "replay":
        progress(0.05, "the plain greedy continuation, for the replay drafter")
        target = model.greedy(prompt, params["tokens"])
        factory = ReplayFactory(model, ReplayDrafter(len(prompt), target, params["replay_miss"],
                                                     model.config.vocab_size))
    cancel.check()
    progress(0.07, WARM_UP_MESSAGE)  # the verify forward and the rollback compile their own kernels on first use
    generate(model, prompt, sampling)
    if factory is not None:
        factory.drafter.rng = np.random.default_rng(0)
    generate(model, prompt, sampling, speculative=spec, drafters=factory)
    plain_s, spec_s, stats, same = [], [], None, True
    for r in range(params["repeats"]):  # alternated: plain, speculative, plain, ...
        cancel.check()
        progress(0.1 + 0.85 * r / params["repeats"], f"repeat {r + 1}: plain")
        plain, plain_report = generate(model, prompt, sampling)
        plain_s.append(plain_report.decode_seconds)
        cancel.check()
        progress(0.1 + 0.85 * (r + 0.5) / params["repeats"], f"repeat {r + 1}: speculative")
        if factory is not None:
            factory.drafter.rng = np.random.default_rng(r)  # the same corruptions every repeat
        drafted, report = generate(model, prompt, sampling, speculative=spec, drafters=factory)
        spec_s.append(report.decode_seconds)
        stats = report.speculation
        same = same and drafted == plain
    tokens = params["tokens"]
    # decode only: the first token comes out of the prefill, which speculation does not change
    plain_rate, spec_rate = (tokens - 1) / statistics.median(plain_s), (tokens - 1) / statistics.median(spec_s)
    metrics = {"tok_per_s": spec_rate, "acceptance_pct": 100 * stats.acceptance_rate,
               "tokens_per_forward": stats.emitted / max(stats.windows, 1), "forwards": float(stats.windows),
               "speedup": spec_rate / plain_rate}
    baseline = {"tok_per_s": plain_rate, "acceptance_pct": float("nan"), "tokens_per_forward": 1.0,
                "forwards": float(tokens), "speedup": 1.0}
    source = (f"{lab.model_name}, {params['prompt']} prompt of {len(prompt)} tokens, {tokens} greedy tokens, "
              f"median of {params['repeats']} alternated repeats on this machine")
    figures = [
        Figure("Decode speed", "bar", True, source,
               [{"name": "tok/s", "x": ["plain greedy", f"speculative ({params['drafter']})"],
                 "y": [plain_rate, spec_rate]}], y_label="decode speed (tok/s)"),
        Figure("Decode speed, repeat by repeat (after an untimed warm-up pass)", "line", True, source,
               [{"name": "plain greedy", "x": list(range(1, params["repeats"] + 1)),
                 "y": [(tokens - 1) / s for s in plain_s]},
                {"name": f"speculative ({params['drafter']})", "x": list(range(1, params["repeats"] + 1)),
                 "y": [(tokens - 1) / s for s in spec_s]}], x_label="repeat (index)", y_label="decode speed (tok/s)"),
        Figure("Drafts and verify windows", "bar", True, source,
               [{"name": "count", "x": ["drafted", "accepted", "verify forwards", "plain forwards"],
                 "y": [stats.drafted, stats.accepted, stats.windows, tokens]}], y_label="how many (count)"),
    ]
    labels = {"tok_per_s": "decode tokens per second (after the prefill)", "acceptance_pct": "drafts accepted (%)",
              "tokens_per_forward": "tokens per forward", "forwards": "forwards after the prefill",
              "speedup": "speed-up over plain greedy"}
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name=f"speculative ({params['drafter']})",
                     verdict=verdict(stats, plain_s, spec_s, tokens, spec_rate, plain_rate),
                     baseline_name="plain greedy",
                     notes=["greedy speculative output is token for token the plain greedy output" if same else
                            "WARNING: speculative output differs from plain greedy"],
                     related_commands=[f"k3serve generate --prompt 'def f(x):' --max-tokens {tokens} --speculative "
                                       f"{spec.drafter} --num-draft-tokens {params['num_draft_tokens']}",
                                       "python benchmarks/bench_spec.py"])


MODULE = LabModule(
    id="speculative", number=12, title="Speculative decoding",
    summary="Draft several tokens cheaply, verify them in one forward, keep what the model agrees with.",
    explanation=(
        "A decode step of a streamed MoE costs about the same for 1 or 5 positions (the same trunk and most of the "
        "same experts are read), so verifying k drafted tokens in one forward of T = k + 1 positions pays when they "
        "are accepted. Greedy: accept d_i while it equals the target's argmax; the first mismatch gives the target's "
        "own token, so the output is exactly plain greedy. With acceptance a, a window yields (1 - a^(k+1)) / (1 - a) "
        "tokens. Drafters: n-gram lookup in the context (free, good when the output quotes the input), the model on "
        "its resident experts, or 'replay' (the known continuation with a chosen share of wrong tokens) to show the "
        "mechanism at a given acceptance."),
    params=(Param("drafter", "choice", "ngram", "who proposes drafts", choices=("ngram", "resident", "replay")),
            Param("prompt", "choice", "grounded", "grounded: a code excerpt then its start again; open: prose",
                  choices=("grounded", "open")),
            Param("num_draft_tokens", "int", DEFAULT_DRAFT_TOKENS["ngram"],
                  f"most drafts per window (k; the CLI's default is {DEFAULT_DRAFT_TOKENS['ngram']} for ngram, "
                  f"{DEFAULT_DRAFT_TOKENS['resident']} for resident)", min=1, max=16),
            Param("adaptive", "bool", True, "adapt k to the recent acceptance"),
            Param("rollback", "choice", "projection", "KDA rollback method", choices=("projection", "snapshot")),
            Param("replay_miss", "float", 0.1, "replay drafter: share of wrong drafts", min=0.0, max=1.0),
            Param("tokens", "int", 24, "tokens to generate", min=4, max=256, unit="tokens"),
            Param("excerpt_tokens", "int", 96, "prompt length", min=8, max=1000, unit="tokens"),
            repeats_param()),
    kind="measured", run=run)
