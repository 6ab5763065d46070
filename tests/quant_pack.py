"""Test helpers for the quantized kernels: random ggml blocks and independent numpy references.

Nothing here calls the code under test; expected values come from the `gguf` package or numpy.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
K_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
BLOCK256_TYPES = K_TYPES | {T.IQ4_XS}  # blocks of 256 values: rows a multiple of 256
FLOAT_TYPES = {T.F32, T.F16, T.BF16}

# byte offsets of fp16 fields in each block: (scale fields, min fields)
_F16_FIELDS = {
    T.Q4_0: ([0], []),
    T.Q4_1: ([0], [2]),
    T.Q5_0: ([0], []),
    T.Q5_1: ([0], [2]),
    T.Q8_0: ([0], []),
    T.Q2_K: ([80], [82]),
    T.Q3_K: ([108], []),
    T.Q4_K: ([0], [2]),
    T.Q5_K: ([0], [2]),
    T.Q6_K: ([208], []),
    T.IQ4_NL: ([0], []),
    T.IQ4_XS: ([0], []),
}


def block_size(t) -> tuple[int, int]:
    """(elements, bytes) per block."""
    return GGML_QUANT_SIZES[T(t)]


def row_bytes(t, n: int) -> int:
    be, bb = block_size(t)
    return n // be * bb


def random_rows(t, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """rows x row_bytes uint8 of type t: random bits, with sane fp16 scales and mins."""
    t = T(t)
    if t == T.F32:
        return rng.standard_normal((rows, n)).astype(np.float32).view(np.uint8)
    if t == T.F16:
        return rng.standard_normal((rows, n)).astype(np.float16).view(np.uint8)
    if t == T.BF16:
        f = rng.standard_normal((rows, n)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    be, bb = block_size(t)
    nb = rows * (n // be)
    blocks = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    scales, mins = _F16_FIELDS[t]
    for off in scales:
        d = rng.uniform(0.002, 0.05, nb) * rng.choice([-1.0, 1.0], nb, p=[0.2, 0.8])
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    for off in mins:
        m = rng.uniform(-0.5, 0.5, nb)
        blocks[:, off:off + 2] = m.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def quantized_rows(t, W: np.ndarray) -> np.ndarray:
    """gguf's own quantizer (legacy and float types only)."""
    return quantize(np.ascontiguousarray(W, dtype=np.float32), T(t))


def dequant_rows(t, data: np.ndarray, n: int) -> np.ndarray:
    """gguf's dequantization of rows x row_bytes uint8 -> rows x n float32."""
    t = T(t)
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1, row_bytes(t, n))
    if t == T.F32:
        return data.view(np.float32).reshape(-1, n).copy()
    if t == T.F16:
        return data.view(np.float16).astype(np.float32).reshape(-1, n)
    if t == T.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, n)
    return dequantize(data, t).reshape(-1, n).astype(np.float32)


def quantize_act_np(x: np.ndarray, span: int = 32):
    """Independent numpy twin of the activation format: per span (32 or 256) values, d = amax/127,
    q = round(x / d) (half away from zero, like C roundf; computed as x * (1/d) in f32), d stored
    once per 32 values, sum16 over each 16."""
    amax = np.abs(np.asarray(x, dtype=np.float32).reshape(-1, span)).max(axis=1).repeat(span // 32)
    x = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        idv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
        # subnormal d: 1/d overflows, the kernels divide by d instead
        v = np.where(np.isinf(idv)[:, None], x / d[:, None], x * idv[:, None]).astype(np.float32)
    v = np.clip(v, np.float32(-127), np.float32(127))
    a = np.abs(v)
    t = np.trunc(a)
    q = np.sign(v) * (t + ((a - t) >= np.float32(0.5)))          # exact half-away-from-zero
    q = np.clip(q, -127, 127).astype(np.int8)
    s16 = q.reshape(-1, 16).astype(np.int32).sum(axis=1)
    return q.reshape(-1), d, s16


def act_rounding_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Upper bound of |sum w*x - sum w*xq| from int8 activation rounding: sum |w_i| * d(i)/2.
    w: rows x n (dequantized), x: ntok x n -> ntok x rows."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    d = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=2) / 127.0        # ntok x n/32
    half = np.repeat(d, 32, axis=1) / 2.0                                # ntok x n
    return half.astype(np.float64) @ np.abs(np.atleast_2d(w)).astype(np.float64).T


def abs_mass(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """sum |w_i x_i| (ntok x rows): scale for float-summation tolerances."""
    return np.abs(np.atleast_2d(x)).astype(np.float64) @ np.abs(np.atleast_2d(w)).astype(np.float64).T
