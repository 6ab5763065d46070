"""Build the engine's compiled kernels.

Portable on purpose: no -march=native. SIMD variants carry their own
__attribute__((target(...))) and are chosen at run time from CPU flags.

One extension module, engine.kernels._kernels: every C kernel source is compiled into it once,
so the process has one kernel path and one copy of each kernel. tests/simde_build.py builds a test-only
twin from the same sources through kernel_extension() (this file is imported there, so setup()
runs only as a script).
"""
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension
from setuptools.command.build_ext import build_ext

KERNELS = "engine/kernels"
# C sources compiled into the kernels module (a new kernel file goes here).
C_SOURCES = ["quants.c", "forward.c", "attention.c", "experts.c"]
# Parts of quants.c's translation unit (#included by it, not compiled alone): listed as depends so
# that a change to one rebuilds the module.
C_PARTS = "quants"
COMPILE_ARGS = ["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function",
                "-Werror=implicit-function-declaration"]   # a kernel called before it is defined must not link as an undefined symbol
CYTHON_DIRECTIVES = {"boundscheck": False, "wraparound": False}


def kernel_extension(name="engine.kernels._kernels", pyx=f"{KERNELS}/_kernels.pyx", root=".", define_macros=()):
    """The kernels Extension: the Cython module `pyx` (including quants.pxi and forward.pxi) and
    C_SOURCES, paths under the checkout `root`."""
    kdir = os.path.join(root, KERNELS)
    return Extension(
        name,
        [pyx] + [os.path.join(kdir, c) for c in C_SOURCES],
        depends=sorted(glob.glob(os.path.join(kdir, C_PARTS, "*.c"))) +
        [os.path.join(kdir, h) for h in ("quants.h", "forward.h", "attention.h", "experts.h", "simd.h", "simde_compat.h")],
        include_dirs=[kdir, numpy.get_include()],
        extra_compile_args=list(COMPILE_ARGS),
        extra_link_args=["-fopenmp"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")] + list(define_macros),
    )


class ParallelBuildExt(build_ext):
    """build_ext compiling one extension's sources side by side. setuptools' own --parallel splits
    the work by extension, and this is one extension whose quants.c alone takes most of a build
    (about 60 s of one core at -O3): the others (the Cython module, 20 s) now compile beside it."""

    def build_extension(self, ext):
        compile_sources = self.compiler.compile

        def compile_each(sources, **kwargs):
            longest_first = sorted(sources, key=lambda s: os.path.basename(s) != "quants.c")
            # the CPUs this process may use (Linux), else all of them
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            with ThreadPoolExecutor(max(1, cpus or 1)) as pool:
                objects = dict(zip(longest_first, pool.map(lambda s: compile_sources([s], **kwargs), longest_first)))
            return [o for s in sources for o in objects[s]]   # the link order stays the sources' order

        self.compiler.compile = compile_each
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile


if __name__ == "__main__":
    from Cython.Build import cythonize
    from setuptools import setup

    setup(ext_modules=cythonize([kernel_extension()], language_level=3, compiler_directives=CYTHON_DIRECTIVES),
          cmdclass={"build_ext": ParallelBuildExt})
