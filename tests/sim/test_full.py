"""The full-scale simulator: the same bytes and reads as the live streaming engine on the same trace, a
deterministic clock, the C engine's cold-token figures, and clear errors for bad machines and budgets."""

from __future__ import annotations

import json

import pytest

from k3serve.cli.main import main
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.model.routing import ExpertTopP
from k3serve.sim.full import SimConfig, SimConfigError, VirtualStore, replay_config, simulate
from k3serve.sim.machine import MachineError, load_machine
from k3serve.sim.presets import PRESETS, c_engine, laptop
from k3serve.sim.routing import fit_routing, flat_routing
from k3serve.stream.budget import BudgetError, minimum_budget_bytes
from k3serve.stream.options import StreamOptions
from k3serve.stream.trace import read_trace
from k3serve.weights.pack import pack_checkpoint


@pytest.fixture(scope="module")
def tiny_packed(tiny_dir, tmp_path_factory):
    return pack_checkpoint(tiny_dir, tmp_path_factory.mktemp("sim-tiny-packed"))


@pytest.fixture(scope="module")
def tiny_packed_q8_0(tiny_dir, tmp_path_factory):
    return pack_checkpoint(tiny_dir, tmp_path_factory.mktemp("sim-tiny-q8_0"), trunk_precision="q8_0")


@pytest.mark.parametrize("policy,extra_slots,pin,dtype,top_p", [
    ("lru", 3, 0, "float32", 1.0), ("lfu", 9, None, "float32", 1.0), ("s3fifo", 20, None, "float32", 1.0),
    ("none", 5, 0, "float32", 1.0), ("lru", 2, None, "bf16", 1.0), ("lfu", 40, 0, "bf16", 1.0),
    ("lfu", 80, None, "bf16", 1.0), ("lru", 3, 0, "float32", 0.6), ("lfu", 9, 0, "bf16", 0.6),
    ("lru", 2, None, "q8_0", 1.0), ("lfu", 40, 0, "q8_0", 1.0), ("lfu", 80, None, "q8_0", 1.0)])
def test_simulator_reads_what_the_engine_reads(tiny_packed, tiny_packed_q8_0, tmp_path, policy, extra_slots, pin,
                                               dtype, top_p):
    """dtype q8_0: a store packed with --trunk-precision q8_0, run with a bf16 trunk dtype (held as views, as bf16)."""
    store = tiny_packed_q8_0 if dtype == "q8_0" else tiny_packed
    engine_dtype = "bf16" if dtype == "q8_0" else dtype
    budget = minimum_budget_bytes(store, trunk_dtype=engine_dtype) + extra_slots * store.expert_stride
    trace_path = tmp_path / "run.trace"
    options = StreamOptions(ram_budget=budget, io="pread", queue_depth=4, cache=policy, prefetch="none",
                            pin_trunk_bytes=pin, trace_out=trace_path, trunk_dtype=engine_dtype)
    loaded = load_model(store.path, stream=options, expert_top_p=ExpertTopP(top_p, 1))
    source = loaded.model.source
    generate(loaded.model, [1, 5, 9, 200, 17, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    kept = source.stats().stream.mean_experts_kept
    assert kept == 2.0 if top_p == 1.0 else 1.0 < kept < 2.0  # top-p 0.6 drops some of the tiny model's 2
    source.close()  # waits for the trunk read-ahead still in flight, so that its bytes are counted
    real = source.stats().stream
    plan = source.plan
    assert plan.streamed_layers or pin is None  # the pin=0 cases stream the trunk too
    assert plan.trunk_views == (dtype != "float32")
    assert real.expert_misses > 0 and (real.expert_retained > 0 or policy in ("none", "lru"))

    trace = read_trace(trace_path)
    result = simulate(replay_config(trace, laptop(), store=VirtualStore.from_store(store, dtype), ram_bytes=budget,
                                    policy=policy, prefetch="none", queue_depth=4, pin_trunk_bytes=pin,
                                    count_prefill=True, trunk_dtype=dtype))
    assert result.plan["trunk_read_ahead"] == plan.trunk_read_ahead
    assert result.plan["expert_slots"] == plan.expert_slots
    assert result.plan["pinned_layers"] == len(plan.pinned_layers)
    assert result.plan["total_bytes"] == plan.total_bytes  # the same charges, from the virtual store's sizes
    assert result.totals["expert_bytes"] == real.expert_bytes_read
    assert result.totals["trunk_bytes"] == real.trunk_bytes_read
    assert result.totals["num_reads"] == real.num_reads
    assert result.totals["expert_requests"] == real.expert_requests


def test_clock_is_deterministic_for_a_seed():
    # with next-layer prefetch the seed draws the guesses too (without it, at this budget every step reads alike)
    cfg = dict(machine=laptop(), ram_bytes=40 << 30, tokens=2, warmup=1, trunk_dtype="float32", prefetch="next-layer")
    a, b = simulate(SimConfig(seed=3, **cfg)), simulate(SimConfig(seed=3, **cfg))
    assert a.to_dict() == b.to_dict()
    c = simulate(SimConfig(seed=4, **cfg))
    assert c.step_seconds != a.step_seconds


def test_cold_token_is_the_c_engines_1472_reads_and_25_83_gb():
    r = simulate(SimConfig(machine=c_engine(), engine="c-engine", ram_bytes=8 << 30, pinned_layers=0,
                           cache_bytes=490_000_000, prefetch="none", routing="flat", tokens=2, warmup=1))
    assert r.expert_requests_per_token == 1472
    assert r.expert_bytes_per_token == 1472 * 17_547_264
    assert r.retention == 0.0


def test_more_ram_never_reads_more_and_prefetch_serves_requests():
    # 16 GiB of pinned trunk leaves cold slots for the guesses (the default split pins the trunk first)
    small = simulate(SimConfig(machine=laptop(), ram_bytes=32 << 30, tokens=2, trunk_dtype="bf16",
                               pin_trunk_bytes=16 << 30, prefetch="next-layer"))
    large = simulate(SimConfig(machine=laptop(), ram_bytes=128 << 30, tokens=2, trunk_dtype="bf16"))
    assert large.trunk_bytes_per_token < small.trunk_bytes_per_token
    assert small.prefetch_hit_share > 0.3  # guesses at 65% recall are used, not dropped before their layer


def test_impossible_budget_is_a_clear_error():
    with pytest.raises(BudgetError, match="minimum"):
        simulate(SimConfig(machine=laptop(), ram_bytes=1 << 30))
    with pytest.raises(SimConfigError, match="pinned_layers"):
        SimConfig(machine=laptop(), engine="c-engine")
    with pytest.raises(SimConfigError, match="policy"):
        SimConfig(machine=laptop(), policy="fifo")


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("disk"), "missing key 'disk'"),
    (lambda d: d["compute"].pop("expert_flops"), "compute.expert_flops"),
    (lambda d: d["disk"]["throughput"][0].__setitem__(0, -5), "positive"),
    (lambda d: d["disk"].__setitem__("sizes", [4096, 4096, 1, 2]), "ascending"),
    (lambda d: d["compute"].__setitem__("warp_speed", 9), "unknown key"),
])
def test_bad_machine_files_are_refused(tmp_path, mutate, message):
    raw = laptop().to_dict()
    mutate(raw)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(MachineError, match=message):
        load_machine(path)


def test_machine_files_round_trip_json_and_toml(tmp_path):
    m = laptop()
    (tmp_path / "m.json").write_text(json.dumps(m.to_dict()))
    assert load_machine(tmp_path / "m.json") == m
    toml = tmp_path / "m.toml"
    d = m.to_dict()
    rows = ", ".join("[" + ", ".join(repr(v) for v in r) + "]" for r in d["disk"]["throughput"])
    toml.write_text(f'name = "{d["name"]}"\n[disk]\nsizes = {d["disk"]["sizes"]}\nqueue_depths = '
                    f'{d["disk"]["queue_depths"]}\nthroughput = [{rows}]\n[compute]\n'
                    + "".join(f"{k} = {v!r}\n" for k, v in d["compute"].items()))
    assert load_machine(toml).disk == m.disk
    (tmp_path / "bad.toml").write_text("name = [")
    with pytest.raises(MachineError, match="not valid toml"):
        load_machine(tmp_path / "bad.toml")


def test_cli_errors_exit_2_and_json_has_the_keys(tmp_path, capsys):
    assert main(["sim", "k3", "--ram", "1G", "--machine", "laptop"]) == 2
    assert "minimum" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["sim", "k3", "--machine", str(bad)]) == 2
    assert main(["sim", "k3", "--machine", "no-such-preset"]) == 2
    out = tmp_path / "r.json"
    assert main(["sim", "k3", "--ram", "48G", "--machine", "laptop", "--tokens", "1", "--warmup", "0",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    for key in ("s_per_token", "bytes_per_token", "reads_per_token", "io_seconds_per_token",
                "compute_seconds_per_token"):
        assert record[key] > 0
    assert len(record["timeline"]) == 93


def test_routing_fit_recovers_skew_and_reuse(tiny_packed, tmp_path):
    from k3serve.config import full_k3_config

    path = tmp_path / "t.trace"
    loaded = load_model(tiny_packed.path, stream=StreamOptions(trace_out=path))
    loaded.model.greedy([1, 5, 9, 200, 17], 30)
    loaded.model.source.close()
    c = full_k3_config()
    fit = fit_routing(read_trace(path), c.num_experts, c.num_experts_per_token, recall=0.5, check_tokens=32)
    assert fit.model.num_experts == 896 and fit.model.top_k == 16
    assert 0.0 <= fit.model.reuse <= 1.0 and fit.model.skew >= 0.0
    assert abs(fit.generated.reuse_prev - fit.model.reuse) < 0.2  # the generator honours the fitted reuse
    assert flat_routing(896, 16).guess_recall == pytest.approx(16 / 896)


def test_every_preset_builds():
    for name, make in PRESETS.items():
        assert make().name == name


def test_top_p_keeps_the_drawn_count_and_reads_that_many_experts():
    from k3serve.sim.routing import kept_from_histogram, kept_from_mean

    assert kept_from_mean(8.1, 16)[7:9] == pytest.approx((0.9, 0.1)) and kept_from_mean(16.0, 16)[15] == 1.0
    assert kept_from_histogram({2: 30, 3: 60, 4: 10}, 4, 16) == pytest.approx((0,) * 7 + (0.3,) + (0,) * 3 + (0.6,)
                                                                            + (0,) * 3 + (0.1,))
    cold = dict(machine=c_engine(), engine="c-engine", ram_bytes=8 << 30, pinned_layers=0, cache_bytes=490_000_000,
                prefetch="none", routing="flat", tokens=2, warmup=1)
    half = simulate(SimConfig(experts_kept=kept_from_mean(8.0, 16), **cold))
    assert half.expert_requests_per_token == 92 * 8 and half.experts_kept_per_token == 8.0
    assert half.expert_bytes_per_token == 92 * 8 * 17_547_264
    full = simulate(SimConfig(**cold))
    assert full.s_per_token > half.s_per_token
    assert full.dollars_per_million_tokens == pytest.approx(full.s_per_token / 3600 * 1e6)  # at $1/hour


def test_a_chunked_prefill_reads_each_experts_union_once():
    cold = dict(machine=c_engine(), engine="c-engine", ram_bytes=8 << 30, pinned_layers=0, cache_bytes=490_000_000,
                prefetch="none", routing="flat", tokens=1, warmup=0, prompt_tokens=12)
    chunked = simulate(SimConfig(**cold)).prefill
    one_by_one = simulate(SimConfig(prefill_chunk=1, **cold)).prefill
    assert (chunked["steps"], one_by_one["steps"]) == (1, 12)
    assert one_by_one["expert_bytes"] == 12 * 92 * 16 * 17_547_264  # no cache: every token reads its 16
    # 12 tokens x 16 of 896 flat: 896 (1 - (1 - 16/896)^12) = 174 distinct experts per layer expected, not 192
    ratio = one_by_one["expert_bytes"] / chunked["expert_bytes"]
    assert 1.06 < ratio < 1.16


def test_io_aware_speculation_picks_k_from_the_measured_window_bytes():
    cold = dict(machine=c_engine(), engine="c-engine", ram_bytes=8 << 30, pinned_layers=0, cache_bytes=490_000_000,
                prefetch="none", routing="flat", tokens=1, warmup=0, speculative=4, speculative_io_aware=True)
    sure = simulate(SimConfig(acceptance=0.9, **cold))
    # cold, flat: a one-position step reads the bf16 trunk (~109 GB) and 92 x 16 experts (25.8 GB); each extra
    # position ~92 x 15.7 experts more (25.4 GB): c ~ 0.19
    assert 0.15 < sure.speculation["measured_position_cost"] < 0.23
    assert sure.speculation["chosen_k"] == 4
    unsure = simulate(SimConfig(acceptance=0.1, **cold))
    assert unsure.speculation["chosen_k"] == 0 and unsure.speculation["tokens_per_step"] == 1.0
    with pytest.raises(SimConfigError, match="draft cap"):
        SimConfig(machine=laptop(), speculative_io_aware=True)


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_simulator_reads_what_a_batched_engine_reads(tiny_packed, tiny_packed_q8_0, tmp_path, dtype):
    """Issue 34 item 4: the serving engine decoding 3 sequences together, every trunk layer and the lm_head streamed
    (the minimum budget), reads each streamed layer once per step and each expert of the step's union once; the
    simulator, replaying the engine's trace (a step of B positions: one trunk pass, B embedding rows, the experts'
    union), reads the same bytes and makes the same reads."""
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine

    store = tiny_packed_q8_0 if dtype == "q8_0" else tiny_packed
    budget = minimum_budget_bytes(store, trunk_dtype="bf16") + 2 * store.expert_stride
    trace_path = tmp_path / "batch.trace"
    loaded = load_model(store.path, stream=StreamOptions(ram_budget=budget, io="pread", queue_depth=4, cache="lru",
                                                         prefetch="none", trace_out=trace_path, trunk_dtype="bf16"))
    source = loaded.model.source
    engine = LLMEngine(loaded.model, EngineConfig(max_seqs=4, num_blocks=64, block_size=16), stop_ids=())
    for prompt in ([1, 5, 9, 200], [17, 3, 88], [41, 7, 2, 19, 64]):
        engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    source.close()
    real, plan = source.stats().stream, source.plan
    assert plan.trunk_views and not plan.pinned_layers and not plan.head_pinned
    trace = read_trace(trace_path)
    steps = {}
    for step, _token, _layer, _ids in trace.records:
        steps.setdefault(step, set()).add(_token)
    # one prefill step of the 12 prompt positions, then 4 decode steps of 3 positions (one per sequence)
    assert sorted(len(tokens) for tokens in steps.values()) == [3, 3, 3, 3, 12]
    result = simulate(replay_config(trace, laptop(), store=VirtualStore.from_store(store, dtype), ram_bytes=budget,
                                    policy="lru", prefetch="none", queue_depth=4, count_prefill=True,
                                    trunk_dtype=dtype))
    assert result.plan["expert_slots"] == plan.expert_slots
    assert result.totals["expert_bytes"] == real.expert_bytes_read
    assert result.totals["trunk_bytes"] == real.trunk_bytes_read
    assert result.totals["num_reads"] == real.num_reads
    assert result.totals["expert_requests"] == real.expert_requests
