"""Python handle on the compiled forward pass (forward.c): ForwardModel, set_kernel_path, kernel_path.

Every public name of engine.kernels._kernels (forward.pxi), the one compiled kernels module: the
kernel path set here is the quantized kernels' (engine.kernels._quants) too.
"""
from engine.kernels._kernels import *  # noqa: F401,F403
