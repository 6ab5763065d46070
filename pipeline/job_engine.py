"""The engine as a worker's tasks see it (jobs.runtime.WorkerContext.engine, set by pipeline.worker)."""
from __future__ import annotations

from typing import Any


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
