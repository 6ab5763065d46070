"""Integration modules that need a cached model skip, saying why, when it is missing (no hub: models
come from PyPI packages, which a machine without network cannot fetch)."""
from __future__ import annotations

import pytest


def why_model_missing(name: str) -> str | None:
    """None when the engine imports and model `name` is in the cache; else the reason."""
    try:
        from engine.engine import Engine  # noqa: F401
        from engine.registry import resolve

        resolve(name, auto_pull=False)
    except Exception as e:  # noqa: BLE001
        return f"engine or model {name} not available: {type(e).__name__}: {e}"
    return None


def needs_model(name: str) -> pytest.MarkDecorator:
    """A skip mark (a module's pytestmark, or a decorator) for tests that run model `name`."""
    why = why_model_missing(name)
    return pytest.mark.skipif(why is not None, reason=why or "")
