"""The lab's worker process over the weights a server shared (`LabFixtures(shared_weights=...)`, as `k3serve serve`
mounts it): the worker's model weights are read-only views inside the server's own memory file (same inode), its
logits are the server's bit for bit, a real module's result is the one the worker's own copy gives, and a worker
that was killed and replaced maps the same pages again.

The probe's functions are defined at the top level: the worker process imports them by name."""

from __future__ import annotations

import numpy as np
import pytest

from _shared_weights import PROMPT, inside, memfd_spans, weight_arrays
from k3serve.lab.fixtures import LabFixtures
from k3serve.lab.jobs import RunQueue
from k3serve.lab.registry import CancelToken, LabModule, LabResult, Param, get_module
from k3serve.loading import load_model
from k3serve.weights.shared_pages import supported

pytestmark = pytest.mark.skipif(not supported(), reason="shared pages need Linux's memfd_create")


def probe(params, progress, cancel, lab) -> LabResult:
    """In the worker: where the lab model's weights live, and its logits on PROMPT."""
    import os

    loaded = lab.loaded()
    inode = loaded.shared_weights.arrays.pages.inode
    spans = memfd_spans(inode)
    arrays = weight_arrays(loaded.model.source)
    logits = loaded.model.logits(PROMPT)  # [T, V]
    return LabResult({"inode": float(inode), "pid": float(os.getpid()), "arrays": float(len(arrays)),
                      "read_only": float(all(not a.flags.writeable for a in arrays)),
                      "in_shared_pages": float(all(inside(a, spans) for a in arrays)),
                      "logits_sum": float(logits.astype(np.float64).sum()), "logit_first": float(logits[0, 0]),
                      "logit_last": float(logits[-1, -1])}, {}, [])


def stuck(params, progress, cancel, lab) -> LabResult:
    import time

    time.sleep(3600)
    return LabResult({}, {}, [])


PROBE = LabModule(id="probe", number=91, title="probe", summary="s", explanation="e", kind="simulated",
                  params=(Param("x", "int", 1, min=0, max=100),), run=probe)
STUCK = LabModule(id="stuck", number=92, title="stuck", summary="s", explanation="e", kind="simulated",
                  params=(Param("x", "int", 1, min=0, max=100),), run=stuck)


@pytest.fixture(scope="module")
def served():
    """What `serve` holds beside the lab: the embedded model, its weights in shared pages."""
    return load_model(None, share_weights=True)


@pytest.fixture(scope="module")
def lab_cache(served, tmp_path_factory):
    """A lab cache folder whose held-out tokens are this file's text (building the corpus's takes ~30 s)."""
    import json
    from pathlib import Path

    root = tmp_path_factory.mktemp("lab-cache")
    text = Path(__file__).read_text()
    streams = {"code": served.tokenizer.encode(text), "prose": served.tokenizer.encode(text.replace("_", " "))}
    (root / "heldout_tokens.json").write_text(json.dumps(streams))
    return root


@pytest.fixture(scope="module")
def queue(served, lab_cache):
    queue = RunQueue(LabFixtures(cache_dir=lab_cache, shared_weights=served.shared_weights))
    yield queue
    queue.close()


def _run(queue: RunQueue, module: LabModule, params: dict, rerun: bool = True) -> dict:
    job = queue.submit(module, params, rerun=rerun)
    assert job.done_event.wait(300)
    assert job.status == "done", job.error
    return job.result["metrics"]


def test_the_worker_model_reads_the_servers_pages_read_only(queue, served):
    metrics = _run(queue, PROBE, {"x": 1})
    assert metrics["inode"] == served.shared_weights.arrays.pages.inode
    assert metrics["arrays"] > 50 and metrics["read_only"] == 1.0 and metrics["in_shared_pages"] == 1.0
    logits = served.model.logits(PROMPT)
    assert metrics["logits_sum"] == float(logits.astype(np.float64).sum())
    assert metrics["logit_first"] == float(logits[0, 0]) and metrics["logit_last"] == float(logits[-1, -1])


def test_a_module_gives_the_result_of_the_workers_own_copy(queue, lab_cache, fast_params):
    """The speculative module's acceptance (greedy: deterministic) over the shared weights, and over a copy the lab
    loads itself, as it did before the weights were shared."""
    module = get_module("speculative")
    params = module.validate(fast_params["speculative"], queue.fixtures)
    shared = _run(queue, module, params)
    own = LabFixtures(cache_dir=lab_cache)
    assert own.shared_weights is None
    alone = module.run(params, lambda fraction, message: None, CancelToken(), own).metrics
    for key in ("acceptance_pct", "tokens_per_forward", "forwards"):  # the timings differ, these cannot
        assert shared[key] == alone[key], key


def test_a_replaced_worker_maps_the_same_pages_again(queue, served):
    first = _run(queue, PROBE, {"x": 2})
    job = queue.submit(STUCK, {"x": 1})
    while job.status != "running":
        job.done_event.wait(0.05)
    queue.cancel(job.id)  # the stuck run never checks: its worker process is killed
    assert job.done_event.wait(30) and job.status == "cancelled"
    second = _run(queue, PROBE, {"x": 3})
    assert second["pid"] != first["pid"]
    assert second["inode"] == first["inode"] == served.shared_weights.arrays.pages.inode
    assert second["in_shared_pages"] == 1.0 and second["logits_sum"] == first["logits_sum"]
