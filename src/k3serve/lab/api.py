"""The lab's HTTP API and its page, as one FastAPI router (mounted by `k3serve lab` at `/lab`, and by
`k3serve serve` beside the OpenAI API).

    GET    /lab/                          the page (static HTML/CSS/JS from k3serve/lab/web)
    GET    /lab/static/{file}             the page's files; plotly.min.js comes from the installed plotly package
    GET    /lab/api/modules               [{id, number, title, summary, explanation, params: [{name, type, default,
                                           min, max, choices, unit, help}], kind}]
    POST   /lab/api/modules/{id}/run      body: a JSON object of parameters (omitted ones take their defaults).
                                          ?rerun=true measures again instead of returning the cached result;
                                          ?wait=true answers with the finished job (else at once, 202 while queued)
                                          -> {job_id, module, params, status, position, progress, message, cached,
                                              result?: {id, params, measured, metrics, baseline, series, command,
                                                        seconds, ...}, error?}
    GET    /lab/api/overview              the answers-first overview: headline figures and every module's verdict,
                                          from the stored runs (lab/web/stored_runs.json) or this server's latest run
    GET    /lab/api/jobs                  {"jobs": [job record, ...]}: the running job, then the queued ones in order
    GET    /lab/api/jobs/{job_id}         the same job record, to poll progress and fetch the result
    GET    /lab/api/jobs/{job_id}/result.json   a finished job's result record, as a download
    GET    /lab/api/jobs/{job_id}/result.csv    the same as CSV: one row per metric and per plotted point (lab/export.py)
    DELETE /lab/api/jobs/{job_id}         cancel: a queued job never starts, a running one stops at its next check or
                                          its worker process is killed (lab/worker.py)

Errors: `{"error": {"message", "param"}}`; an unknown or out-of-range parameter is a 400 naming it, an unknown
module or job a 404, the result of a job that has none (yet) a 409, a new job while the queue holds `max_queued` (16) jobs a 429.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from k3serve.lab.export import result_csv
from k3serve.lab.fixtures import LabFixtures
from k3serve.lab.jobs import LabQueueConfig, LabQueueFull, RunQueue
from k3serve.lab.overview import (STORED_RUNS_PATH, clean, empty_stored_runs, load_stored_runs, overview,
                                  stored_runs_for)
from k3serve.lab.registry import LabParamError, UnknownModuleError, get_module, modules

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).parent / "web"
STATIC_FILES = {"index.html": "text/html", "lab.css": "text/css", "lab.js": "text/javascript"}
WAIT_LIMIT_SECONDS = 600.0


def plotly_js_path() -> Path:
    """The plotly.js bundle shipped inside the `plotly` pip package (never a CDN)."""
    bundle = resources.files("plotly") / "package_data" / "plotly.min.js"
    path = Path(str(bundle))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the plotly package has no bundled plotly.min.js (pip install plotly)")
    return path


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "param": param}}, status_code=status)


def create_lab_router(queue: RunQueue, stored_runs: Path = STORED_RUNS_PATH) -> APIRouter:
    """The routes above, relative to where the router is included (prefix '/lab')."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html")

    @router.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if name == "plotly.min.js":
            return FileResponse(plotly_js_path(), media_type="text/javascript")
        if name not in STATIC_FILES:
            return _error(404, f"no file {name!r}")
        return FileResponse(WEB_DIR / name, media_type=STATIC_FILES[name])

    @router.get("/api/modules")
    def list_modules() -> list[dict]:
        return [m.to_json(queue.fixtures) for m in modules().values()]

    @router.post("/api/modules/{module_id}/run")
    async def run(module_id: str, request: Request, rerun: bool = False, wait: bool = False) -> JSONResponse:
        try:
            module = get_module(module_id)
        except UnknownModuleError as exc:
            return _error(404, str(exc))
        raw = await request.body()
        try:
            body = {} if not raw.strip() else await request.json()
        except ValueError:
            return _error(400, "the body must be a JSON object of parameters")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object of parameters")
        try:
            job = queue.submit(module, body, rerun=rerun)
        except LabParamError as exc:
            return _error(400, str(exc), exc.param)
        except LabQueueFull as exc:
            return _error(429, str(exc))
        if wait:
            await asyncio.get_running_loop().run_in_executor(None, job.done_event.wait, WAIT_LIMIT_SECONDS)
        return JSONResponse(queue.snapshot(job), status_code=200 if job.finished else 202)

    try:
        stored, stored_error = stored_runs_for(load_stored_runs(stored_runs), queue.fixtures.model_arg)
    except ValueError as exc:  # the page still works; the overview says what is wrong
        logger.error("%s", exc)
        stored, stored_error = empty_stored_runs(), str(exc)

    @router.get("/api/overview")
    def answers_first() -> JSONResponse:
        listing = [m.to_json() for m in modules().values()]
        body = overview(listing, stored, queue.latest())
        body["stored"]["error"] = stored_error
        return JSONResponse(clean(body))

    @router.get("/api/jobs")
    def active_jobs() -> dict:
        # max_queued: how many may wait, so that Run all waits for room instead of being refused (a 429)
        return {"jobs": queue.active(), "max_queued": queue.config.max_queued}

    @router.get("/api/jobs/{job_id}")
    def job_status(job_id: str) -> JSONResponse:
        job = queue.get(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        return JSONResponse(queue.snapshot(job))

    @router.get("/api/jobs/{job_id}/result.{extension}")
    def job_result(job_id: str, extension: str) -> Response:
        job = queue.get(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        if extension not in ("json", "csv"):
            return _error(404, f"no export {extension!r}; there are result.json and result.csv")
        record = queue.snapshot(job).get("result")
        if record is None:
            return _error(409, f"job {job_id!r} has no result ({job.status})")
        filename = f"{job.module.id}-{job_id}.{extension}"
        headers = {"Content-Disposition": f'attachment; filename="{filename}"'}
        if extension == "json":
            return JSONResponse(record, headers=headers)
        return Response(result_csv(record), media_type="text/csv", headers=headers)

    @router.delete("/api/jobs/{job_id}")
    def cancel(job_id: str) -> JSONResponse:
        job = queue.cancel(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        return JSONResponse(queue.snapshot(job))

    return router


def mount_lab(app, fixtures: LabFixtures, prefix: str = "/lab", config: LabQueueConfig | None = None,
              stored_runs: Path = STORED_RUNS_PATH) -> RunQueue:
    """Add the lab to an existing FastAPI app (its own run queue); returns the queue (close it on shutdown)."""
    queue = RunQueue(fixtures, config)
    app.include_router(create_lab_router(queue, stored_runs), prefix=prefix)

    @app.get(prefix, include_in_schema=False)
    def lab_root() -> RedirectResponse:
        return RedirectResponse(prefix + "/")

    return queue


def create_lab_app(fixtures: LabFixtures, config: LabQueueConfig | None = None,
                   stored_runs: Path = STORED_RUNS_PATH):
    """The lab alone (`k3serve lab`): the page at /lab/, and / redirects there."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    holder: dict = {}

    @asynccontextmanager
    async def lifespan(_app):
        yield
        holder["queue"].close()

    app = FastAPI(title="k3serve lab", lifespan=lifespan)
    holder["queue"] = mount_lab(app, fixtures, config=config, stored_runs=stored_runs)
    app.state.lab_queue = holder["queue"]

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/lab/")

    return app
