"""The lab's HTTP API on the embedded model: every module at (reduced) defaults returns the documented record with
finite numbers; bad parameters are 400s naming them; a cancelled run stops; the page and plotly are served."""

from __future__ import annotations

import math
import time

import pytest

from k3serve.lab.registry import AXIS_UNITS, modules



def _finite_numbers(record: dict) -> None:
    for part in ("metrics", "baseline"):
        assert record[part], part
        for key, value in record[part].items():
            assert value is None or math.isfinite(value), (part, key, value)
    assert any(v is not None for v in record["metrics"].values())


def test_modules_list_has_the_documented_shape(lab_client):
    listing = lab_client.get("/lab/api/modules").json()
    assert [m["id"] for m in listing] == list(modules())
    for module in listing:
        assert set(module) >= {"id", "title", "summary", "params", "kind"}
        assert module["kind"] in ("measured", "simulated", "both")
        for param in module["params"]:
            assert set(param) >= {"name", "type", "default", "min", "max", "choices", "unit"}


@pytest.mark.parametrize("module_id", list(modules()))
def test_every_module_runs_and_returns_the_documented_record(lab_client, fast_params, module_id):
    fast = fast_params.get(module_id, {})
    response = lab_client.post(f"/lab/api/modules/{module_id}/run?wait=true", json=fast)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "done", job.get("error")
    record = job["result"]
    assert set(record) >= {"id", "params", "measured", "metrics", "baseline", "series", "command", "seconds"}
    assert record["id"] == module_id and isinstance(record["measured"], bool)
    _finite_numbers(record)
    assert record["command"].startswith(f"k3serve lab run {module_id}")
    for name, value in fast.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        assert f"--param {name}={text}" in record["command"]
    assert record["series"], "a module shows at least one figure"
    assert record["measured"] == any(f["measured"] for f in record["series"])
    for figure in record["series"]:
        assert figure["mark"] in ("measured on this machine", "simulated (model)") or \
            figure["mark"] == f"recorded {figure['recorded']}" and figure["measured"]  # shown from a stored record
        assert figure["command"] == record["command"] and figure["source"]
        # one labelled unit per numeric axis (a bar chart's x holds categories); log scales only on line charts
        assert figure["y_unit"] in AXIS_UNITS, (figure["title"], figure["y_label"])
        if figure["kind"] != "bar":
            assert figure["x_unit"] in AXIS_UNITS, (figure["title"], figure["x_label"])
        assert not (figure["log_y"] and figure["kind"] == "bar"), figure["title"]
        if figure["highlight"] is not None:
            names = {x for t in figure["traces"] for x in t["x"]} | {t["name"] for t in figure["traces"]}
            assert figure["highlight"] in names, figure["title"]
        for trace in figure["traces"]:
            values = trace.get("z") or trace["y"]
            flat = [v for row in values for v in (row if isinstance(row, list) else [row])]
            assert any(v is not None and math.isfinite(v) for v in flat), figure["title"]
    verdict = record["verdict"]  # every module judges its own result, in one generated sentence
    assert verdict is not None and verdict["outcome"] in ("won", "lost", "even"), verdict
    assert verdict["metric"] in record["metrics"] and verdict["sentence"].endswith(".")
    assert verdict["outcome"] in verdict["sentence"]
    assert verdict["flips_when"] and verdict["flips_when"][1:] in verdict["sentence"], "the flip condition is said"
    assert record["date"].endswith("+00:00")
    again = lab_client.post(f"/lab/api/modules/{module_id}/run", json=fast).json()
    assert again["cached"] and again["result"] == record


def test_the_overview_shows_stored_figures_until_a_run_here_replaces_them(lab_client):
    from k3serve.lab.overview import HEADLINES, load_stored_runs

    stored = load_stored_runs()
    before = lab_client.get("/lab/api/overview").json()
    assert [h["slot"] for h in before["headlines"]] == [h.slot for h in HEADLINES]
    assert [row["module"] for row in before["modules"]] == list(modules())
    assert before["stored"]["date"] == stored["date"] and before["stored"]["machine"] == stored["machine"]
    for headline in before["headlines"]:  # a slot whose module never ran says so, whatever module fills it
        known = headline["module"] in stored["runs"] or headline["status"] == "done"
        assert headline["status"] == ("done" if known else "not yet run"), headline
    lab_client.post("/lab/api/modules/anatomy/run?wait=true", json={"trunk_precision": "fp8"})
    after = {row["module"]: row for row in lab_client.get("/lab/api/overview").json()["modules"]}
    anatomy = after["anatomy"]
    assert anatomy["source"] == "run on this server" and anatomy["badge"] == "measured"
    assert "trunk_precision=fp8" in anatomy["command"] and anatomy["verdict"]["outcome"] == "won"


@pytest.mark.parametrize("module_id, family", [("batching", "qwen3_next"), ("prefix_cache", "kimi_linear")])
def test_a_module_runs_on_a_family_the_user_picks(lab_client, fast_params, module_id, family):
    body = {**fast_params[module_id], "model": family}
    job = lab_client.post(f"/lab/api/modules/{module_id}/run?wait=true", json=body).json()
    assert job["status"] == "done", job.get("error")
    record = job["result"]
    _finite_numbers(record)
    assert f"--param model={family}" in record["command"]
    assert all(f"a random tiny {family} model" in figure["source"] for figure in record["series"][:1])
    if module_id == "prefix_cache":  # Kimi Linear: MLA blocks and KDA state checkpoints both restored
        assert record["metrics"]["hit_rate_pct"] > 0 and record["metrics"]["checkpoints"] > 0


def test_a_parameter_changes_the_result(lab_client):
    a = lab_client.post("/lab/api/modules/mxfp4/run?wait=true", json={"rows": 64}).json()["result"]
    b = lab_client.post("/lab/api/modules/mxfp4/run?wait=true",
                        json={"rows": 64, "distribution": "student_t3"}).json()["result"]
    assert a["metrics"]["relative_rms_error"] != b["metrics"]["relative_rms_error"]


@pytest.mark.parametrize("body, param", [({"rows": 0}, "rows"), ({"rows": 1e9}, "rows"), ({"bogus": 1}, "bogus"),
                                         ({"distribution": "cauchy"}, "distribution"), ({"cols": "wide"}, "cols")])
def test_bad_parameters_are_400s_naming_the_parameter(lab_client, body, param):
    response = lab_client.post("/lab/api/modules/mxfp4/run", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_a_rule_across_parameters_is_a_400_naming_the_parameter(lab_client):
    response = lab_client.post("/lab/api/modules/mxfp4/run", json={"cols": 33})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cols"


def test_unknown_module_job_and_body(lab_client):
    assert lab_client.post("/lab/api/modules/nope/run", json={}).status_code == 404
    assert lab_client.get("/lab/api/jobs/nope").status_code == 404
    assert lab_client.delete("/lab/api/jobs/nope").status_code == 404
    assert lab_client.post("/lab/api/modules/mxfp4/run", content=b"[1, 2]").status_code == 400


def test_a_cancelled_run_stops(lab_client):
    job = lab_client.post("/lab/api/modules/rollback/run?rerun=true", json={"repeats": 50}).json()
    deadline = time.time() + 30
    while job["status"] == "queued" or (job["status"] == "running" and job["progress"] < 0.45):
        assert time.time() < deadline
        time.sleep(0.05)
        job = lab_client.get(f"/lab/api/jobs/{job['job_id']}").json()
    assert job["status"] == "running", job
    cancelled = lab_client.delete(f"/lab/api/jobs/{job['job_id']}").json()
    while cancelled["status"] == "running":
        assert time.time() < deadline
        time.sleep(0.05)
        cancelled = lab_client.get(f"/lab/api/jobs/{job['job_id']}").json()
    assert cancelled["status"] == "cancelled" and "result" not in cancelled


def test_the_page_and_plotly_are_served_from_the_package(lab_client):
    page = lab_client.get("/lab/")
    assert page.status_code == 200 and "static/lab.js" in page.text and "static/plotly.min.js" in page.text
    assert "cdn" not in page.text.lower()
    plotly = lab_client.get("/lab/static/plotly.min.js")
    assert plotly.status_code == 200 and len(plotly.content) > 1_000_000 and b"plotly" in plotly.content[:2000].lower()
    assert lab_client.get("/lab/static/lab.css").status_code == 200
    assert lab_client.get("/lab/static/../api.py").status_code == 404
    assert lab_client.get("/", follow_redirects=False).headers["location"] == "/lab/"


def test_mount_lab_adds_the_lab_to_another_app(lab_fixtures):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from k3serve.lab.api import mount_lab

    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    queue = mount_lab(app, lab_fixtures)
    try:
        with TestClient(app) as client:
            assert client.get("/health").json() == {"ok": True}
            assert [m["id"] for m in client.get("/lab/api/modules").json()] == list(modules())
            assert client.get("/lab", follow_redirects=False).headers["location"] == "/lab/"
    finally:
        queue.close()


def test_ranges_the_model_sets_are_the_advertised_ones(lab_client, lab_fixtures):
    config = lab_fixtures.config
    slots = len(config.moe_layer_ids) * config.num_experts
    listing = {m["id"]: {p["name"]: p for p in m["params"]} for m in lab_client.get("/lab/api/modules").json()}
    layer = listing["coactivation"]["layer"]
    assert (layer["min"], layer["max"]) == (min(config.moe_layer_ids), max(config.moe_layer_ids))
    assert listing["cache_policies"]["capacity"]["max"] == slots
    assert listing["cache_policies"]["tokens"]["max"] == lab_fixtures.trace_tokens
    assert listing["parallel_io"]["experts_per_batch"]["max"] == slots


@pytest.mark.parametrize("module_id, body, param", [
    ("coactivation", {"layer": 0}, "layer"),  # layer 0 is dense
    ("coactivation", {"layer": 8}, "layer"),  # the embedded model has layers 0..7
    ("cache_policies", {"capacity": 449}, "capacity"),  # 7 MoE layers x 64 experts = 448 slots
    ("cache_policies", {"tokens": 1025}, "tokens"),  # the trace holds 1,024 tokens
    ("parallel_io", {"experts_per_batch": 449}, "experts_per_batch"),
    ("rollback", {"window": 4, "kept": 5}, "kept"),
])
def test_a_value_the_model_rules_out_is_a_400_naming_it(lab_client, module_id, body, param):
    response = lab_client.post(f"/lab/api/modules/{module_id}/run", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and repr(param) in error["message"]


def test_the_largest_value_the_model_allows_runs_as_asked(lab_client):
    job = lab_client.post("/lab/api/modules/cache_policies/run?wait=true", json={"capacity": 448, "tokens": 64}).json()
    assert job["status"] == "done", job.get("error")
    assert "--param capacity=448" in job["result"]["command"]
    assert "at 448 slots" in job["result"]["series"][0]["title"]  # what ran is what the command says


@pytest.fixture
def small_lab_client(lab_fixtures):
    """A second app over the same fixtures with a queue of 1."""
    from fastapi.testclient import TestClient

    from k3serve.lab.api import create_lab_app
    from k3serve.lab.jobs import LabQueueConfig

    app = create_lab_app(lab_fixtures, LabQueueConfig(max_queued=1))
    with TestClient(app) as client:
        yield client


HEAVY_CLUSTER_SCALE = {"groups": 1024, "per_group": 256, "max_replicas": 64, "replicas": 64, "clients": 1024,
                       "seeds": 20}  # in range, and many minutes of simulation (#36)


def test_a_full_queue_is_a_429_and_a_heavy_run_is_cancelled_within_two_seconds(small_lab_client):
    client = small_lab_client
    running = client.post("/lab/api/modules/cluster_scale/run", json=HEAVY_CLUSTER_SCALE).json()
    queued = client.post("/lab/api/modules/cluster_scale/run", json={**HEAVY_CLUSTER_SCALE, "seeds": 19}).json()
    assert queued["status"] == "queued"
    full = client.post("/lab/api/modules/mxfp4/run", json={"rows": 64})
    assert full.status_code == 429 and "full" in full.json()["error"]["message"]
    assert full.json()["error"]["param"] is None
    deadline = time.time() + 60
    while client.get(f"/lab/api/jobs/{running['job_id']}").json()["status"] != "running":
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the simulation, between its checks
    for job in (queued, running):
        started = time.monotonic()
        client.delete(f"/lab/api/jobs/{job['job_id']}")
        while client.get(f"/lab/api/jobs/{job['job_id']}").json()["status"] != "cancelled":
            assert time.monotonic() - started < 2.0, job
            time.sleep(0.02)
    after = client.post("/lab/api/modules/mxfp4/run?wait=true", json={"rows": 64}).json()
    assert after["status"] == "done"


def test_the_jobs_listing_shows_running_and_queued_jobs(small_lab_client):
    client = small_lab_client
    assert client.get("/lab/api/jobs").json() == {"jobs": [], "max_queued": 1}
    running = client.post("/lab/api/modules/cluster_scale/run", json=HEAVY_CLUSTER_SCALE).json()
    deadline = time.time() + 60
    # NOTE: the queue holds one waiting job: the second waits until the dispatcher took the first (on a loaded
    # machine it may not have yet, and the second would be a 429)
    while client.get("/lab/api/jobs").json()["jobs"][0]["status"] != "running":
        assert time.time() < deadline
        time.sleep(0.05)
    queued = client.post("/lab/api/modules/mxfp4/run", json={"rows": 96}).json()
    jobs = client.get("/lab/api/jobs").json()["jobs"]
    assert [(j["job_id"], j["module"], j["status"], j["position"]) for j in jobs] == \
        [(running["job_id"], "cluster_scale", "running", 0), (queued["job_id"], "mxfp4", "queued", 1)]
    assert jobs[0]["params"]["groups"] == 1024 and jobs[1]["params"]["rows"] == 96
    assert all(0 <= j["progress"] <= 1 and "result" not in j for j in jobs)
    client.delete(f"/lab/api/jobs/{running['job_id']}")
    client.delete(f"/lab/api/jobs/{queued['job_id']}")
    while client.get("/lab/api/jobs").json()["jobs"]:
        assert time.time() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("module_id, body, param", [
    ("speculative", {"repeats": 2}, "repeats"), ("prefix_cache", {"rounds": 2}, "rounds"),
    ("batching", {"repeats": 2}, "repeats"), ("parallel_io", {"repeats": 1}, "repeats"),
    ("rollback", {"repeats": 2}, "repeats"),
])
def test_a_timing_is_a_median_of_at_least_three_repeats(lab_client, module_id, body, param):
    response = lab_client.post(f"/lab/api/modules/{module_id}/run", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    listing = {m["id"]: {p["name"]: p for p in m["params"]} for m in lab_client.get("/lab/api/modules").json()}
    assert listing[module_id][param]["default"] >= 3


def test_a_result_exports_as_json_and_csv(lab_client):
    import csv
    import io

    from k3serve.lab.export import CSV_COLUMNS

    job = lab_client.post("/lab/api/modules/rollback/run?wait=true", json={"repeats": 0, "window": 5}).json()
    record = job["result"]
    as_json = lab_client.get(f"/lab/api/jobs/{job['job_id']}/result.json")
    assert as_json.status_code == 200 and as_json.json() == record
    assert f'filename="rollback-{job["job_id"]}.json"' in as_json.headers["content-disposition"]
    as_csv = lab_client.get(f"/lab/api/jobs/{job['job_id']}/result.csv")
    assert as_csv.status_code == 200 and as_csv.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert tuple(as_csv.text.splitlines()[0].split(",")) == CSV_COLUMNS
    metrics = {r["name"]: (float(r["value"]), float(r["baseline"])) for r in rows if r["part"] == "metric"}
    assert metrics == {k: (v, record["baseline"][k]) for k, v in record["metrics"].items()}
    points = [r for r in rows if r["part"] == "figure"]
    assert len(points) == sum(len(t["x"]) for f in record["series"] for t in f["traces"])
    first = record["series"][0]
    at_window_5 = [r for r in points if r["name"] == first["title"] and r["x"] == "5"]
    assert [float(r["value"]) for r in at_window_5] == [t["y"][4] for t in first["traces"]]
    assert {r["unit"] for r in at_window_5} == {"MiB"}
    verdict = [r for r in rows if r["part"] == "verdict"]
    assert [(r["name"], r["label"], r["series"], float(r["value"])) for r in verdict] == \
        [(record["verdict"]["metric"], record["verdict"]["sentence"], record["verdict"]["outcome"],
          record["verdict"]["factor"])]
    assert lab_client.get(f"/lab/api/jobs/{job['job_id']}/result.xml").status_code == 404
    assert lab_client.get("/lab/api/jobs/nope/result.csv").status_code == 404


def test_a_job_without_a_result_has_nothing_to_export(lab_client):
    job = lab_client.post("/lab/api/modules/rollback/run?rerun=true", json={"repeats": 50}).json()
    lab_client.delete(f"/lab/api/jobs/{job['job_id']}")
    job = lab_client.get(f"/lab/api/jobs/{job['job_id']}").json()
    assert job["status"] in ("queued", "running", "cancelled") and "result" not in job
    response = lab_client.get(f"/lab/api/jobs/{job['job_id']}/result.json")
    assert response.status_code == 409 and job["job_id"] in response.json()["error"]["message"]
