"""rqllm's inference engine: GGUF weights mapped in place, compiled kernels, a budgeted KV cache."""
import os

# The engine computes with its own OpenMP threads and never calls BLAS; numpy's BLAS thread pool
# only competes with them for the cores (measured: +10 % wall time on 200 short jobs with 2 threads
# on 2 cores). Set before any engine module imports numpy; an explicit setting wins.
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
from engine.params import Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams", "EngineError"]


def __getattr__(name: str):
    # Engine pulls in the compiled kernels; importing the params alone must stay cheap.
    if name in ("Engine", "EngineError"):
        from engine import engine as _engine

        return getattr(_engine, name)
    raise AttributeError(name)
