"""The lab page in a real browser: Playwright driving Debian's Chromium (/usr/bin/chromium, never a downloaded one).

Opens the page served by uvicorn, runs every module (at the API tests' reduced sizes), changes a parameter in three
modules and checks that their numbers and charts change, that every figure carries its mark and command, and that
the console shows no errors, and that charts are readable (human units, axes from 0, legends clear of axis titles).
Smaller tests check the number formatter, the page at 400 and 1400 px with the keyboard, live regions, data tables
and dark mode, permalinks, exports and the dashed previous run, and the cost and energy of a throughput. With
K3SERVE_LAB_SCREENSHOTS=1, screenshots of each module go to out/lab/ (git-ignored). Without chromium the test skips,
except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path

import pytest

from k3serve.serve.threaded import serve_in_thread

CHROMIUM = Path(os.environ.get("K3SERVE_CHROMIUM", "/usr/bin/chromium"))
SCREENSHOTS = Path(__file__).resolve().parents[2] / "out" / "lab"
# screenshots for a person to look at (they check nothing, and took about 20 of the page test's 45 s on 2 shared
# cores): taken only when asked, K3SERVE_LAB_SCREENSHOTS=1 pytest tests/lab/test_browser.py
TAKE_SCREENSHOTS = os.environ.get("K3SERVE_LAB_SCREENSHOTS", "") == "1"
CHANGES = {  # module -> (parameter, new value, metric that must change)
    "mxfp4": ("distribution", "student_t3", "relative_rms_error"),
    "cache_policies": ("capacity", "200", "retention_pct"),
    "rollback": ("window", "8", "projection_over_snapshot"),
}


def _chromium_or_skip() -> None:
    if CHROMIUM.exists():
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def chromium():
    """One Chromium for this module's tests (about 1.3 s a launch on 2 shared cores); each test's page has a context
    of its own (its own storage)."""
    _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def _open_page(browser, url: str, viewport: dict | None = None, defaults: dict[str, dict] | None = None,
               **page_options):
    """A page of `browser` at `url` in a new context, ready; yields (browser, page, errors: console and page errors
    so far). The context closes on leaving. `defaults` (module -> {parameter: value}) replaces those defaults in the
    module listing the page reads (`api/modules`), so that what the page does at its defaults (Run all) runs them."""
    errors: list[str] = []
    context = browser.new_context(viewport=viewport or {"width": 1280, "height": 900}, **page_options)
    try:
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        if defaults:
            page.route("**/api/modules", lambda route: _serve_listing_with_defaults(route, defaults))
        page.goto(url)
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
        yield browser, page, errors
    finally:
        context.close()


def _serve_listing_with_defaults(route, defaults: dict[str, dict]) -> None:
    response = route.fetch()
    listing = response.json()
    for module in listing:
        for param in module["params"]:
            if param["name"] in defaults.get(module["id"], {}):
                param["default"] = defaults[module["id"]][param["name"]]
    route.fulfill(response=response, json=listing)


def _screenshot(target, name: str, **options) -> None:
    """`target` (a page or a locator) to out/lab/`name` when K3SERVE_LAB_SCREENSHOTS=1."""
    if TAKE_SCREENSHOTS:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        target.screenshot(path=str(SCREENSHOTS / name), **options)


@pytest.fixture(scope="module")
def lab_url(lab_app):
    with serve_in_thread(lab_app, lifespan="off", start_timeout=20) as url:
        yield f"{url}/lab/"


def _set(page, module: str, name: str, value: str) -> None:
    field = page.locator(f"#m-{module} [data-param='{name}']")
    if field.evaluate("e => e.tagName") == "SELECT":
        field.select_option(value)
    elif field.get_attribute("type") == "checkbox":
        field.set_checked(value.lower() == "true")
    else:
        field.fill(value)


def _run(page, module: str) -> dict[str, float]:
    section = page.locator(f"#m-{module}")
    before = section.get_attribute("data-runs") or "0"
    page.evaluate("""(id) => { const s = document.getElementById('m-' + id);
        s.dataset.runs = String(Number(s.dataset.runs || 0) + 1); s.querySelector('[data-role=result]').innerHTML = ''; }""",
                  module)
    section.locator("[data-action='run']").click()
    section.locator("table.metrics").wait_for(timeout=120_000)
    assert section.get_attribute("data-runs") == str(int(before) + 1)
    values = {}
    for row in section.locator("table.metrics tbody tr").all():
        raw = row.locator("td.value").get_attribute("data-value")
        values[row.get_attribute("data-metric")] = float(raw) if raw not in ("null", None) else None
    return values


def _chart_data(page, module: str) -> list:
    return page.evaluate("""(id) => Array.from(document.querySelectorAll('#m-' + id + ' .chart'))
        .map(d => (d.data || []).map(t => [t.y || t.z, t.x]))""", module)


def test_the_page_in_chromium(chromium, lab_url, fast_params):
    from k3serve.lab.registry import modules

    with _open_page(chromium, lab_url) as (browser, page, errors):
        ids = list(modules())
        assert page.locator("section.module").count() == len(ids)
        first: dict[str, dict] = {}
        for module in ids:
            for name, value in fast_params.get(module, {}).items():
                _set(page, module, name, str(value))
            first[module] = _run(page, module)
            figures = page.locator(f"#m-{module} .figure")
            assert figures.count() >= 1
            for i in range(figures.count()):
                figure = figures.nth(i)
                mark = figure.locator(".mark").inner_text()
                assert mark in ("measured on this machine", "simulated (model)") or mark.startswith("recorded 20")
                assert figure.locator(".command code").inner_text().startswith(f"k3serve lab run {module}")
                assert figure.locator(".chart .main-svg").count() >= 1  # plotly drew it
            _screenshot(page.locator(f"#m-{module}"), f"{module}.png")
        for module, (name, value, metric) in CHANGES.items():
            charts_before = _chart_data(page, module)
            _set(page, module, name, value)
            second = _run(page, module)
            assert second[metric] != first[module][metric], (module, metric)
            assert _chart_data(page, module) != charts_before, module
            _screenshot(page.locator(f"#m-{module}"), f"{module}-changed.png")
        _check_charts_are_readable(page)
        # a bad value is shown beside the form, not thrown
        _set(page, "mxfp4", "rows", "0")
        page.locator("#m-mxfp4 [data-action='run']").click()
        page.wait_for_function("() => document.querySelector('#m-mxfp4 [data-role=error]').textContent.includes('rows')")
        _screenshot(page, "page.png", full_page=True)
    expected = "the server responded with a status of 400"  # the bad value above, shown on the page
    assert [e for e in errors if expected not in e] == [], errors


EXPONENT = re.compile(r"\d(\.\d+)?e[+-]?\d")


def _check_charts_are_readable(page) -> None:
    """Human units in every table and tick label; linear axes from 0; legends clear of the axis titles; the chosen
    policy in the accent colour."""
    shown = page.evaluate("""() => Array.from(document.querySelectorAll(
        '#modules table td, #modules .chart text')).map(n => n.textContent)""")
    assert shown and not [t for t in shown if EXPONENT.search(t)], [t for t in shown if EXPONENT.search(t)][:5]
    charts = page.evaluate("""() => Array.from(document.querySelectorAll('#modules .chart')).map(d => {
        const box = (sel) => { const n = d.querySelector(sel); if (!n) return null;
                               const r = n.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
        const y = d._fullLayout.yaxis;
        return {id: d.id, ytype: y.type, ymin: Math.min(...y.range), legend: box('.legend'),
                titles: [box('.g-xtitle'), box('.g-ytitle')]}; })""")
    for chart in charts:
        if chart["ytype"] == "linear":
            assert chart["ymin"] <= 0, chart["id"]
        for title in chart["titles"]:
            if chart["legend"] and title:
                a, b = chart["legend"], title
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (chart["id"], a, b)
    colors = page.evaluate("() => document.querySelector('#m-cache_policies .chart').data[0].marker.color")
    chosen = page.locator("#m-cache_policies [data-param='policy']").input_value()
    x = page.evaluate("() => document.querySelector('#m-cache_policies .chart').data[0].x")
    assert [c for c, name in zip(colors, x) if name == chosen] == ["#2457c5"]
    assert len(set(colors)) == 2


def test_the_page_writes_numbers_in_human_units(chromium, lab_url):
    cases = [("number", [2.349e9, "resident bytes (all weights)"], "2.35 GB"),
             ("number", [512, "expert bytes read per token"], "512 bytes"),
             ("number", [3.5, "storage per sequence (MiB)"], "3.5"),
             ("number", [0.0878, "active / resident bytes"], "0.0878"),
             ("number", [2.78e12, "parameters"], "2.78 trillion"),
             ("number", [1.05e11, "active parameters per token"], "105 billion"),
             ("number", [1234567, "misses (reads)"], "1.23 million"),
             ("number", [0.000123, "relative RMS error"], "0.000123"),
             ("number", [12.3456, "retention (%)"], "12.35"),
             ("ratio", [4.95e5], "495,000x"), ("ratio", [0.0], "0x"), ("ratio", [0.0001], "<0.01x"),
             ("ratio", [2.5], "2.50x"), ("ratio", [12.34], "12.3x")]
    with _open_page(chromium, lab_url) as (_, page, _):
        got = [page.evaluate(f"(args) => window.labFormat.{name}(...args)", args) for name, args, _ in cases]
    assert got == [want for _, _, want in cases]


HEAVY_CLUSTER_SCALE = {"groups": "1024", "per_group": "256", "max_replicas": "64", "replicas": "64",
                       "clients": "1024", "seeds": "20"}  # many minutes of simulation


def test_a_reloaded_page_reattaches_to_its_jobs_and_the_queue_panel_cancels(chromium, lab_url):
    with _open_page(chromium, lab_url) as (browser, page, errors):
        for name, value in HEAVY_CLUSTER_SCALE.items():
            _set(page, "cluster_scale", name, value)
        page.locator("#m-cluster_scale [data-action='run']").click()
        _set(page, "mxfp4", "rows", "80")
        page.locator("#m-mxfp4 [data-action='rerun']").click()
        page.wait_for_function("() => document.querySelectorAll('#queue-jobs li[data-job]').length === 2")
        page.reload()
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
        # the new page follows both jobs, with their parameters in the forms, and lists them in the queue panel
        assert page.locator("#m-cluster_scale").get_attribute("data-state") == "running"
        assert page.locator("#m-cluster_scale [data-param='groups']").input_value() == "1024"
        assert page.locator("#m-mxfp4 [data-param='rows']").input_value() == "80"
        assert page.locator("#m-mxfp4 [data-action='cancel']").is_enabled()
        page.wait_for_function("() => document.querySelector('#m-mxfp4 [data-role=message]').textContent"
                               ".includes('queued, position 1')")
        panel = page.locator("#queue-jobs li[data-job]")
        assert panel.count() == 2 and panel.nth(0).get_attribute("data-status") == "running"
        _screenshot(page, "queue.png")
        panel.nth(0).locator("[data-action='cancel-job']").click()
        # the queue moves on: the queued run starts and its result appears on the reloaded page
        page.locator("#m-mxfp4 table.metrics").wait_for(timeout=60_000)
        page.wait_for_function("() => document.querySelector('#m-cluster_scale [data-role=message]').textContent"
                               ".startsWith('cancelled')")
        assert page.locator("#m-cluster_scale").get_attribute("data-state") == "idle"
        page.wait_for_selector("#queue-jobs li.empty", timeout=10_000)
    assert errors == [], errors


def _overflow(page) -> tuple[int, int]:
    return page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")


def test_narrow_and_wide_windows_keyboard_live_regions_data_tables_and_dark_mode(chromium, lab_url):
    with _open_page(chromium, lab_url, viewport={"width": 400, "height": 800},
                    color_scheme="dark") as (browser, page, errors):
        section = page.locator("#m-rollback")
        # progress and results are announced; errors too
        assert section.locator("[data-role=message]").get_attribute("aria-live") == "polite"
        assert section.locator("[data-role=result]").get_attribute("aria-live") == "polite"
        assert section.locator("[data-role=error]").get_attribute("role") == "alert"
        # Enter in a field runs the module (computed only: repeats 0)
        _set(page, "rollback", "repeats", "0")
        section.locator("[data-param='window']").focus()
        page.keyboard.press("Enter")
        section.locator("table.metrics").wait_for(timeout=60_000)
        section.locator(".chart .main-svg").first.wait_for()
        figures = section.locator(".figure")
        assert figures.count() == 2 and section.locator(".figure details table.data").count() == 2
        rows = section.locator(".figure").nth(0).locator("table.data tbody tr")
        assert rows.count() == 8  # windows 1..8 (max_window), one row each
        assert rows.nth(3).locator("th").text_content() == "4"
        width, inner = _overflow(page)
        assert width <= inner == 400, (width, inner)
        _screenshot(section, "narrow-dark.png")
        background = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
        assert sum(int(v) for v in re.findall(r"\d+", background)[:3]) < 3 * 64, background  # dark
        page.set_viewport_size({"width": 1400, "height": 900})
        width, inner = _overflow(page)
        assert width <= inner == 1400, (width, inner)
        page.set_viewport_size({"width": 400, "height": 800})  # and back: the charts follow their cells
        page.wait_for_function("() => document.documentElement.scrollWidth <= window.innerWidth", timeout=5_000)
        light = browser.new_page(viewport={"width": 1400, "height": 900}, color_scheme="light")
        light.goto(lab_url)
        light.wait_for_selector("body[data-ready='true']", timeout=30_000)
        background = light.evaluate("() => getComputedStyle(document.body).backgroundColor")
        assert sum(int(v) for v in re.findall(r"\d+", background)[:3]) > 3 * 192, background  # light
        width, inner = _overflow(light)
        light.context.close()
        assert width <= inner == 1400, (width, inner)
    assert errors == [], errors


def test_a_permalink_fills_the_form_results_download_and_the_previous_run_is_dashed(chromium, lab_url):
    link = f"{lab_url}?module=rollback&window=6&repeats=0&precision=fp32"
    with _open_page(chromium, link) as (browser, page, errors):
        form = page.locator("#m-rollback")
        assert [form.locator(f"[data-param='{n}']").input_value() for n in ("window", "repeats", "precision")] == \
            ["6", "0", "fp32"]
        assert form.locator("table.metrics").count() == 0  # a permalink fills the form; it runs nothing
        _set(page, "rollback", "window", "7")
        link = form.locator("[data-role=permalink]").get_attribute("href")
        assert "module=rollback" in link and "window=7" in link and "precision=fp32" in link
        _run(page, "rollback")
        assert not page.evaluate("() => document.querySelectorAll('#m-rollback .chart')[1].data"
                                 ".some(t => t.meta === 'previous')")
        for kind in ("json", "csv"):
            href = form.locator(f"[data-role=export-{kind}]").get_attribute("href")
            response = page.request.get(lab_url + href)
            assert response.ok, href
            if kind == "json":
                assert response.json()["params"]["window"] == 7
            else:
                assert response.text().startswith("part,name,label,series,x,y,value,baseline,unit")
        _set(page, "rollback", "window", "5")
        _run(page, "rollback")
        traces = page.evaluate("""() => document.querySelectorAll('#m-rollback .chart')[1].data
            .map(t => [t.name, t.meta || '', (t.line || {}).dash || ''])""")
        previous = [t for t in traces if t[1] == "previous"]
        assert previous and all(t[2] == "dash" and "previous: window=7" in t[0] for t in previous), traces
        assert len(previous) == len(traces) - len(previous)  # each trace of the previous run, once
        assert "Dashed: the previous run (window=7)" in form.locator(".export").inner_text()
        _screenshot(form, "rollback-previous.png")
    assert errors == [], errors


def _cost_numbers(text: str) -> tuple[float, float]:
    found = re.fullmatch(r"\$([\d,.]+) per million tokens, ([\d,.]+) J/token", text.strip())
    assert found, text
    return float(found.group(1).replace(",", "")), float(found.group(2).replace(",", ""))


def test_cost_and_energy_beside_every_throughput(chromium, lab_url, fast_params):
    with _open_page(chromium, lab_url) as (browser, page, errors):
        # the arithmetic: $/M tokens = price per hour / (tok/s x 3600) x 1e6; J/token = W / (tok/s)
        cost = page.evaluate("() => window.labCost.costOf(100, {pricePerHour: 0.36, watts: 50})")
        assert cost["dollarsPerMillion"] == pytest.approx(1.0) and cost["joulesPerToken"] == pytest.approx(0.5)
        cost = page.evaluate("() => window.labCost.costOf(2500, {pricePerHour: 3.0, watts: 700})")
        assert cost["dollarsPerMillion"] == pytest.approx(3.0 / 9e6 * 1e6) and cost["joulesPerToken"] == pytest.approx(0.28)
        assert page.evaluate("() => window.labCost.costOf(0, {pricePerHour: 1, watts: 1})") is None
        # the defaults are stated and in the fields
        assert page.locator("#profile-defaults").inner_text() == "$0.10 per hour, 65 W"
        assert (page.locator("#price-per-hour").input_value(), page.locator("#watts").input_value()) == ("0.1", "65")
        for name, value in fast_params["speculative"].items():
            _set(page, "speculative", name, str(value))
        _run(page, "speculative")
        row = page.locator("#m-speculative tr[data-metric='tok_per_s']")
        rate = float(row.locator("td.value").get_attribute("data-value"))
        dollars, joules = _cost_numbers(row.locator("td.value .cost").inner_text())
        assert dollars == pytest.approx(0.10 / (rate * 3600) * 1e6, rel=5e-3)
        assert joules == pytest.approx(65 / rate, rel=5e-3)
        assert row.locator("td.baseline .cost").count() == 1  # the baseline's throughput too
        assert page.locator("#m-speculative .figure table.data .cost").count() >= 2  # and the tok/s charts' tables
        # an edited profile changes every cost at once and is kept across a reload
        page.locator("#price-per-hour").fill("0.36")
        page.locator("#watts").fill("50")
        dollars, joules = _cost_numbers(row.locator("td.value .cost").inner_text())
        assert dollars == pytest.approx(0.36 / (rate * 3600) * 1e6, rel=5e-3)
        assert joules == pytest.approx(50 / rate, rel=5e-3)
        _screenshot(page.locator("#about"), "profile.png")
        _screenshot(page.locator("#m-speculative table.metrics"), "speculative-cost.png")
        page.reload()
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
        assert (page.locator("#price-per-hour").input_value(), page.locator("#watts").input_value()) == ("0.36", "50")
        page.locator("#profile-reset").click()
        assert page.evaluate("() => localStorage.getItem('k3serve-lab-profile')") is None
        assert page.locator("#watts").input_value() == "65"
    assert errors == [], errors


@pytest.fixture()
def fresh_lab_url(lab_fixtures, monkeypatch):
    """A lab server that has run nothing yet (its own run queue and worker): what a fresh install opens. Its worker
    sees no llama.cpp converter, as in CI, so `peers` shows its recorded figures at once (the live comparison, about
    45 s, is tests/peers/test_lab_peers.py)."""
    from k3serve.lab.api import create_lab_app

    # the worker is spawned with this environment: a named converter tree that is not there makes peers say why and
    # show the record, whether or not llama-cpp-python is installed
    monkeypatch.setenv("K3SERVE_LLAMA_CPP_TREE", "/nonexistent/llama.cpp (hidden by the Run-all test)")
    app = create_lab_app(lab_fixtures)
    try:
        with serve_in_thread(app, lifespan="off", start_timeout=20) as url:
            yield f"{url}/lab/"
    finally:
        app.state.lab_queue.close()


RUN_ALL_LIMIT_SECONDS = 300  # at the defaults: about 3 minutes of runs on a shared 2-core machine (docs/LAB.md)
# Run all queues each module at the page's defaults; the test serves the page FAST_PARAMS as those defaults (Run all
# then takes about 20 s instead of 60-200 s), unless this is set, to time Run all at the real defaults
RUN_ALL_AT_DEFAULTS = os.environ.get("K3SERVE_TEST_RUN_ALL_AT_DEFAULTS", "") == "1"


def test_the_overview_answers_first_and_run_all_gives_every_module_a_verdict(chromium, fresh_lab_url, fast_params):
    import time

    from k3serve.lab.overview import HEADLINES, load_stored_runs
    from k3serve.lab.registry import modules

    stored = load_stored_runs()
    ids = list(modules())
    for module, params in fast_params.items():  # each a parameter of its module, or the page would ignore it
        assert set(params) <= {p.name for p in modules()[module].params}, module
    defaults = None if RUN_ALL_AT_DEFAULTS else fast_params
    with _open_page(chromium, fresh_lab_url, viewport={"width": 1400, "height": 900},
                    defaults=defaults) as (browser, page, errors):
        # before any click: the headline figures and every module's verdict, from the stored runs
        for headline in HEADLINES:
            card = page.locator(f".headline[data-slot='{headline.slot}']")
            if headline.module in stored["runs"]:
                assert card.get_attribute("data-status") == "done", headline.slot
                assert card.locator("[data-role=figure]").inner_text() != "not yet run"
                assert card.locator("[data-role=verdict]").inner_text().strip()
                assert card.locator("[data-badge]").get_attribute("data-badge") in ("recorded", "simulated")
                assert card.locator("[data-role=module-link]").get_attribute("href") == f"#m-{headline.module}"
            else:
                assert card.locator("[data-role=figure]").inner_text() == "not yet run", headline.slot
        rows = page.locator("#verdicts li")
        assert rows.count() == len(ids)
        for module in ids:
            row = page.locator(f"#verdicts li[data-module='{module}']")
            if module in stored["runs"]:
                assert stored["runs"][module]["verdict"]["sentence"] == row.locator("[data-role=verdict]").inner_text()
        assert stored["date"][:10] in page.locator("#overview-meta").inner_text()
        for width in (1400, 400):
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_function("() => document.documentElement.scrollWidth <= window.innerWidth", timeout=5_000)
            _screenshot(page.locator("#overview"), f"overview-{width}.png")
        page.set_viewport_size({"width": 1400, "height": 900})
        started = time.monotonic()
        page.locator("#run-all").click()
        for module in ids:
            section = page.locator(f"#m-{module}")
            left = RUN_ALL_LIMIT_SECONDS - (time.monotonic() - started)
            section.locator("[data-role=result] [data-role=verdict]").wait_for(timeout=max(left, 1) * 1000)
            metric = section.locator("[data-role=result] [data-role=verdict]").get_attribute("data-metric")
            raw = section.locator(f"table.metrics tr[data-metric='{metric}'] td.value").get_attribute("data-value")
            assert raw not in (None, "null") and math.isfinite(float(raw)), (module, metric, raw)
            assert section.locator("[data-role=error]").inner_text() == "", module
        seconds = time.monotonic() - started
        if not RUN_ALL_AT_DEFAULTS:  # Run all filled each form with the defaults the page was served
            for module, params in fast_params.items():
                for name, value in params.items():
                    field = page.locator(f"#m-{module} [data-param='{name}']")
                    shown = str(field.is_checked()) if field.get_attribute("type") == "checkbox" else \
                        field.input_value()
                    assert shown.lower() == str(value).lower(), (module, name, shown, value)
        at = "the defaults" if RUN_ALL_AT_DEFAULTS else "the tests' FAST_PARAMS"
        print(f"Run all at {at}: {len(ids)} modules in {seconds:.0f} s")
        # the overview now shows this server's runs, each with its own date, not the stored ones; the one run that
        # shows a record instead of measuring (peers without llama.cpp) keeps the "recorded" badge, with the record's
        # date
        from k3serve.lab.modules.peers import load_recorded

        record_date = load_recorded()["date"]
        page.wait_for_function("(n) => [...document.querySelectorAll('#verdicts li .badge-recorded')].every("
                               "b => b.closest('li').dataset.module === 'peers') && "
                               "document.querySelectorAll('#verdicts li[data-status=done]').length === n", arg=len(ids))
        body = page.evaluate("async () => (await fetch('api/overview')).json()")
        for entry in body["modules"] + body["headlines"]:
            assert entry["status"] == "done" and entry["source"] == "run on this server", entry
            if entry["module"] == "peers":
                assert (entry["badge"], entry["date"], entry["recorded"]) == ("recorded", record_date, record_date)
            else:
                assert entry["badge"] in ("measured", "simulated") and entry["recorded"] is None, entry
        for where in ("#verdicts li[data-module='peers'] .when", ".headline[data-slot='peers'] .when"):
            assert f"recorded {record_date}" in page.locator(where).first.inner_text(), where
        assert page.locator(".headline[data-slot='serving'] [data-badge]").get_attribute("data-badge") == "measured"
        for width in (1400, 400):
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_function("() => document.documentElement.scrollWidth <= window.innerWidth", timeout=5_000)
            width_now, inner = _overflow(page)
            assert width_now <= inner == width
            _screenshot(page, f"after-run-all-{width}.png")
    assert errors == [], errors
