"""Prefill matmuls (many tokens) against decode (one token at a time), bit for bit.

The AVX-512 path multiplies prefill tiles with its own kernels (16 interleaved rows per vector,
quants.c `v16_*`) and everything else with the AVX2 kernels; both must give every (row, token)
the same float, whatever the tile, the thread count or the path. Calls here have enough tokens
(>= 24) to take the prefill kernels, with partial token tiles and partial row groups.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests import quant_pack as qp
from tests.conftest import SIMDE_PATH

q = pytest.importorskip("engine.kernels._kernels", reason="build the kernels: python setup.py build_ext --inplace")

PREFILL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
# avx512-simde: the AVX-512 kernels built with SIMDe for AVX2 (tests/simde_build.py), so they are
# checked on CPUs without AVX-512 too; the `kern` fixture (conftest.py) gives (module, path in it).
FAST_PATHS = ["avx2", "avx512", SIMDE_PATH]


def _n_for(t) -> int:
    # an odd number of 32-element blocks for the legacy types (the padded mins step)
    return 256 * 3 if T(t) in qp.BLOCK256_TYPES else 32 * 23


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("t", PREFILL_TYPES, ids=[T(t).name for t in PREFILL_TYPES])
def test_prefill_equals_decode_bit_for_bit(t, path, kern):
    mod, p = kern
    rng = np.random.default_rng(900 + int(t))
    n, rows, ntok = _n_for(t), 37, 45          # 2 full groups of 16 rows + 5; 5 tiles of 8 tokens + 5
    W = qp.random_rows(t, rows, n, rng)
    X = rng.standard_normal((ntok, n)).astype(np.float32)
    X[3, :64] = 0.0                              # a token with zero blocks
    alone = np.stack([mod.matmul(int(t), W, rows, n, X[k:k + 1], nthreads=1, path=p)[0] for k in range(ntok)])
    for threads in (1, 2):
        got = mod.matmul(int(t), W, rows, n, X, nthreads=threads, path=p)
        np.testing.assert_array_equal(got, alone, err_msg=f"threads={threads}")
    # and the result is right: close to the f32 reference (int8 activations cost a little)
    ref = q.matmul_ref(int(t), W, rows, n, X)
    scale = np.abs(ref).max()
    assert np.abs(alone - ref).max() <= 0.02 * scale


@pytest.mark.parametrize("path", ["avx512", SIMDE_PATH])
@pytest.mark.parametrize("t", PREFILL_TYPES, ids=[T(t).name for t in PREFILL_TYPES])
def test_avx512_path_equals_avx2_path(t, path, kern):
    mod, p = kern
    if not q.cpu_supports("avx2"):
        pytest.skip("this CPU cannot run the avx2 path")
    rng = np.random.default_rng(950 + int(t))
    n, rows, ntok = _n_for(t), 50, 64
    W = qp.random_rows(t, rows, n, rng)
    X = rng.standard_normal((ntok, n)).astype(np.float32)
    a = q.matmul(int(t), W, rows, n, X, nthreads=2, path="avx2")
    b = mod.matmul(int(t), W, rows, n, X, nthreads=2, path=p)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_avx2_prefill_row_passes_of_one_two_and_three_rows(t):
    """The AVX2 prefill kernel runs three rows per pass, then a pair or a single row for the rest:
    every row count ends on each kind of pass, in the GGUF layout and in R16, and each row's
    results are decode's bit for bit."""
    rng = np.random.default_rng(40 + int(t))
    n, ntok = _n_for(t), 27
    X = rng.standard_normal((ntok, n)).astype(np.float32)
    for rows in (1, 2, 3, 4, 5, 16, 17, 32, 34):
        W = qp.random_rows(t, rows, n, rng)
        alone = np.stack([q.matmul(int(t), W, rows, n, X[k:k + 1], nthreads=1, path="avx2")[0] for k in range(ntok)])
        np.testing.assert_array_equal(q.matmul(int(t), W, rows, n, X, nthreads=2, path="avx2"), alone,
                                      err_msg=f"rows={rows}")
        R = np.zeros(q.r16_bytes(int(t), rows, n), dtype=np.uint8)
        q.r16_repack(int(t), W, rows, n, R, 0, (rows + 15) // 16, 1)
        np.testing.assert_array_equal(q.matmul_r16(int(t), W, R, rows, n, X, nthreads=2, path="avx2"), alone,
                                      err_msg=f"R16, rows={rows}")
