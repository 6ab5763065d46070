"""The engine keeps numpy's BLAS thread pool out of the way of its own OpenMP threads."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

COUNT_THREADS = "import os, sys; {imports}; print(len(os.listdir('/proc/self/task')))"


def _threads_after(imports: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", COUNT_THREADS.format(imports=imports)], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_importing_the_engine_starts_no_blas_threads():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: numpy starts no BLAS pool, nothing to compare")
    plain = _threads_after("import numpy")
    assert plain > 1, "numpy alone should start its BLAS pool here; the comparison below means nothing"
    assert _threads_after("import engine.model, engine.engine") == 1
