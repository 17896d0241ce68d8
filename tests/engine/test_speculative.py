"""Speculative decoding: greedy == plain greedy token for token; sampling preserves the target distribution."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.drafters import Draft, NGramDrafter
from k3serve.engine.engine import LLMEngine
from k3serve.engine.generate import generate
from k3serve.engine.sampling import Sampler, SamplingParams
from k3serve.cli.spec_storage import storage_report
from k3serve.engine.speculative import AdaptiveDraftLength, DrafterFactory, SpeculativeConfig
from k3serve.engine.verification import verify
from k3serve.errors import RequestError
from k3serve.loading import load_model

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
CASES = [(drafter, rollback) for drafter in ("ngram", "resident", "resident-half") for rollback in
         ("snapshot", "projection")]


@pytest.fixture(scope="module")
def embedded_model():
    return load_model(None).model


def _prompt(model, seed=1):
    """A prompt with repeats (so n-gram lookup drafts): P, the model's own greedy continuation of P, then P."""
    P = [int(x) for x in np.random.default_rng(seed).integers(3, model.config.vocab_size, 10)]
    return P + model.greedy(P, 12) + P


def _spec(model, drafter: str, rollback: str):
    factory = DrafterFactory(model)
    if drafter == "resident-half":  # routing restricted to half the experts: drafts that do get rejected
        factory = DrafterFactory(model, allowed_experts=lambda layer: set(range(model.config.num_experts // 2)))
        drafter = "resident"
    # min_ngram = 1: an untrained model rarely repeats longer n-grams, and these tests need drafts to verify
    return SpeculativeConfig(drafter=drafter, rollback=rollback, adaptive=False, num_draft_tokens=4,
                             min_ngram=1), factory


@pytest.mark.parametrize("which", ["tiny", "embedded"])
@pytest.mark.parametrize("drafter,rollback", CASES)
def test_greedy_speculation_equals_plain_greedy(tiny_model, embedded_model, which, drafter, rollback):
    model = tiny_model if which == "tiny" else embedded_model
    prompt = _prompt(model)
    plain, _ = generate(model, prompt, GREEDY)
    assert plain == model.greedy(prompt, GREEDY.max_tokens)  # the engine's plain decode, against the model's own loop
    spec, factory = _spec(model, drafter, rollback)
    tokens, report = generate(model, prompt, GREEDY, speculative=spec, drafters=factory)
    assert tokens == plain
    stats = report.speculation
    assert stats.rollback_seconds > 0 and stats.recorded_bytes > 0  # the engine books each window's rollback
    assert stats.windows > 0 and stats.drafted > 0
    if drafter == "resident":  # all experts resident: the draft is the target itself
        assert stats.drafted > 0 and stats.accepted == stats.drafted
    if drafter == "resident-half":
        assert stats.drafted > stats.accepted  # rejections happened and were rolled back


@pytest.mark.parametrize("drafter,rollback", CASES)
def test_engine_speculates_alongside_plain_requests(tiny_model, drive, drafter, rollback):
    model = tiny_model
    spec, factory = _spec(model, drafter, rollback)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=128, max_seqs=6), drafters=factory)
    prompts = [_prompt(model, seed) for seed in (1, 2, 3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(prompts[0], params, speculative=spec),
           engine.add_request(prompts[1], params),  # not speculating, same batches
           engine.add_request(prompts[2], params, speculative=spec),
           engine.add_request(prompts[0], params, speculative=False)]
    final = drive(engine)  # check_integrity after every step
    for request_id, prompt in zip(ids, prompts + [prompts[0]]):
        assert final[request_id].outputs[0].token_ids == generate(model, prompt, params)[0]
    assert engine.metrics.counter("spec_windows").value > 0
    assert engine.scheduler.blocks.num_used_blocks == 0


class _FailingFactory(DrafterFactory):
    """n-gram drafters that raise from their second proposal on."""

    def create(self, config):
        drafter = super().create(config)
        calls = []

        def propose(context, max_tokens, sampler):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("drafter bug")
            return type(drafter).propose(drafter, context, max_tokens, sampler)

        drafter.propose = propose
        return drafter


def test_a_failing_drafter_costs_speculation_not_the_request(tiny_model, drive):
    model = tiny_model
    prompt = _prompt(model)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain, _ = generate(model, prompt, params)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_seqs=2), drafters=_FailingFactory(model))
    spec = SpeculativeConfig(drafter="ngram", adaptive=False, num_draft_tokens=4)
    failing, other = engine.add_request(prompt, params, speculative=spec), engine.add_request(prompt, params)
    final = drive(engine)  # check_integrity after every step
    assert final[failing].outputs[0].token_ids == plain and final[failing].error is None
    assert final[other].outputs[0].token_ids == plain
    assert engine.metrics.counter("spec_windows").value <= 1  # only the first proposal could have drafted


def test_engine_stop_token_inside_an_accepted_window(tiny_model, drive):
    model = tiny_model
    prompt = _prompt(model)
    plain, _ = generate(model, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop = plain[5]
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_seqs=2))
    request_id = engine.add_request(prompt, params, speculative=SpeculativeConfig(drafter="resident", adaptive=False))
    out = drive(engine)[request_id].outputs[0]
    assert out.token_ids == plain[:plain.index(stop) + 1] and out.finish_reason.value == "stop"


def test_ngram_drafts_the_agreed_continuation():
    drafter = NGramDrafter(max_ngram=3, min_ngram=2)
    sampler = Sampler(GREEDY)
    assert drafter.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, sampler).tokens == [4, 5, 9]
    # two earlier matches of (1, 2, 3) that continue 4, 5 and 4, 7: only the agreed 4 is drafted
    assert drafter.propose([1, 2, 3, 4, 5, 1, 2, 3, 4, 7, 0, 1, 2, 3], 3, sampler).tokens == [4]
    assert drafter.propose([1, 2, 3, 4], 3, sampler).tokens == []
    assert drafter.propose([8, 1, 2, 8, 1], 0, sampler).tokens == []


def test_adaptive_length_stops_speculating_when_drafts_fail():
    length = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=6))
    assert length.next_k() > 0
    for _ in range(20):
        length.observe(4, 0)
    assert length.best_k(length.acceptance) == 0
    ks = [length.next_k() for _ in range(32)]
    assert ks.count(0) >= 30 and 1 in ks  # plain decode, with an occasional one-token probe
    for _ in range(20):
        length.observe(6, 6)
    assert length.next_k() == 6


def test_bad_speculative_options_are_refused():
    with pytest.raises(RequestError):
        SpeculativeConfig(drafter="magic")
    with pytest.raises(RequestError):
        SpeculativeConfig(rollback="undo")


# ---- sampling: rejection sampling preserves the target distribution --------------------------------------------
V = 5
SIGNIFICANCE = 0.001  # chi-square test level; fixed seeds make the test deterministic


def _bigram(seed: int, sharp: float) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(V, V)) * sharp  # [prev, next]
    return logits.astype(np.float32)


Z_UPPER = 3.0902  # standard normal quantile for SIGNIFICANCE = 0.001 (upper tail)


def _chi_square_statistic(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _chi_square_critical(df: int) -> float:
    """Upper SIGNIFICANCE quantile of chi-square(df), Wilson-Hilferty approximation (within ~1% for df >= 3)."""
    c = 2.0 / (9.0 * df)
    return df * (1 - c + Z_UPPER * np.sqrt(c)) ** 3


@pytest.mark.parametrize("draft_kind", ["model", "one-hot"])
def test_speculative_sampling_matches_plain_sampling(draft_kind):
    """Target: a bigram model P(next | prev) over V = 5 tokens at temperature 0.8 with top-k 4; draft: a different
    bigram (or a deterministic guess). The first two emitted tokens after x0 must follow P(a | x0) P(b | a)."""
    target, draft_logits = _bigram(0, 1.5), _bigram(7, 1.0)
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=8, seed=123)
    sampler = Sampler(params)
    p = np.stack([sampler.probabilities(target[i]) for i in range(V)])  # [prev, next]
    q = np.stack([Sampler(SamplingParams(temperature=1.0)).probabilities(draft_logits[i]) for i in range(V)])
    x0, trials = 2, 30000
    rng = np.random.default_rng(5)
    counts = np.zeros(V * V)
    accepted = 0
    for _ in range(trials):
        if draft_kind == "model":
            d1 = int(rng.choice(V, p=q[x0]))
            d2 = int(rng.choice(V, p=q[d1]))
            draft = Draft([d1, d2], [q[x0], q[d1]])
        else:
            draft = Draft([3, 1])  # always guesses 3 then 1
        rows = np.stack([target[x0], target[draft.tokens[0]], target[draft.tokens[1]]])  # [T, V]
        result = verify(rows, draft, sampler)
        accepted += result.num_accepted
        a = result.tokens[0]
        b = result.tokens[1] if len(result.tokens) > 1 else sampler.sample(target[a])  # plain step after
        counts[a * V + b] += 1
    expected = (p[x0][:, None] * p).ravel()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token the target's top-k excludes
    df = int(keep.sum()) - 1
    assert _chi_square_statistic(counts[keep], expected[keep]) < _chi_square_critical(df)
    assert accepted > 0


def test_spec_storage_report_names_the_four_to_one_window():
    lines, record = storage_report(8)
    kimi = next(m for m in record["models"] if m["name"].startswith("Kimi Linear"))
    assert kimi["first_window_at_4_to_1"]["anchor/bf16"] == 5
    row = next(r for r in kimi["rows"] if r["window"] == 4 and r["accounting"] == "anchor"
               and r["precision"] == "bf16")
    assert row["snapshot_bytes"] == 80 * 2**20
    assert any("Kimi K3" in line for line in lines)


def test_default_draft_cap_depends_on_the_drafter():
    from k3serve.engine.speculative import DEFAULT_DRAFT_TOKENS

    assert SpeculativeConfig().max_draft_tokens == DEFAULT_DRAFT_TOKENS["ngram"] == 8  # drafts that cost nothing
    assert SpeculativeConfig(drafter="resident").max_draft_tokens == DEFAULT_DRAFT_TOKENS["resident"] == 4
    assert SpeculativeConfig(drafter="model").max_draft_tokens == 4
    assert SpeculativeConfig(drafter="resident", num_draft_tokens=6).max_draft_tokens == 6
    with pytest.raises(RequestError, match="num_draft_tokens"):
        SpeculativeConfig(num_draft_tokens=0)


def test_engine_drafter_by_name_takes_that_drafters_default_cap(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_seqs=2))
    assert engine._speculative_for("resident").max_draft_tokens == 4
    assert engine._speculative_for(True).max_draft_tokens == 8
    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, max_seqs=2),
                       speculative=SpeculativeConfig(num_draft_tokens=6))
    assert engine._speculative_for("resident").max_draft_tokens == 6  # a cap the operator chose is kept


def test_io_aware_length_weighs_the_measured_union_growth():
    fixed = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=8))
    aware = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=8, io_aware=True))
    assert aware.cost == fixed.cost == 0.15  # nothing measured yet: the assumed cost
    aware.observe_step(1, 1000)
    aware.observe_step(5, 1000 + 4 * 600)  # each extra position read 60% of a one-position step's bytes
    assert aware.cost == pytest.approx(0.6)
    assert aware.best_k(0.7) < fixed.best_k(0.7)
    cheap = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=8, io_aware=True))
    cheap.observe_step(1, 1000)
    cheap.observe_step(3, 1000)  # the window's experts were all resident: extra positions cost no bytes
    assert cheap.cost == 0.0 and cheap.best_k(0.9) == 8 > fixed.best_k(0.9)
    concave = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=8, io_aware=True))
    for positions, bytes_read in ((1, 1000), (3, 2000), (9, 2600)):  # the union saturates: 500, then 100/position
        concave.observe_step(positions, bytes_read)
    assert concave.window_cost(2) == 2.0 and concave.window_cost(8) == 2.6
    assert concave.window_cost(5) == pytest.approx(2.3)  # interpolated between the sizes seen
    assert concave.best_k(0.8) >= 6  # a straight line through 1 and 3 positions (c = 0.5) stops at k = 1
    straight = AdaptiveDraftLength(SpeculativeConfig(num_draft_tokens=8, io_aware=True))
    straight.observe_step(1, 1000)
    straight.observe_step(3, 2000)
    assert straight.window_cost(8) == pytest.approx(5.0) and straight.best_k(0.8) == 1


def test_io_aware_speculation_measures_a_streamed_model_and_keeps_greedy_tokens(tiny_store):
    from k3serve.stream.budget import minimum_budget_bytes
    from k3serve.stream.options import StreamOptions

    budget = minimum_budget_bytes(tiny_store) + 2 * tiny_store.expert_stride
    model = load_model(tiny_store.path, stream=StreamOptions(ram_budget=budget, prefetch="none")).model
    prompt = [1, 5, 9, 5, 9, 5, 9, 5, 9, 5]
    plain, _ = generate(model, prompt, GREEDY)
    spec = SpeculativeConfig(drafter="ngram", num_draft_tokens=4, min_ngram=1, io_aware=True)
    factory = DrafterFactory(model)
    engine = LLMEngine(model, EngineConfig(max_seqs=1), speculative=spec, drafters=factory)
    request = engine.make_request(prompt, GREEDY, speculative=True)
    engine.enqueue(request)
    while not request.finished:
        engine.step()
    assert list(request.sequences[0].output_token_ids) == plain
    length = request.sequences[0].speculation.length
    assert length.one_position_bytes > 0 and any(t > 1 for t in length.step_bytes)  # plain steps and windows
    largest = max(length.step_bytes)
    assert length.window_cost(largest - 1) == pytest.approx(length.step_bytes[largest] / length.one_position_bytes)
