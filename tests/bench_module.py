"""Import a script from bench/ (not a package) so tests can reuse its code."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_module(name: str) -> ModuleType:
    """bench/<name>.py as module `name` (registered in sys.modules: dataclasses and pickling need it)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
