"""llama.cpp's own one-token matmul (ggml's CPU mul_mat) on given weight bytes, through ctypes.

The peer side of bench_decode_compute.py: the weights go into a ggml tensor of the same GGML type,
either in ggml's plain CPU buffer (its vec_dot kernels, as test-backend-ops runs them) or in its
CPU_REPACK buffer type (the interleaved layouts llama-bench uses for the types it repacks on this CPU),
and `ggml_mul_mat(W, x)` for one f32 column runs with ggml_graph_plan / ggml_graph_compute. ggml quantises
the column itself, inside the timed call, as it does in decode.

Needs a llama.cpp build's shared libraries: the directory of libggml.so (LLAMA_CPP_LIB_PATH or --ggml-lib).
"""
from __future__ import annotations

import ctypes as C
import os
import time
from pathlib import Path

import numpy as np


class _InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class _CPlan(C.Structure):
    """ggml-cpu.h's struct ggml_cplan."""
    _fields_ = [("work_size", C.c_size_t), ("work_data", C.c_void_p), ("n_threads", C.c_int),
                ("threadpool", C.c_void_p), ("abort_callback", C.c_void_p),
                ("abort_callback_data", C.c_void_p), ("use_ref", C.c_bool)]


_DEVICE_CPU = 0      # GGML_BACKEND_DEVICE_TYPE_CPU
# The types ggml repacks on x86 with AVX2 (ggml_repack_get_optimal_repack_type in ggml-cpu/repack.cpp:
# Q4_0, Q4_K and IQ4_NL as 8x8 interleaves; rows a multiple of 8). A type without a repack layout in
# CPU_REPACK crashes ggml's set_tensor, so only these are offered.
REPACKED_ON_X86 = {2, 12, 20}   # GGML_TYPE_Q4_0, Q4_K, IQ4_NL
_N_REPLICAS = 8      # mul_mats per graph: Python's call overhead spread over eight matmuls


class Ggml:
    """The few ggml entry points the benchmark needs, from a llama.cpp build directory."""

    def __init__(self, lib_dir: str | os.PathLike):
        d = Path(lib_dir)
        mode = C.RTLD_GLOBAL
        self.base = C.CDLL(str(d / "libggml-base.so"), mode=mode)
        self.cpu = C.CDLL(str(d / "libggml-cpu.so"), mode=mode)
        self.ggml = C.CDLL(str(d / "libggml.so"), mode=mode)
        b, c, g = self.base, self.cpu, self.ggml
        vp, sz, i64 = C.c_void_p, C.c_size_t, C.c_int64
        b.ggml_init.restype, b.ggml_init.argtypes = vp, [_InitParams]
        b.ggml_free.argtypes = [vp]
        b.ggml_new_tensor_2d.restype, b.ggml_new_tensor_2d.argtypes = vp, [vp, C.c_int, i64, i64]
        b.ggml_mul_mat.restype, b.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
        b.ggml_new_graph.restype, b.ggml_new_graph.argtypes = vp, [vp]
        b.ggml_build_forward_expand.argtypes = [vp, vp]
        b.ggml_get_data.restype, b.ggml_get_data.argtypes = vp, [vp]
        b.ggml_nbytes.restype, b.ggml_nbytes.argtypes = sz, [vp]
        b.ggml_tensor_overhead.restype = sz
        b.ggml_graph_overhead.restype = sz
        b.ggml_backend_tensor_set.argtypes = [vp, vp, sz, sz]
        b.ggml_backend_buffer_free.argtypes = [vp]
        b.ggml_backend_alloc_ctx_tensors_from_buft.restype = vp
        b.ggml_backend_alloc_ctx_tensors_from_buft.argtypes = [vp, vp]
        b.ggml_backend_buft_name.restype, b.ggml_backend_buft_name.argtypes = C.c_char_p, [vp]
        c.ggml_cpu_init.argtypes = []
        c.ggml_graph_plan.restype, c.ggml_graph_plan.argtypes = _CPlan, [vp, C.c_int, vp]
        c.ggml_graph_compute.restype, c.ggml_graph_compute.argtypes = C.c_int, [vp, C.POINTER(_CPlan)]
        c.ggml_backend_cpu_buffer_type.restype = vp
        g.ggml_backend_dev_by_type.restype, g.ggml_backend_dev_by_type.argtypes = vp, [C.c_int]
        g.ggml_backend_dev_backend_reg.restype, g.ggml_backend_dev_backend_reg.argtypes = vp, [vp]
        g.ggml_backend_reg_get_proc_address.restype = vp
        g.ggml_backend_reg_get_proc_address.argtypes = [vp, C.c_char_p]
        c.ggml_cpu_init()

    def extra_buffer_types(self) -> dict[str, int]:
        """The CPU device's extra buffer types by name (CPU_REPACK where the build has it)."""
        dev = self.ggml.ggml_backend_dev_by_type(_DEVICE_CPU)
        reg = self.ggml.ggml_backend_dev_backend_reg(dev)
        addr = self.ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not addr:
            return {}
        get = C.CFUNCTYPE(C.POINTER(C.c_void_p), C.c_void_p)(addr)
        lst, out, i = get(dev), {}, 0
        while lst and lst[i]:
            out[self.base.ggml_backend_buft_name(lst[i]).decode()] = lst[i]
            i += 1
        return out


class MatVec:
    """y = W x for one column, W (rows x cols, GGML type t, as bytes) held by ggml."""

    def __init__(self, g: Ggml, t: int, W: np.ndarray, rows: int, cols: int, x: np.ndarray, *, repack: bool):
        self.g, b = g, g.base
        if repack and (t not in REPACKED_ON_X86 or rows % 8):
            raise ValueError(f"ggml does not repack GGML type {t} with {rows} rows on x86")
        self._wbuf = None
        meta = _InitParams(b.ggml_tensor_overhead() * 4, None, True)
        self.ctx_w = b.ggml_init(meta)
        self.W = b.ggml_new_tensor_2d(self.ctx_w, t, cols, rows)
        buft = g.extra_buffer_types().get("CPU_REPACK") if repack else g.cpu.ggml_backend_cpu_buffer_type()
        if not buft:
            raise RuntimeError("this llama.cpp build has no CPU_REPACK buffer type")
        self._wbuf = b.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx_w, buft)
        if not self._wbuf:
            raise RuntimeError("ggml could not allocate the weights")
        w = np.ascontiguousarray(W).view(np.uint8).reshape(-1)
        if w.size != b.ggml_nbytes(self.W):
            raise ValueError(f"W has {w.size} bytes, ggml expects {b.ggml_nbytes(self.W)}")
        b.ggml_backend_tensor_set(self.W, w.ctypes.data, 0, w.size)   # repacks, in CPU_REPACK
        mem = b.ggml_tensor_overhead() * (2 * _N_REPLICAS + 4) + b.ggml_graph_overhead() + 4 * (cols + rows * _N_REPLICAS) + 4096
        self.ctx = b.ggml_init(_InitParams(mem, None, False))
        self.x = b.ggml_new_tensor_2d(self.ctx, 0, cols, 1)      # GGML_TYPE_F32
        C.memmove(b.ggml_get_data(self.x), np.ascontiguousarray(x, dtype=np.float32).ctypes.data, 4 * cols)
        self.graph = b.ggml_new_graph(self.ctx)
        self.y = []
        for _ in range(_N_REPLICAS):
            y = b.ggml_mul_mat(self.ctx, self.W, self.x)
            b.ggml_build_forward_expand(self.graph, y)
            self.y.append(y)
        self.rows = rows
        self._plans: dict[int, tuple[_CPlan, object]] = {}

    def _plan(self, threads: int):
        """The compute plan for `threads`, with its work buffer (the quantised column) kept alive."""
        if threads not in self._plans:
            plan = self.g.cpu.ggml_graph_plan(self.graph, threads, None)
            work = C.create_string_buffer(max(1, plan.work_size) + 64)
            plan.work_data = C.addressof(work)
            self._plans[threads] = (plan, work)
        return C.byref(self._plans[threads][0])

    def run(self, threads: int = 1) -> np.ndarray:
        if self.g.cpu.ggml_graph_compute(self.graph, self._plan(threads)) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        out = (C.c_float * self.rows).from_address(self.g.base.ggml_get_data(self.y[0]))
        return np.frombuffer(out, dtype=np.float32).copy()

    def seconds(self, reps: int, threads: int = 1) -> float:
        """Seconds per one-column matmul."""
        compute, graph, plan = self.g.cpu.ggml_graph_compute, self.graph, self._plan(threads)
        t0 = time.perf_counter()
        for _ in range(reps):
            compute(graph, plan)
        return (time.perf_counter() - t0) / (reps * _N_REPLICAS)

    def close(self) -> None:
        if self._wbuf:
            self.g.base.ggml_backend_buffer_free(self._wbuf)
            self._wbuf = None
        for name in ("ctx", "ctx_w"):
            if getattr(self, name, None):
                self.g.base.ggml_free(getattr(self, name))
                setattr(self, name, None)
