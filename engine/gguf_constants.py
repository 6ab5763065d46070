"""The GGUF format's constants (value types, ggml types, block sizes, magic) from the `gguf` package's
own constants module, without importing the package.

`import gguf` runs gguf/__init__.py, which also loads its writer, reader, quantizers, vocabulary and
metadata modules (yaml, numpy helpers...): ~45 ms of a worker's start-up for five names we use.
gguf/constants.py needs only the standard library, so it is loaded on its own under a private name
(the real `gguf.constants` would leave the package without its `constants` attribute when something
imports `gguf` later). If `gguf` is already imported, its module is used. The enums are IntEnums:
members compare and hash as their integer values, so they mix with the package's own freely.
"""
from __future__ import annotations

import importlib.util
import os
import sys


def _load_constants():
    if "gguf.constants" in sys.modules:  # the package is loaded anyway: nothing to save
        return sys.modules["gguf.constants"]
    name = "engine._gguf_constants_impl"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("gguf")  # finds the package without running its __init__
    if package is None or not package.submodule_search_locations:
        raise ImportError("the gguf package is not installed (pip install gguf)")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(list(package.submodule_search_locations)[0], "constants.py"))
    if spec is None or spec.loader is None:
        raise ImportError("gguf/constants.py not found in the gguf package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the module's dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_constants = _load_constants()

GGML_QUANT_SIZES = _constants.GGML_QUANT_SIZES
GGUF_DEFAULT_ALIGNMENT = _constants.GGUF_DEFAULT_ALIGNMENT
GGUF_MAGIC = _constants.GGUF_MAGIC
GGMLQuantizationType = _constants.GGMLQuantizationType
GGUFValueType = _constants.GGUFValueType

__all__ = ["GGML_QUANT_SIZES", "GGUF_DEFAULT_ALIGNMENT", "GGUF_MAGIC", "GGMLQuantizationType", "GGUFValueType"]
