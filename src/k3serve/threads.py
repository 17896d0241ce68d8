"""How the compiled kernels' threads wait between parallel regions: fast on an idle machine, harmless on a loaded
one (issue 33).

A decode step runs a few hundred short parallel regions (each layer's projections and experts) with Python in
between. Between two regions libgomp's workers either spin (`OMP_WAIT_POLICY=ACTIVE`, or libgomp's default: spin
300,000 iterations, then sleep) or sleep at once (`PASSIVE`). Measured on the 2-core VM (a Firecracker guest),
widened K3 decode (benchmarks/bench_wait_policy.py, docs/BENCHMARKS.md "How the kernels' threads wait"):
- idle, sleeping workers cost 1.46x against spinning ones (10.29 against 7.06 ms a token): a sleeping worker's core
  halts, and waking a halted virtual CPU for every region costs tens of microseconds;
- beside another 2-thread job, spinning workers take the time slices the working threads need: 1.4-1.7x slower
  than sleeping ones (2.7-7.3x beside two busy loops, older code). Running on one thread beside the job is no cure either (the
  scheduler shares the cores per thread, so one thread gets less than two sleeping ones).
libgomp reads its setting once per process, so no choice of it is right in both cases. What k3serve does instead
(`K3SERVE_WAIT_POLICY=adaptive`, the default):
- the workers sleep at once (`OMP_WAIT_POLICY=PASSIVE`), and
- while forwards are running, `CoreKeeper` keeps the cores the kernels' threads run on (one keeper per core, up to
  the thread count; `K3SERVE_CORE_KEEPERS` sets another number) busy with threads of the `SCHED_IDLE` class: they spin in compiled code (no GIL held), so a worker's core never halts and its wake-up is a context
  switch, not a virtual CPU's exit from halt; the kernel runs an idle-class thread only when nothing else wants the
  core, and preempts it the moment anything does, so on a loaded machine the keepers get (almost) no time and
  the workers behave exactly as PASSIVE ones. Tens of milliseconds after the last forward the keepers stop
  spinning and poll every few milliseconds.
Measured: 8.69 ms idle (1.18x of the 1.46x recovered) and 12.14 ms beside the job, the best of every setting there;
at batch 8 the keepers measured 12% slower than PASSIVE, not explained yet (docs/BENCHMARKS.md). Remeasured on
2026-12-08 with two real-width families (docs/BENCHMARKS.md, "How the kernels' threads wait, at real widths"): idle,
the keepers were worth -3% to +12% against PASSIVE and ACTIVE ran 1.07-1.24x the default; beside the job the keepers
ran 1.11-1.29x slower than PASSIVE (runs 1.5-1.8x apart) and ACTIVE 2.1-2.9x: the default is not settled.
`K3SERVE_SPIN=N` adds a spin of N pauses before a worker sleeps (off by default: 10-16% faster idle, 32-47% slower
beside a job). `K3SERVE_WAIT_POLICY=passive` is PASSIVE without keepers (k3serve's default before 2026-12-06 evening), `active`
is ACTIVE; an explicit `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` in the environment is respected (no keepers). The
keepers are not started where the process's CPU time is capped by a cgroup quota (their spinning would spend the
quota), on one core, or where `SCHED_IDLE` is refused. Their spinning shows as CPU use in `top` while the engine
works; it is time no other task wanted.

Results never depend on any of this: threads and keepers change when a kernel runs, not what it computes.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = "K3SERVE_WAIT_POLICY"
WAIT_POLICIES = ("adaptive", "passive", "active")
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_ENV = "K3SERVE_SPIN"
KEEPERS_ENV = "K3SERVE_CORE_KEEPERS"  # how many keepers (default: one per core the kernels' threads use)
POLICY: str | None = None  # what configure_wait_policy decided for this process

# the keepers' shared state: a generation bumped at each forward's start and end, the forwards in flight, stop
GENERATION, IN_FLIGHT, STOP, SPINS = 0, 1, 2, 3
SPIN_ITERATIONS = 64  # one spin chunk: 64 `pause`s (a few microseconds), then the state again
QUIET_CHUNKS = 5_000  # chunks without a forward before a keeper stops spinning (tens of milliseconds)
POLL_MICROS = (2_000, 20_000)  # a stopped keeper's poll interval: right after activity, and after a second idle


def configure_wait_policy(environ: dict[str, str] | None = None) -> str:
    """Set the OpenMP variables for `K3SERVE_WAIT_POLICY` before numba starts its pool (model/kernels.py calls
    this at import) and return the policy in force: "adaptive", "passive", "active", or "explicit" when the
    environment already names an OpenMP wait setting. An unknown policy is logged and taken as adaptive."""
    env = os.environ if environ is None else environ
    policy = env.get(WAIT_POLICY_ENV, "adaptive").strip().lower() or "adaptive"
    if policy not in WAIT_POLICIES:
        logger.warning("%s=%r is not one of %s; using adaptive", WAIT_POLICY_ENV, env[WAIT_POLICY_ENV],
                       ", ".join(WAIT_POLICIES))
        policy = "adaptive"
    if any(name in env for name in OPENMP_WAIT_VARIABLES):
        policy = "explicit"
    elif policy == "adaptive" and _spin_count(env):
        env["GOMP_SPINCOUNT"] = str(_spin_count(env))  # a short spin, then sleep (libgomp's policy left unset)
    elif policy in ("adaptive", "passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["OMP_WAIT_POLICY"] = "ACTIVE"
    if environ is None:
        global POLICY
        POLICY = policy
    return policy


def _spin_count(env) -> int:
    """K3SERVE_SPIN: pause iterations libgomp's workers spin before they sleep under the adaptive policy (0: sleep
    at once, the default)."""
    try:
        return max(0, int(env.get(SPIN_ENV, "0") or 0))
    except ValueError:
        logger.warning("%s=%r is not an integer; no spin", SPIN_ENV, env[SPIN_ENV])
        return 0


def workers_spin(environ: dict[str, str] | None = None) -> bool:
    """Whether the kernels' OpenMP workers spin between parallel regions under the environment libgomp reads (after
    `configure_wait_policy`): OMP_WAIT_POLICY=ACTIVE (`K3SERVE_WAIT_POLICY=active`, or set by the user), a spin count
    (GOMP_SPINCOUNT, `K3SERVE_SPIN`), or libgomp's own default where neither variable is set (~300,000 pauses, then
    sleep). PASSIVE, or a spin count of 0, sleeps at once. Spinning workers hold their cores between the kernels'
    regions, so OpenBLAS's own threads, woken by a numpy matmul in between, share those cores with them
    (`loading.configure_threads` then gives BLAS one thread)."""
    env = os.environ if environ is None else environ
    policy = env.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy in ("ACTIVE", "PASSIVE"):
        return policy == "ACTIVE"
    count = env.get("GOMP_SPINCOUNT", "").strip().lower()
    if not count or count in ("infinite", "infinity"):
        return True  # libgomp's default spin, or an endless one
    digits = count.rstrip("kmgt")
    return not digits.isdigit() or int(digits) > 0  # libgomp ignores a value it cannot read: its default spin


def cpu_quota_cores(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU time quota of this process's cgroup in cores (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`), or
    None where there is none (or no cgroup file to read)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[0] == "0" or "cpu" in parts[1].split(",")):
            candidates.append(os.path.join(root, parts[2].lstrip("/"), "cpu.max"))
            candidates.append(os.path.join(root, "cpu", parts[2].lstrip("/"), "cpu.cfs_quota_us"))
    candidates += [os.path.join(root, "cpu.max"), os.path.join(root, "cpu", "cpu.cfs_quota_us")]
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read().split()
        except OSError:
            continue
        if path.endswith("cpu.max"):
            if text and text[0] != "max":
                return int(text[0]) / int(text[1] if len(text) > 1 else 100_000)
            return None
        quota = int(text[0]) if text else -1
        if quota > 0:
            try:
                with open(path.replace("cpu.cfs_quota_us", "cpu.cfs_period_us")) as f:
                    return quota / int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                return None
        return None
    return None


@intrinsic
def _usleep(typingctx, micros):
    """libc's usleep(micros) from compiled code (the keepers sleep without taking the GIL)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                                            "usleep")
        return builder.call(fn, [builder.trunc(args[0], ir.IntType(32))])
    return types.int32(micros), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _spin_pause(typingctx):
    """The spin-wait hint (`pause` on x86; nothing elsewhere)."""
    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@njit(nogil=True, cache=True)
def keep_core(state, spin_iterations, quiet_chunks, poll_short, poll_long):
    """The keepers' loop, without the GIL: spin in chunks while a forward is in flight or the generation moved
    within `quiet_chunks` chunks, else sleep `poll_short` microseconds (`poll_long` after 500 polls), until
    state[STOP]."""
    seen = state[GENERATION]
    quiet = quiet_chunks  # start stopped: nothing ran yet
    polls = 0
    x = np.uint64(1)
    while state[STOP] == 0:
        generation = state[GENERATION]
        if generation != seen or state[IN_FLIGHT] > 0:
            seen = generation
            quiet = 0
            polls = 0
        if quiet < quiet_chunks:
            for _ in range(spin_iterations):
                _spin_pause()  # x86's `pause`: leaves a hyperthread sibling its share of the core
                x = x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
            state[SPINS] += 1  # approximate where several keepers add at once
            quiet += 1
        else:
            _usleep(poll_short if polls < 500 else poll_long)
            polls += 1
    return x


class CoreKeeper:
    """Idle-class threads that spin while forwards run (module docstring). `begin()` / `end()` bracket each
    outermost forward; they write two integers under a lock, so they cost nothing measurable."""

    def __init__(self, keepers: int) -> None:
        self.keepers = keepers
        self.state = np.zeros(4, np.int64)
        self.threads: list[threading.Thread] = []
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.error: str | None = None

    @property
    def running(self) -> bool:
        return bool(self.threads) and self._pid == os.getpid()

    def start(self) -> bool:
        """Start the keepers (once per process; again in a forked child). False where they cannot run."""
        with self._lock:
            if self.running:
                return True
            if self.error is not None or self.keepers < 1:
                return False
            self.state[:] = 0
            self._pid = os.getpid()
            ready = threading.Barrier(self.keepers + 1)
            outcome: list[str] = []

            def run() -> None:
                try:
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
                except (AttributeError, OSError) as exc:
                    outcome.append(f"SCHED_IDLE refused: {exc}")
                    ready.wait()
                    return
                ready.wait()
                keep_core(self.state, SPIN_ITERATIONS, QUIET_CHUNKS, POLL_MICROS[0], POLL_MICROS[1])

            keep_core(np.array([0, 0, 1, 0], np.int64), 1, 1, 1, 1)  # compiled (or loaded) here, once
            self.threads = [threading.Thread(target=run, name=f"k3serve-core-keeper-{i}", daemon=True)
                            for i in range(self.keepers)]
            for thread in self.threads:
                thread.start()
            ready.wait()
            if outcome:
                self.error = outcome[0]
                self.stop()
                self.threads = []
                logger.info("core keepers not started: %s", self.error)
                return False
            logger.info("core keepers: %d idle-class threads spin while forwards run", self.keepers)
            return True

    def begin(self) -> None:
        with self._count_lock:  # forwards in several threads: a lost update would leave the keepers spinning
            self.state[IN_FLIGHT] += 1
            self.state[GENERATION] += 1

    def end(self) -> None:
        with self._count_lock:
            self.state[IN_FLIGHT] -= 1
            self.state[GENERATION] += 1

    def stop(self) -> None:
        self.state[STOP] = 1

    @property
    def spins(self) -> int:
        """Spin chunks the keepers have run (a measure of the time they took; 0 on a machine that never let them)."""
        return int(self.state[SPINS])


class WaitGovernor:
    """The process's choice of how kernel threads wait, applied around each outermost forward."""

    def __init__(self, policy: str, threads: int | None = None, cores: int | None = None,
                 quota: float | None = None, keepers: int | None = None) -> None:
        self.policy = policy
        self._local = threading.local()
        self.keeper: CoreKeeper | None = None
        self.reason = ""
        if policy != "adaptive":
            self.reason = f"policy {policy}"
            logger.info("no core keepers: %s", self.reason)
            return
        if threads is None:
            threads = numba_config.NUMBA_NUM_THREADS
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        keepers = min(threads, cores) if keepers is None else keepers
        if quota is not None:
            self.reason = f"CPU quota of {quota:g} cores (spinning would spend it)"
        elif min(threads, cores) < 2:
            self.reason = "one thread or one core"
        elif keepers < 1:
            self.reason = f"{KEEPERS_ENV}=0"
        else:
            self.keeper = CoreKeeper(keepers)
        if self.reason:
            logger.info("no core keepers: %s", self.reason)

    @contextmanager
    def step(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        keeper = self.keeper if depth == 0 else None
        if keeper is not None and not keeper.running and not keeper.start():
            self.reason, self.keeper, keeper = keeper.error or "not started", None, None
        self._local.depth = depth + 1
        if keeper is not None:
            keeper.begin()
        try:
            yield
        finally:
            self._local.depth = depth
            if keeper is not None:
                keeper.end()


GOVERNOR: WaitGovernor | None = None


def governor() -> WaitGovernor:
    """The process's wait governor, made on first use (model/kernels.py configured the policy at import)."""
    global GOVERNOR
    if GOVERNOR is None:
        policy = POLICY if POLICY is not None else configure_wait_policy(dict(os.environ))
        try:
            keepers = int(os.environ[KEEPERS_ENV]) if os.environ.get(KEEPERS_ENV, "").strip() else None
        except ValueError:
            logger.warning("%s=%r is not an integer; using the default", KEEPERS_ENV, os.environ[KEEPERS_ENV])
            keepers = None
        GOVERNOR = WaitGovernor(policy, quota=cpu_quota_cores() if policy == "adaptive" else None, keepers=keepers)
    return GOVERNOR


def governed(forward):
    """Decorator for a model's `forward`: each outermost call is one governed step."""
    def wrapper(*args, **kwargs):
        with governor().step():
            return forward(*args, **kwargs)
    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = forward.__name__, forward.__qualname__, forward.__doc__
    wrapper.__wrapped__ = forward
    return wrapper
