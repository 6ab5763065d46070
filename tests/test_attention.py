"""The forward pass's softmax pieces on their own (engine/kernels/attention.c): exp against float64,
and attention against float64 and across blocks, threads and f16 rings on every kernel path.
tests/test_attention_kernels.py holds each SIMD kernel to its scalar reference."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import SIMDE_PATH

q = pytest.importorskip("engine.kernels._kernels", reason="build the kernels: python setup.py build_ext --inplace")

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


# ----------------------------------------------------------------------------------------------
# attention (rq_attention: the forward pass's blocks of query rows)

# (n_head, n_head_kv, hd, window, pos0, n): SmolLM2's and Gemma 3's shapes, a sliding window
# whose ring wraps, hd not a multiple of 16 (the avx512 path runs the AVX2 kernel) or of 8 (the
# scalar kernel on every path), no grouping, and decode-sized calls.
SHAPES = [
    (9, 3, 64, 0, 0, 37),
    (9, 3, 64, 0, 50, 23),
    (4, 1, 256, 0, 17, 21),
    (4, 1, 256, 11, 40, 19),
    (6, 2, 72, 5, 3, 13),
    (3, 3, 20, 0, 9, 10),
    (8, 2, 128, 0, 60, 1),
]
SHAPE_IDS = ["smollm2", "smollm2-later", "gemma3", "gemma3-window", "hd72-window", "hd20", "decode"]


def attention_case(n_head, n_head_kv, hd, window, pos0, n, seed=0):
    """q at positions pos0.., and a KV ring holding every position the call reads (as a local
    layer's ring: window + n - 1 slots, fewer than the positions, so it wraps)."""
    rng = np.random.default_rng(seed)
    slots = window + n - 1 + 3 if window else pos0 + n
    q_ = rng.standard_normal((n, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((slots, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((slots, n_head_kv, hd)).astype(np.float32)
    return q_, k, v, float(1.0 / np.sqrt(hd))


def attention_f64(q_, k, v, pos0, window, scale, softcap=0.0):
    n, n_head, hd = q_.shape
    slots, n_head_kv, _ = k.shape
    out = np.zeros((n, n_head, hd))
    for t in range(n):
        pos = pos0 + t
        keys = np.arange(max(0, pos - window + 1) if window else 0, pos + 1)
        for h in range(n_head):
            kh = h // (n_head // n_head_kv)
            s = k[keys % slots, kh].astype(np.float64) @ q_[t, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h] = p / p.sum() @ v[keys % slots, kh].astype(np.float64)
    return out


@pytest.mark.parametrize("path", ["scalar"] + FAST_PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_attention_does_not_depend_on_its_block(shape, path, kern):
    """Every split of the tokens and heads into blocks, and every thread count, gives each token
    the result it gets alone (decode) bit for bit."""
    if path == "scalar":
        mod, p = q, "scalar"
    else:
        mod, p = kern
    n_head, n_head_kv, hd, window, pos0, n = shape
    q_, k, v, scale = attention_case(*shape)
    alone = np.stack([mod.attention_f32(q_[t:t + 1], k, v, pos0 + t, window, scale, 1, 1, 1, path=p)[0]
                      for t in range(n)])
    for tokens, heads, threads in [(0, 0, 1), (0, 0, 2), (1, 0, 2), (3, 2, 2), (4, 1, 1), (8, 0, 2), (16, 0, 1)]:
        got = mod.attention_f32(q_, k, v, pos0, window, scale, tokens, heads, threads, path=p)
        np.testing.assert_array_equal(got, alone, err_msg=f"tokens={tokens} heads={heads} threads={threads}")


@pytest.mark.parametrize("path", ["scalar"] + FAST_PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_attention_matches_float64(shape, path, kern):
    mod, p = (q, "scalar") if path == "scalar" else kern
    n_head, n_head_kv, hd, window, pos0, n = shape
    q_, k, v, scale = attention_case(*shape, seed=1)
    got = mod.attention_f32(q_, k, v, pos0, window, scale, path=p)
    want = attention_f64(q_, k, v, pos0, window, scale)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("path", ["scalar"] + FAST_PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_softcapped_attention_matches_float64(shape, path, kern):
    """Gemma 2's cap * tanh(score / cap) before the softmax (scores here spread over about +-3, so a
    cap of 1.5 changes most of them): within float32 of float64 on every path, and unlike the
    uncapped attention."""
    mod, p = (q, "scalar") if path == "scalar" else kern
    n_head, n_head_kv, hd, window, pos0, n = shape
    q_, k, v, scale = attention_case(*shape, seed=3)
    got = mod.attention_f32(q_, k, v, pos0, window, scale, path=p, softcap=1.5)
    want = attention_f64(q_, k, v, pos0, window, scale, softcap=1.5)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    uncapped = attention_f64(q_, k, v, pos0, window, scale)
    assert np.abs(uncapped - want).max() > 100 * np.abs(got - want).max()
    if path != "scalar":  # any block split gives each token its result alone, capped too
        alone = np.stack([mod.attention_f32(q_[t:t + 1], k, v, pos0 + t, window, scale, 1, 1, 1, path=p,
                                            softcap=1.5)[0] for t in range(n)])
        np.testing.assert_array_equal(mod.attention_f32(q_, k, v, pos0, window, scale, 3, 2, 2, path=p, softcap=1.5),
                                      alone)


def test_attention_refuses_a_ring_too_small():
    q_, k, v, scale = attention_case(4, 1, 64, 0, 10, 8)
    with pytest.raises(ValueError):
        q.attention_f32(q_, k[:17], v[:17], 10, 0, scale)


@pytest.mark.parametrize("path", ["scalar"] + FAST_PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_attention_over_an_f16_ring_equals_the_f32_ring_of_its_values(shape, path, kern):
    """An f16 KV cache is read as halves and widened on the load (exact): the result equals, bit for
    bit, the attention over an f32 ring holding the same values, whatever the blocks and threads."""
    mod, p = (q, "scalar") if path == "scalar" else kern
    n_head, n_head_kv, hd, window, pos0, n = shape
    q_, k, v, scale = attention_case(*shape, seed=3)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    assert not np.array_equal(k16.astype(np.float32), k)   # the halves do change the values
    want = mod.attention_f32(q_, k16.astype(np.float32), v16.astype(np.float32), pos0, window, scale, path=p)
    for tokens, heads, threads in [(0, 0, 1), (0, 0, 2), (3, 2, 2)]:
        got = mod.attention_f32(q_, k16, v16, pos0, window, scale, tokens, heads, threads, path=p)
        np.testing.assert_array_equal(got, want, err_msg=f"tokens={tokens} heads={heads} threads={threads}")
