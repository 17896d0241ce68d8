"""One local Ray (3 logical CPUs) and one 2-replica cluster for the whole test session; both stopped at its end.

Without the cluster extra these tests skip, except under CI (CI=true, `.ci/run` installs the extra), where a
missing Ray fails them.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("CI"):
    import ray  # noqa: F401 - CI installs the cluster extra: its absence is a failure, not a skip
else:
    pytest.importorskip("ray")

from k3serve.cluster.router import RouterConfig  # noqa: E402
from k3serve.cluster.spec import ReplicaSpec  # noqa: E402
from k3serve.engine.config import EngineConfig  # noqa: E402
from k3serve.serve.threaded import serve_in_thread  # noqa: E402

MODEL = "k3-cluster-test"
MAX_MODEL_LEN = 512
ENGINE = EngineConfig(max_model_len=MAX_MODEL_LEN, max_seqs=16, max_batch_tokens=512, kv_cache_bytes=16 << 20,
                      checkpoint_every_blocks=1)


@pytest.fixture(scope="session")
def local_ray():
    import ray

    from k3serve.cluster.runtime import start_ray

    # 3 logical CPUs: the front's 2 replicas, and one for a test's own backend (a streaming replica, or replicas
    # of a fraction of a CPU each)
    start_ray(None, num_cpus=3, replicas=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def front(local_ray):
    """Two replicas of the embedded model behind the cache-aware router (Ray restarts a killed one), served by
    the HTTP API on loopback: yields (url, backend, tokenizer). The app's shutdown stops the replicas."""
    from k3serve.cluster.backend import ClusterBackend
    from k3serve.cli.cluster import front_tokenizer
    from k3serve.serve.api import create_app

    backend = ClusterBackend(ReplicaSpec(model=None, stream=None, engine=ENGINE, speculative=None), 2,
                             RouterConfig(policy="cache-aware"), max_restarts=2)
    tokenizer = front_tokenizer(None)
    with serve_in_thread(create_app(backend, tokenizer, MODEL)) as url:
        yield url, backend, tokenizer
