"""The 8B-shape benchmark model; the recipe now lives in bench/shapes.py (named shapes), this
module keeps the old entry point and names.

    python -m bench.shape_8b            # = python -m bench.shapes 8b-shape
    python -m bench.shape_8b --tiny -o /tmp/tiny.gguf   # = python -m bench.shapes 8b-shape --tiny -o ...
"""
from __future__ import annotations

import sys
from pathlib import Path

from bench import shapes
from bench.shapes import LLAMA3_8B, TINY, Shape, TensorPlan, generate, tensor_bytes, tensor_plan  # noqa: F401

RECIPE = shapes.SHAPES["8b-shape"]
FILENAME = RECIPE.filename
RECIPE_VERSION = RECIPE.recipe_version
RECIPE_KEY = RECIPE.recipe_key


def default_path() -> Path:
    return RECIPE.default_path()


def is_complete(path: Path, shape: Shape = LLAMA3_8B) -> bool:
    return RECIPE.is_complete(path, shape)


def ensure(path: Path | None = None, *, log=print) -> Path:
    return RECIPE.ensure(path, log=log)


def main(argv: list[str] | None = None) -> int:
    return shapes.main(["8b-shape", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
