"""Every SIMD kernel of engine/kernels/attention.c against its scalar reference (the scalar path),
on each path this CPU runs and on the SIMDe build's emulated AVX-512 ("avx512-simde"):

    exp8 / exp16                      exp_ref           bit for bit
    gated_act_256 (SiLU)              gated_act_ref     bit for bit
    gated_act_256 (GELU-tanh)         gated_act_ref     within float rounding (its cubic is one FMA)
    f32_to_f16_row_f16c (KV stores)   rq_f32_to_f16     bit for bit (numpy's float16 too)
    attend_rows_256 / _512            attend_row_ref    within float rounding (other sum orders);
                                                        the AVX-512 kernel equals the AVX2 one bit for bit

The references themselves are checked against float64 here and in tests/test_attention.py (which
also checks attention across blocks, threads and f16 rings)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import SIMDE_PATH
from tests.test_attention import SHAPE_IDS, SHAPES, attention_case, attention_f64, exp_inputs

q = pytest.importorskip("engine.kernels._kernels", reason="build the kernels: python setup.py build_ext --inplace")

FAST_PATHS = ["avx2", "avx512", SIMDE_PATH]


@pytest.mark.parametrize("path", FAST_PATHS)
def test_exp_equals_the_scalar_reference_bit_for_bit(path, kern):
    mod, p = kern
    x = exp_inputs()
    np.testing.assert_array_equal(mod.exp_f32(x, path=p), q.exp_f32(x, path="scalar"))


def gated_inputs(n: int = 100_003) -> tuple[np.ndarray, np.ndarray]:
    """Gate values over the range where the activation changes and far past it (where e^-x over-
    or underflows), a length that leaves a tail after the 8-lane loop."""
    rng = np.random.default_rng(11)
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    g[:10] = [0.0, -0.0, 100.0, -100.0, 30.0, -30.0, 1e-30, -1e-30, 88.0, -88.0]
    up = rng.standard_normal(n).astype(np.float32)
    return g, up


def gated_f64(g: np.ndarray, up: np.ndarray, gelu: bool) -> np.ndarray:
    x = g.astype(np.float64)
    z = -2.0 * np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3) if gelu else -x
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(z)) * up


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_gated_act_reference_matches_float64(gelu):
    g, up = gated_inputs()
    got = q.gated_act_f32(g, up, gelu, path="scalar")
    want = gated_f64(g, up, gelu)
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(g.astype(np.float64) * up) + 1e-37)


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_gated_act_against_the_scalar_reference(gelu, path, kern):
    """SiLU runs the reference's operations lane for lane. GELU's x + 0.044715 x^3 is one FMA in the
    SIMD kernel and a multiply and an add in the reference, so the two differ by float rounding."""
    mod, p = kern
    g, up = gated_inputs()
    got = mod.gated_act_f32(g, up, gelu, path=p)
    ref = q.gated_act_f32(g, up, gelu, path="scalar")
    if not gelu:
        np.testing.assert_array_equal(got, ref)
    else:
        assert np.all(np.abs(got.astype(np.float64) - ref) <= 1e-6 * np.abs(g.astype(np.float64) * up) + 1e-37)
        assert not np.array_equal(got, ref)   # the FMA does change some values: the tolerance is needed


def f16_inputs() -> np.ndarray:
    """Random bit patterns (every exponent), the halves' rounding ties (normal and subnormal), and
    the edges of the half range."""
    rng = np.random.default_rng(13)
    bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    halves = rng.integers(0, 0x7c00, size=1 << 14, dtype=np.uint16).view(np.float16).astype(np.float32)
    nxt = np.nextafter(halves.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    ties = ((halves.astype(np.float64) + nxt) / 2).astype(np.float32)   # exact midpoints
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, -65520.0, 6.1035e-05, 5.96e-08,
                      2.98e-08, 2.99e-08, 1e-45], dtype=np.float32)
    return np.concatenate([bits, ties, -ties, edges])


@pytest.mark.parametrize("path", FAST_PATHS)
def test_f16_kv_store_equals_the_scalar_reference_bit_for_bit(path, kern):
    mod, p = kern
    x = f16_inputs()
    got, ref = mod.kv_store_f16(x, path=p), q.kv_store_f16(x, path="scalar")
    nan = np.isnan(x)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    assert np.isnan(got[nan]).all() and np.isnan(ref[nan]).all()   # a NaN's payload may differ


def test_f16_kv_store_reference_rounds_as_numpy():
    x = f16_inputs()
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(q.kv_store_f16(x, path="scalar").view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_attention_rows_against_the_scalar_reference(shape, path, kv_dtype, kern):
    """The SIMD kernels sum scores and softmax weights in another order than attend_row_ref: within
    float rounding of it (and, below, of float64); where hd is not a multiple of 8 the reference runs
    on every path."""
    mod, p = kern
    n_head, n_head_kv, hd, window, pos0, n = shape
    q_, k, v, scale = attention_case(*shape, seed=4)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    got = mod.attention_f32(q_, k, v, pos0, window, scale, threads=2, path=p)
    ref = q.attention_f32(q_, k, v, pos0, window, scale, threads=2, path="scalar")
    if hd % 8:
        np.testing.assert_array_equal(got, ref)
        return
    assert 0 < np.abs(got - ref).max() < 2e-6 * np.abs(ref).max()
    want = attention_f64(q_, k.astype(np.float32), v.astype(np.float32), pos0, window, scale)
    assert np.abs(ref - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("path", ["avx512", SIMDE_PATH])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_attention_avx512_kernel_equals_the_avx2_kernel(shape, path, kv_dtype, kern):
    """attend_rows_512 runs attend_rows_256's 8-lane operations on two rows per vector (and the
    avx512 path runs attend_rows_256 where hd is not a multiple of 16)."""
    if not q.cpu_supports("avx2"):
        pytest.skip("this CPU cannot run the avx2 path")
    mod, p = kern
    n_head, n_head_kv, hd, window, pos0, n = shape
    q_, k, v, scale = attention_case(*shape, seed=5)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    np.testing.assert_array_equal(mod.attention_f32(q_, k, v, pos0, window, scale, 3, 2, 2, path=p, softcap=1.5),
                                  q.attention_f32(q_, k, v, pos0, window, scale, 3, 2, 2, path="avx2", softcap=1.5))
