"""numpy-friendly wrappers around the quantized kernels (quants.h), mainly for tests and benchmarks.

Every public name of engine.kernels._kernels (quants.pxi), the one compiled kernels module: the
kernel path set here is the forward pass's (engine.kernels._forward) too.
"""
from engine.kernels._kernels import *  # noqa: F401,F403
