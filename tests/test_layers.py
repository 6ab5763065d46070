"""The house's layering: engine <- jobs <- pipeline, nothing upward; pipeline modules stay small."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_PIPELINE_MODULE_LINES = 400


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):  # function-local imports count too
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _upward_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imported_modules(path):
            if name.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def test_jobs_imports_nothing_from_pipeline():
    assert _upward_imports("jobs", ("pipeline",)) == []


def test_engine_imports_neither_jobs_nor_pipeline():
    assert _upward_imports("engine", ("jobs", "pipeline")) == []


def test_failures_are_recorded_in_one_place():
    """jobs.outcomes.record_failure is the only code that builds a failed JobResult for the ledger."""
    builders = []
    for package in ("jobs", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "JobResult.failed(" in path.read_text(encoding="utf-8"):
                builders.append(str(path.relative_to(ROOT)))
    assert builders == ["jobs/outcomes.py"]


def test_pipeline_modules_stay_small():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "pipeline").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_PIPELINE_MODULE_LINES}
    assert long == {}
