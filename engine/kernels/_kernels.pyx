# cython: language_level=3
"""The engine's compiled kernels as one extension module: quants.c, forward.c, attention.c and
experts.c are compiled into it once, so the process has one kernel path (g_path) and one copy of every kernel.

engine.kernels._quants (quantized dot products and matmuls, for tests and benchmarks) and
engine.kernels._forward (the forward pass) re-export its names.
"""
include "quants.pxi"
include "forward.pxi"
include "attention.pxi"
