"""rqllm's inference engine: GGUF weights mapped in place, compiled kernels, a budgeted KV cache."""
from engine.params import Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams", "EngineError"]


def __getattr__(name: str):
    # Engine pulls in the compiled kernels; importing the params alone must stay cheap.
    if name in ("Engine", "EngineError"):
        from engine import engine as _engine

        return getattr(_engine, name)
    raise AttributeError(name)
