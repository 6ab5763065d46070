"""The forward pass's softmax pieces on their own: exp (rq_exp) on every kernel path against the
scalar reference and float64."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import SIMDE_PATH

q = pytest.importorskip("engine.kernels._quants", reason="build the kernels: python setup.py build_ext --inplace")

FAST_PATHS = ["avx2", "avx512", SIMDE_PATH]


def exp_inputs() -> np.ndarray:
    """Every kind of input: a dense sweep of the range where e^x is finite and nonzero (and past
    both ends), random bit patterns, and the edges."""
    rng = np.random.default_rng(7)
    sweep = np.linspace(-110.0, 95.0, 1 << 20, dtype=np.float32)
    bits = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-30, -87.3, -87.34, -103.9,
                      -103.97, -104.0, -104.1, 88.0, 88.37, 88.72, 88.7228, 88.73, 88.8, 89.0,
                      0.34657, -0.34657, 0.5, -0.5, 1.0, -1.0], dtype=np.float32)
    return np.concatenate([sweep, bits, edges])


@pytest.mark.parametrize("path", FAST_PATHS)
def test_exp_on_simd_paths_equals_the_scalar_reference_bit_for_bit(path, kern):
    mod, p = kern
    x = exp_inputs()
    np.testing.assert_array_equal(mod.exp_f32(x, path=p), q.exp_f32(x, path="scalar"))


def test_exp_is_within_one_ulp():
    x = exp_inputs()
    got = q.exp_f32(x, path="scalar").astype(np.float64)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64))
    want32 = want.astype(np.float32)
    normal = np.isfinite(want32) & (want32 >= np.finfo(np.float32).tiny)
    ulp = np.spacing(want32[normal]).astype(np.float64)
    err = np.abs(got[normal] - want[normal]) / ulp
    assert err.max() <= 1.0, f"max error {err.max():.3f} ulp at x = {x[normal][err.argmax()]!r}"
    assert np.mean(got[normal] == want32[normal]) > 0.95  # correctly rounded: 96.8 % here, 99.8 % of all floats
    sub = np.isfinite(x) & (want32 < np.finfo(np.float32).tiny)   # subnormal or zero: 1 ulp of 2^-149
    assert np.abs(got[sub] - want[sub]).max() <= 2.0 ** -149
    assert np.array_equal(np.isposinf(got), np.isposinf(want32))
    assert np.array_equal(np.isnan(got), np.isnan(x))
