"""Build the engine's compiled kernels.

Portable on purpose: no -march=native. SIMD variants carry their own
__attribute__((target(...))) and are chosen at run time from CPU flags.
"""
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

KERNELS = "engine/kernels"
COMMON = dict(
    include_dirs=[KERNELS, numpy.get_include()],
    extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function"],
    extra_link_args=["-fopenmp"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

extensions = [
    # Quantized dot products, matmuls and their reference twins.
    Extension("engine.kernels._quants", [f"{KERNELS}/_quants.pyx", f"{KERNELS}/quants.c"], **COMMON),
    # The forward pass (llama2.c style), KV cache; links the same kernels.
    Extension(
        "engine.kernels._forward",
        [f"{KERNELS}/_forward.pyx", f"{KERNELS}/forward.c", f"{KERNELS}/quants.c"],
        **COMMON,
    ),
]

setup(ext_modules=cythonize(extensions, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}))
