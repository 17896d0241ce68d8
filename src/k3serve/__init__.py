"""k3serve: CPU inference and serving for sparse Mixture-of-Experts models of the Kimi K3 family."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenBLAS (numpy's BLAS) reads OPENBLAS_THREAD_TIMEOUT once, when numpy loads it. At its default its workers spin
# for about 2^28 cycles (~0.1 s) after every threaded call before they sleep, and so took a core from the compiled
# kernels' threads after each threaded BLAS call (a router's matmul at batch 8, the attention at prefill): at
# Qwen3-30B-A3B's widths, batch-8 decode ran 1.7x and prefill 1.2x slower (docs/BENCHMARKS.md, "OpenBLAS's spinning
# workers"). 4 (2^4 cycles, OpenBLAS's least) lets them sleep at once; a value the user set is kept. Where numpy
# was imported before k3serve the setting comes too late for this process (`loading.configure_threads` warns).
OPENBLAS_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
OPENBLAS_TIMEOUT = "4"
OPENBLAS_TIMEOUT_IN_FORCE = OPENBLAS_TIMEOUT_ENV in _os.environ or "numpy" not in _sys.modules
_os.environ.setdefault(OPENBLAS_TIMEOUT_ENV, OPENBLAS_TIMEOUT)
