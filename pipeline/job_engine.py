"""The engine as a worker's tasks see it (jobs.runtime.WorkerContext.engine, set by pipeline.worker), and how a
worker loads it (load_engine) and describes it in its start-up line (describe_engine)."""
from __future__ import annotations

import logging
from typing import Any

# The repacked cache's progress and warnings while the engine loads (before rq's work loop starts).
log_repack = logging.getLogger("rqllm.repack")


class JobEngine:
    """The engine, except that generate() also stops the chat template's rendering when the job must stop
    (its timeout, a forced stop: the task's should_stop), which the engine itself checks only between
    tokens; such a stop is the engine's EngineInterrupted, as between tokens (engine.chat.RenderStopped)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, should_stop: Any = None, **kwargs: Any) -> Any:
        from engine.chat import RenderStopped, stop_rendering_when
        from engine.engine import EngineInterrupted

        try:
            with stop_rendering_when(should_stop):
                return self._engine.generate(*args, should_stop=should_stop, **kwargs)
        except RenderStopped as e:
            raise EngineInterrupted(str(e)) from None


def load_engine(model: str, threads: int | None, kv_budget: str | None, repack: bool | None = None,
                draft: str | None = None, speculative: str = "off") -> Any:
    """draft / speculative: engine.Engine's (a draft model; the mode for jobs that do not choose one)."""
    from engine import repack as repack_cache
    from engine.engine import Engine

    kw: dict[str, Any] = {"threads": threads, "repack": repack, "draft": draft, "speculative": speculative,
                          "repack_progress": repack_cache.LogProgress(model, logger=log_repack)}
    if kv_budget:
        kw["kv_budget"] = kv_budget
    return Engine(model, **kw)


def describe_engine(engine: Any) -> str:
    """The start-up line's end: the weights (repacked cache or GGUF layout, and why) and speculative
    decoding (the jobs' default mode and the draft model)."""
    layout = getattr(getattr(engine, "model", None), "layout", None)
    draft = getattr(engine, "draft", None)
    return (f"weights: {layout.reason if layout is not None else 'weight layout unknown'}; speculative "
            f"decoding: {getattr(engine, 'speculative', 'off')} by default"
            + (f", draft model {draft.name}" if draft is not None else ""))
