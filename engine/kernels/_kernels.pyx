# cython: language_level=3
"""The engine's compiled kernels as one extension module: quants.c, forward.c, attention.c and
experts.c are compiled into it once, so the process has one kernel path (g_path) and one copy
of every kernel.

Its parts: quants.pxi (quantized dot products and matmuls, for tests and benchmarks), forward.pxi
(the forward pass) and attention.pxi (test hooks on attention.c's kernels).
"""
include "quants.pxi"
include "forward.pxi"
include "attention.pxi"
