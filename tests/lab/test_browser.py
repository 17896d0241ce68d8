"""The lab page in a real browser: Playwright driving Debian's Chromium (/usr/bin/chromium, never a downloaded one).

Opens the page served by uvicorn, runs every module (at the API tests' reduced sizes), changes a parameter in three
modules and checks that their numbers and charts change, that every figure carries its mark and command, and that
the console shows no errors. Screenshots of each module go to out/lab/ (git-ignored). Without chromium the test
skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3serve.serve.threaded import serve_in_thread

CHROMIUM = Path(os.environ.get("K3SERVE_CHROMIUM", "/usr/bin/chromium"))
SCREENSHOTS = Path(__file__).resolve().parents[2] / "out" / "lab"
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


def test_the_page_in_chromium(lab_url, fast_params):
    _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    from k3serve.lab.registry import modules

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(lab_url)
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
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
                assert figure.locator(".mark").inner_text() in ("measured on this machine", "simulated (model)")
                assert figure.locator(".command code").inner_text().startswith(f"k3serve lab run {module}")
                assert figure.locator(".chart .main-svg").count() >= 1  # plotly drew it
            page.locator(f"#m-{module}").screenshot(path=str(SCREENSHOTS / f"{module}.png"))
        for module, (name, value, metric) in CHANGES.items():
            charts_before = _chart_data(page, module)
            _set(page, module, name, value)
            second = _run(page, module)
            assert second[metric] != first[module][metric], (module, metric)
            assert _chart_data(page, module) != charts_before, module
            page.locator(f"#m-{module}").screenshot(path=str(SCREENSHOTS / f"{module}-changed.png"))
        # a bad value is shown beside the form, not thrown
        _set(page, "mxfp4", "rows", "0")
        page.locator("#m-mxfp4 [data-action='run']").click()
        page.wait_for_function("() => document.querySelector('#m-mxfp4 [data-role=error]').textContent.includes('rows')")
        page.screenshot(path=str(SCREENSHOTS / "page.png"), full_page=True)
        browser.close()
    expected = "the server responded with a status of 400"  # the bad value above, shown on the page
    assert [e for e in errors if expected not in e] == [], errors


HEAVY_CLUSTER_SCALE = {"groups": "1024", "per_group": "256", "max_replicas": "64", "replicas": "64",
                       "clients": "1024", "seeds": "20"}  # many minutes of simulation


def test_a_reloaded_page_reattaches_to_its_jobs_and_the_queue_panel_cancels(lab_url):
    _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(lab_url)
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
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
        page.screenshot(path=str(SCREENSHOTS / "queue.png"))
        panel.nth(0).locator("[data-action='cancel-job']").click()
        # the queue moves on: the queued run starts and its result appears on the reloaded page
        page.locator("#m-mxfp4 table.metrics").wait_for(timeout=60_000)
        page.wait_for_function("() => document.querySelector('#m-cluster_scale [data-role=message]').textContent"
                               ".startsWith('cancelled')")
        assert page.locator("#m-cluster_scale").get_attribute("data-state") == "idle"
        page.wait_for_selector("#queue-jobs li.empty", timeout=10_000)
        browser.close()
    assert errors == [], errors
