"""Quantized kernels (engine/kernels/quants.c via engine.kernels._kernels).

Ground truth comes from outside the code under test: `gguf.quants` (dequantization, legacy
quantization), numpy (activation format, float dot products) and provable error bounds for
int8 activation rounding. Every kernel path this CPU can run is forced and checked, and the
AVX-512 code also through SIMDe on any CPU with AVX2 (path "avx512-simde": the kernels built again
with AVX-512 emulated, tests/simde_build.py), against the same scalar reference.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests import quant_pack as qp
from tests.conftest import SIMDE_PATH
from tests.reference import open_gguf

q = pytest.importorskip("engine.kernels._kernels", reason="build the kernels: python setup.py build_ext --inplace")

NATIVE_PATHS = ["scalar", "avx2", "avx512"]
# Kernel tests run each path of the product module (engine.kernels._kernels as q) and the SIMDe
# build's avx512 path; the `kern` fixture (conftest.py) gives (module, path name in it).
PATHS = NATIVE_PATHS + [SIMDE_PATH]
FAST_PATHS = ["avx2", "avx512", SIMDE_PATH]
TYPES = qp.ALL_TYPES
REAL_TYPES = [T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.F32, T.F16]


def _need(path):
    if not q.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")


def _ids(ts):
    return [T(t).name for t in ts]


def _x(rng, ntok, n, kind="normal"):
    x = rng.standard_normal((ntok, n)).astype(np.float32)
    if kind == "outliers":
        # a few large values per token (like real activations), and one all-zero block
        idx = rng.integers(0, n, size=(ntok, max(1, n // 64)))
        for k in range(ntok):
            x[k, idx[k]] *= 40.0
        x[:, 32:64] = 0.0
    return x


def _n_for(t, nblk_legacy=18, nblk_k=3):
    return 256 * nblk_k if T(t) in qp.BLOCK256_TYPES else 32 * nblk_legacy


# --------------------------------------------------------------------------------------------
# tables and conversions


def test_supported_types_and_sizes():
    assert sorted(q.supported_types()) == sorted(int(t) for t in TYPES)
    for t in TYPES:
        be, bb = qp.block_size(t)
        assert q.block_elems(int(t)) == be, T(t).name
        assert q.block_bytes(int(t)) == bb, T(t).name
        assert q.row_bytes(int(t), be * 7) == bb * 7


def test_f16_to_f32_all_values():
    h = np.arange(65536, dtype=np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = np.array([q.f16_to_f32(int(v)) for v in h], dtype=np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_f32_to_f16_rounding():
    rng = np.random.default_rng(1)
    f = np.concatenate([
        rng.standard_normal(3000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 3000),
        np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, -6.1e-5, 2.0 ** -25, 2.0 ** -24, np.inf, -np.inf]),
        # exact ties between two f16 values
        (np.arange(1, 200, dtype=np.float32) * 2.0 ** -11 + 2.0 ** -12 + 1.0),
    ]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    got = np.array([q.f32_to_f16(float(v)) for v in f], dtype=np.uint16)
    assert np.array_equal(got, want), f[got != want][:5]
    assert np.isnan(np.array([q.f32_to_f16(float("nan"))], dtype=np.uint16).view(np.float16)[0])


def test_bf16_to_f32():
    rng = np.random.default_rng(2)
    h = rng.integers(0, 65536, 2000, dtype=np.uint16)
    want = (h.astype(np.uint32) << 16).view(np.float32)
    got = np.array([q.bf16_to_f32(int(v)) for v in h], dtype=np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("path", PATHS)
def test_quantize_act_matches_numpy(path, kern):
    mod, path = kern
    rng = np.random.default_rng(3)
    x = _x(rng, 1, 1024, "outliers")[0]
    x[96:128] = 1e-30  # tiny but non-zero block
    x[160:192] *= np.float32(1e-39)  # subnormal amax: 1/d overflows
    # a block with amax 127 (d = 1): exact halves must round away from zero
    x[128:160] = np.float32(0.25)
    x[128:138] = [127.0, 2.5, -2.5, 0.5, -0.5, 126.5, -1.5, 3.49999976, -0.0, 1e-9]
    qs, d, s16 = mod.quantize_act(x, path=path)
    wq, wd, ws = qp.quantize_act_np(x)
    assert np.array_equal(d, wd)
    assert np.array_equal(qs, wq)
    assert np.array_equal(s16, ws)
    assert np.abs(qs.astype(np.int32)).max() <= 127
    assert np.all(d[1] == 0) and np.all(qs[32:64] == 0)
    assert d[4] == 1.0 and list(qs[128:138]) == [127, 3, -3, 1, -1, 127, -2, 3, 0, 0]
    assert np.abs(qs[160:192].astype(int)).max() == 127


@pytest.mark.parametrize("path", PATHS)
def test_quantize_act_span_256_matches_numpy(path, kern):
    """One scale per 256 values (Q4_K's activations, as ggml's Q8_K): each super-block's 8 blocks
    share the scale of its largest value, zero and subnormal super-blocks included."""
    mod, path = kern
    rng = np.random.default_rng(4)
    x = _x(rng, 1, 1024, "outliers")[0]
    x[256:512] *= np.float32(1e-39)  # subnormal amax: 1/d overflows
    x[512:768] = 0.0
    x[800] = 300.0  # one outlier sets the scale of all 256
    qs, d, s16 = mod.quantize_act(x, path=path, span=256)
    wq, wd, ws = qp.quantize_act_np(x, span=256)
    assert np.array_equal(d, wd) and np.array_equal(qs, wq) and np.array_equal(s16, ws)
    assert np.all(d.reshape(4, 8) == d.reshape(4, 8)[:, :1])
    assert d[24] == np.float32(300.0) / np.float32(127.0) and qs[800] == 127
    assert np.all(d[16:24] == 0) and np.abs(qs[256:512].astype(int)).max() == 127
    # the per-32 form of the same values is a different quantization
    assert not np.array_equal(mod.quantize_act(x, path=path)[1], d)


@pytest.mark.parametrize("t", [T.Q4_K, T.IQ4_XS], ids=_ids([T.Q4_K, T.IQ4_XS]))
def test_super_block_kernels_refuse_activations_of_span_32(t):
    """A Q4_K or IQ4_XS matmul sums a super-block's blocks in integers before one float step: given
    activations with a scale per 32 values it would be silently wrong, so it stops the process with a
    message."""
    assert q.act_span(int(t)) == 256
    name = T(t).name
    code = (
        "import numpy as np\n"
        "from gguf import GGMLQuantizationType as T\n"
        "from engine.kernels import _kernels as k\n"
        "from tests import quant_pack as qp\n"
        f"W = qp.random_rows(T.{name}, 16, 256, np.random.default_rng(0))\n"
        f"print(k.matmul(int(T.{name}), W, 16, 256, np.ones((1, 256), np.float32), span=256).shape, flush=True)\n"
        f"k.matmul(int(T.{name}), W, 16, 256, np.ones((1, 256), np.float32), span=32)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert "(1, 16)" in r.stdout
    assert r.returncode != 0 and f"{name} matmul was given activations with one scale per 32 values" in r.stderr


def test_path_selection():
    assert q.kernel_path() in NATIVE_PATHS
    assert q.cpu_supports("scalar")
    with pytest.raises(ValueError):
        q.set_path("bogus")
    old = q.kernel_path()
    for p in NATIVE_PATHS:
        if q.cpu_supports(p):
            q.set_path(p)
            assert q.kernel_path() == p
    q.set_path(old)


@pytest.mark.parametrize("path", NATIVE_PATHS)
def test_env_forces_path(path):
    _need(path)
    code = "from engine.kernels import _kernels as q; print(q.kernel_path())"
    env = dict(os.environ, RQLLM_KERNEL=path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True)
    assert out.stdout.strip() == path


def test_default_path_is_best():
    code = "from engine.kernels import _kernels as q; print(q.kernel_path())"
    env = {k: v for k, v in os.environ.items() if k != "RQLLM_KERNEL"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True)
    best = "avx512" if q.cpu_supports("avx512") else "avx2" if q.cpu_supports("avx2") else "scalar"
    assert out.stdout.strip() == best


def _cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from /proc/cpuinfo")
def test_avxvnni_kernels_on_where_the_cpu_has_them_unless_turned_off():
    """The AVX2 path's AVX-VNNI kernels: on by default exactly where the kernel reports avx_vnni, off
    with RQLLM_AVXVNNI=0, and refused where the CPU lacks the instructions."""
    has = {"avx_vnni", "avx2", "fma", "f16c"} <= _cpuinfo_flags()
    code = "from engine.kernels import _kernels as q; print(q.avxvnni())"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for value, want in ((None, has), ("0", False), ("1", has)):
        env = {k: v for k, v in os.environ.items() if k != "RQLLM_AVXVNNI"}
        if value is not None:
            env["RQLLM_AVXVNNI"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=repo, check=True)
        assert out.stdout.strip() == str(want), value
    if not has:
        with pytest.raises(ValueError, match="AVX-VNNI"):
            q.set_avxvnni(True)


# --------------------------------------------------------------------------------------------
# dequantization vs gguf


@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_dequant_random_blocks(t):
    rng = np.random.default_rng(10 + int(t))
    n = _n_for(t, 12, 4)
    W = qp.random_rows(t, 6, n, rng)
    want = qp.dequant_rows(t, W, n)
    for r in range(W.shape[0]):
        got = q.dequant_row(int(t), W[r], n)
        np.testing.assert_allclose(got, want[r], rtol=1e-6, atol=1e-7 * np.abs(want[r]).max(),
                                   err_msg=f"{T(t).name} row {r}")


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16],
                         ids=_ids([T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16]))
def test_dequant_gguf_quantized(t):
    rng = np.random.default_rng(20 + int(t))
    W = rng.standard_normal((4, 320)).astype(np.float32)
    Wq = qp.quantized_rows(t, W)
    want = qp.dequant_rows(t, Wq, 320)
    for r in range(4):
        np.testing.assert_array_equal(q.dequant_row(int(t), Wq[r], 320), want[r])


# --------------------------------------------------------------------------------------------
# real model tensors


def _load(path, wanted_types, per_type=3):
    reader = open_gguf(path)  # gguf's GGUFReader, its metadata reads sped up (tests.reference)
    out = {}
    for tensor in reader.tensors:
        t = T(tensor.tensor_type)
        if t in wanted_types and len(out.setdefault(t, [])) < per_type:
            n = int(tensor.shape[0])
            data = np.asarray(tensor.data)
            rows = data.reshape(-1, qp.row_bytes(t, n)) if t not in qp.FLOAT_TYPES else \
                data.reshape(-1, n).view(np.uint8)
            # keep a bounded slice: first rows and a few spread-out rows
            pick = np.unique(np.concatenate([np.arange(min(64, rows.shape[0])),
                                             np.linspace(0, rows.shape[0] - 1, 16).astype(int)]))
            out[t].append((tensor.name, n, np.ascontiguousarray(rows[pick])))
    return out


@pytest.fixture(scope="module")
def smollm2_tensors(smollm2_path):
    return _load(str(smollm2_path), {T.Q4_1, T.Q8_0, T.F32})


@pytest.fixture(scope="module")
def gemma3_tensors(gemma3_path):
    return _load(str(gemma3_path), {T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0, T.F32})


@pytest.fixture(params=["smollm2", "gemma3"])
def real_tensors(request):
    return request.getfixturevalue(f"{request.param}_tensors")


def test_dequant_real_tensors(real_tensors):
    assert real_tensors, "no tensors loaded"
    for t, items in real_tensors.items():
        for name, n, rows in items:
            want = qp.dequant_rows(t, rows, n)
            for r in range(rows.shape[0]):
                got = q.dequant_row(int(t), rows[r], n)
                np.testing.assert_allclose(got, want[r], rtol=1e-6, atol=1e-7 * np.abs(want[r]).max(),
                                           err_msg=f"{name} ({t.name}) row {r}")


@pytest.mark.parametrize("path", PATHS)
def test_matmul_real_tensors(real_tensors, path, kern):
    rng = np.random.default_rng(5)
    for t, items in real_tensors.items():
        for name, n, rows in items:
            if rows.ndim != 2 or rows.shape[0] < 8:
                continue
            if t in qp.FLOAT_TYPES and rows.shape[0] < 2:
                continue
            X = _x(rng, 3, n, "outliers")
            _check_matmul(t, rows, n, X, kern, nthreads=2, label=name)


# --------------------------------------------------------------------------------------------
# dot products: every path vs the scalar reference and vs the float dot


def _where(on):
    mod, p = on
    return p if mod is q else f"{p} (SIMDe build)"


def _check_dot(t, row, n, x, on, label=""):
    """on: (kernels module, path) from the `kern` fixture; the reference is q's."""
    mod, path = on
    w = qp.dequant_rows(t, row, n)[0].astype(np.float64)
    exact = float(w @ x.astype(np.float64))
    mass = float(np.abs(w) @ np.abs(x.astype(np.float64)))
    ref = q.vec_dot_ref(int(t), row, x)
    got = mod.vec_dot(int(t), row, x, path=path)
    path = _where(on)
    # same integer math, different float summation order
    assert abs(got - ref) <= 2e-6 * mass + 1e-30, f"{label} {path}: {got} vs ref {ref} (mass {mass})"
    if T(t) in qp.FLOAT_TYPES:
        bound = 0.0
    else:
        bound = float(qp.act_rounding_bound(w[None], x[None])[0, 0])
    tol = bound * 1.001 + 2e-6 * mass + 1e-30
    assert abs(got - exact) <= tol, f"{label} {path}: {got} vs float {exact}, bound {bound}"
    assert abs(ref - exact) <= tol, f"{label} ref: {ref} vs float {exact}, bound {bound}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_vec_dot_random(t, path, kern):
    rng = np.random.default_rng(100 + int(t))
    for nblk in ([1, 2, 5] if T(t) in qp.BLOCK256_TYPES else [1, 3, 8, 18, 20, 33]):
        n = nblk * (256 if T(t) in qp.BLOCK256_TYPES else 32)
        W = qp.random_rows(t, 3, n, rng)
        for r in range(3):
            x = _x(rng, 1, n, "outliers" if r == 1 and n >= 64 else "normal")[0]
            _check_dot(t, W[r], n, x, kern, label=f"{T(t).name} n={n} r={r}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0],
                         ids=_ids([T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]))
def test_vec_dot_gguf_quantized(t, path, kern):
    rng = np.random.default_rng(200 + int(t))
    n = 640
    W = qp.quantized_rows(t, rng.standard_normal((2, n)).astype(np.float32))
    for r in range(2):
        _check_dot(t, W[r], n, _x(rng, 1, n)[0], kern, label=T(t).name)


S8_TYPES = [T.Q8_0, T.IQ4_NL, T.IQ4_XS]   # signed 8-bit values (IQ4: after the table lookup)


def _extreme_rows(t, rows: int, n: int, rng) -> np.ndarray:
    """rows x row_bytes of type t whose every value is at an end of the type's range (Q8_0 +-127,
    IQ4 table values 113 and -127, IQ4_XS block scales 31 or -32), signs at random."""
    be, bb = qp.block_size(t)
    nb = rows * n // be
    blocks = np.zeros((nb, bb), np.uint8)
    blocks[:, 0:2] = np.full(nb, 0.01, np.float16).view(np.uint8).reshape(nb, 2)
    hi = rng.integers(0, 2, size=(nb, be)).astype(bool)
    if t == T.Q8_0:
        blocks[:, 2:] = np.where(hi, 127, -127).astype(np.int8).view(np.uint8)
    else:
        idx = np.where(hi, 15, 0).astype(np.uint8).reshape(nb, -1, 32)    # kvalues_iq4nl[15] = 113, [0] = -127
        nib = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(nb, -1)
        if t == T.IQ4_NL:
            blocks[:, 2:] = nib
        else:
            ls = rng.choice([0, 63], size=(nb, 8)).astype(np.uint8)     # ls - 32: -32 or 31
            blocks[:, 2:4] = sum((ls[:, j] >> 4).astype(np.uint16) << (2 * j) for j in range(8)).astype(np.uint16) \
                .view(np.uint8).reshape(nb, 2)
            blocks[:, 4:8] = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
            blocks[:, 8:] = nib
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", S8_TYPES, ids=_ids(S8_TYPES))
def test_signed_types_largest_products_are_exact(t, path, kern):
    """Weights at the ends of their range against activations of +-127 with the same sign (every
    product at its largest): as value + 128, vpmaddubsw's int16 pair sums would saturate
    (2 x 241 x 127 > 32767). Every path, on the GGUF rows and on the R16 copy, must give the exact
    integer dot of the weights and the quantized activations (float rounding only)."""
    mod, p = kern
    rng = np.random.default_rng(1000 + int(t))
    n, rows = 512, 19
    W = _extreme_rows(t, rows, n, rng)
    w = qp.dequant_rows(t, W, n).astype(np.float64)
    R = np.zeros(q.r16_bytes(int(t), rows, n), dtype=np.uint8)
    q.r16_repack(int(t), W, rows, n, R, 0, (rows + 15) // 16, 1)
    span = q.act_span(int(t))                                            # IQ4_XS: one scale per 256
    for ntok in (1, 2, 3, 9, 30):
        s = np.sign(w[rng.integers(0, rows, ntok)])                    # each token the signs of one row
        X = (s * rng.uniform(0.5, 2.0, (ntok, n // span)).repeat(span, axis=1)).astype(np.float32)
        exact = np.zeros((ntok, rows))
        for k in range(ntok):
            qs, d, _ = qp.quantize_act_np(X[k], span)
            assert np.abs(qs).min() == 127                               # every activation at +-127
            exact[k] = w @ (qs.astype(np.float64) * np.repeat(d.astype(np.float64), 32))
        tol = 1e-5 * np.abs(exact).max()
        for label, got in (("GGUF rows", mod.matmul(int(t), W, rows, n, X, nthreads=1, path=p)),
                           ("R16", mod.matmul_r16(int(t), W, R, rows, n, X, nthreads=1, path=p))):
            err = np.abs(got - exact).max()
            assert err <= tol, f"{T(t).name} ntok={ntok} {label} on {_where(kern)}: max error {err} (tol {tol})"


# --------------------------------------------------------------------------------------------
# matmul


def _check_matmul(t, W, n, X, on, nthreads, label=""):
    """on: (kernels module, path) from the `kern` fixture; the references are q's."""
    mod, path = on
    rows = W.shape[0]
    w = qp.dequant_rows(t, W, n).astype(np.float64)
    exact = X.astype(np.float64) @ w.T                                   # ntok x rows
    mass = qp.abs_mass(w, X)
    bound = 0.0 if T(t) in qp.FLOAT_TYPES else qp.act_rounding_bound(w, X)
    ref = q.matmul_ref(int(t), W, rows, n, X)
    np.testing.assert_allclose(ref, exact, rtol=0, atol=float(np.max(1e-6 * mass)) + 1e-30,
                               err_msg=f"{label} matmul_ref")
    got = mod.matmul(int(t), W, rows, n, X, nthreads=nthreads, path=path)
    path = _where(on)
    assert got.shape == (X.shape[0], rows)
    err = np.abs(got - exact)
    bad = err > bound * 1.001 + 2e-6 * mass + 1e-30
    assert not bad.any(), f"{label} {path} threads={nthreads}: {int(bad.sum())} outputs out of bounds, " \
                          f"first at {np.argwhere(bad)[0]}: {got[bad][0]} vs {exact[bad][0]}"
    # tight agreement with the scalar reference dot on a few outputs
    for j in {0, X.shape[0] - 1}:
        for r in {0, rows // 2, rows - 1}:
            ref_dot = q.vec_dot_ref(int(t), W[r], X[j])
            assert abs(got[j, r] - ref_dot) <= 2e-6 * mass[j, r] + 1e-30, f"{label} {path} ({j},{r})"
    return got


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_matmul(t, path, kern):
    rng = np.random.default_rng(300 + int(t))
    n = _n_for(t, 18, 2)
    rows = 37
    W = qp.random_rows(t, rows, n, rng)
    for ntok in (1, 3, 17):
        X = _x(rng, ntok, n, "outliers" if ntok == 3 else "normal")
        res = [_check_matmul(t, W, n, X, kern, nthreads, label=f"{T(t).name} ntok={ntok}")
               for nthreads in (1, 2)]
        # threading must not change any result
        np.testing.assert_array_equal(res[0], res[1])


@pytest.mark.parametrize("path", PATHS)
def test_matmul_rows_subrange(path, kern):
    mod, p = kern
    rng = np.random.default_rng(7)
    t, n, rows = T.Q4_K, 512, 20
    W = qp.random_rows(t, rows, n, rng)
    X = _x(rng, 5, n)
    full = mod.matmul(int(t), W, rows, n, X, nthreads=1, path=p)
    part = mod.matmul_rows(int(t), W, rows, n, X, 3, 11, path=p)
    assert np.isnan(part[:, :3]).all() and np.isnan(part[:, 11:]).all()
    np.testing.assert_array_equal(part[:, 3:11], full[:, 3:11])


@pytest.mark.parametrize("path", PATHS)
def test_matmul_many_tokens_and_rows(path, kern):
    """Larger shapes: many tokens (prefill-like) and row counts that do not divide into chunks."""
    rng = np.random.default_rng(8)
    for t in (T.Q4_1, T.Q6_K):
        n = 512
        rows = 131
        W = qp.random_rows(t, rows, n, rng)
        X = _x(rng, 40, n)
        _check_matmul(t, W, n, X, kern, nthreads=2, label=T(t).name)


TILE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
              T.F16]


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("t", TILE_TYPES, ids=_ids(TILE_TYPES))
def test_matmul_every_tile_size(t, path, kern):
    """Every token count a kernel specializes on (1..9, and tiles with remainders), odd block counts."""
    mod, p = kern
    rng = np.random.default_rng(400 + int(t))
    n = _n_for(t, 7, 1)      # 7 legacy blocks: pair + half-pair tails
    rows = 5
    W = qp.random_rows(t, rows, n, rng)
    w = qp.dequant_rows(t, W, n).astype(np.float64)
    for ntok in list(range(1, 10)) + [16, 23]:
        X = _x(rng, ntok, n)
        got = mod.matmul(int(t), W, rows, n, X, nthreads=1, path=p)
        for k in range(ntok):
            for r in range(rows):
                ref = q.vec_dot_ref(int(t), W[r], X[k])
                mass = float(np.abs(w[r]) @ np.abs(X[k].astype(np.float64)))
                assert abs(got[k, r] - ref) <= 2e-6 * mass + 1e-30, f"{T(t).name} ntok={ntok} ({k},{r})"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=_ids([T.F32, T.F16, T.BF16]))
def test_float_weights_long_rows(t, path, kern):
    """Float weights use only the float activations; long rows (8192) and many tokens."""
    mod, p = kern
    rng = np.random.default_rng(500 + int(t))
    n, rows = 8192, 9
    W = qp.random_rows(t, rows, n, rng)
    w = qp.dequant_rows(t, W, n).astype(np.float64)
    X = _x(rng, 10, n)
    exact = X.astype(np.float64) @ w.T
    mass = qp.abs_mass(w, X)
    for r in (0, rows - 1):
        assert abs(mod.vec_dot(int(t), W[r], X[0], path=p) - exact[0, r]) <= 2e-6 * mass[0, r]
    got = mod.matmul(int(t), W, rows, n, X, nthreads=2, path=p)
    assert np.all(np.abs(got - exact) <= 2e-6 * mass)


@pytest.mark.parametrize("path", PATHS)
def test_matmul_team_matches_matmul(path, kern):
    """rq_matmul_team inside a parallel region (any team size) gives exactly rq_matmul's results."""
    mod, p = kern
    rng = np.random.default_rng(9)
    for t in (T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.F32):
        n = 512
        rows = 75
        W = qp.random_rows(t, rows, n, rng)
        for ntok in (1, 3, 40):
            X = _x(rng, ntok, n)
            want = mod.matmul(int(t), W, rows, n, X, nthreads=1, path=p)
            for nth in (1, 2, 3):
                got = mod.matmul_team(int(t), W, rows, n, X, nthreads=nth, path=p)
                np.testing.assert_array_equal(got, want, err_msg=f"{T(t).name} ntok={ntok} team={nth}")


@pytest.mark.parametrize("path", PATHS)
def test_matmul_multi_matches_matmul(path, kern):
    """Several matmuls over one activation as one parallel job (q/k/v, gate/up in decode) give each
    op exactly rq_matmul's result: mixed types, row counts that split mid-op, 1..3 threads."""
    mod, p = kern
    rng = np.random.default_rng(11)
    n = 512
    specs = [(int(t), qp.random_rows(t, rows, n, rng), rows)
             for t, rows in ((T.Q4_1, 300), (T.Q8_0, 21), (T.Q6_K, 77), (T.Q5_0, 5), (T.Q4_K, 130), (T.IQ4_NL, 40))]
    for ntok in (1, 2, 5):
        X = _x(rng, ntok, n)
        # the shared activations take the largest span the ops need (Q4_K's 256)
        want = [mod.matmul(t, W, rows, n, X, nthreads=1, path=p, span=256) for t, W, rows in specs]
        for nth in (1, 2, 3):
            got = mod.matmul_multi(specs, n, X, nthreads=nth, path=p)
            for (t, _, _), g, w in zip(specs, got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"{T(t).name} ntok={ntok} threads={nth}")
    with pytest.raises(ValueError, match="1 to 32"):
        mod.matmul_multi([], n, _x(rng, 1, n))


@pytest.mark.parametrize("path", PATHS)
def test_matmul_multi_ops_with_their_own_tokens(path, kern):
    """Experts as ops: each op multiplies its own tokens (1, 2, 3 or 40 of them), in one call of many
    ops, and gets exactly rq_matmul's result for those tokens."""
    mod, p = kern
    rng = np.random.default_rng(12)
    n = 512
    specs, want = [], []
    for i, (t, rows, ntok) in enumerate(((T.Q4_K, 48, 1), (T.Q6_K, 32, 2), (T.Q8_0, 16, 3), (T.Q4_0, 64, 40),
                                         (T.F16, 16, 1), (T.Q4_K, 48, 2)) * 2):
        W = qp.random_rows(t, rows, n, rng)
        X = _x(rng, ntok, n)
        specs.append((int(t), W, rows, None, X))
        want.append(mod.matmul(int(t), W, rows, n, X, nthreads=1, path=p))
    for nth in (1, 2):
        got = mod.matmul_multi(specs, n, None, nthreads=nth, path=p)
        for (t, *_), g, w in zip(specs, got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"{T(t).name} threads={nth}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_matmul_batch_invariant(t, path, kern):
    """A token's result must not depend on which other tokens share its matmul (tile sizes 1..8,
    prefill vs decode, threads): bit for bit, so prefix reuse and pass splits give equal outputs."""
    mod, p = kern
    rng = np.random.default_rng(600 + int(t))
    n = _n_for(t, 11, 2)
    rows = 21
    W = qp.random_rows(t, rows, n, rng)
    X = _x(rng, 19, n)
    alone = np.stack([mod.matmul(int(t), W, rows, n, X[k:k + 1], nthreads=1, path=p)[0] for k in range(19)])
    for ntok, threads in ((19, 1), (19, 2), (5, 1), (2, 2)):
        got = mod.matmul(int(t), W, rows, n, X[:ntok], nthreads=threads, path=p)
        np.testing.assert_array_equal(got, alone[:ntok], err_msg=f"ntok={ntok} threads={threads}")
    for k in (0, 7):
        for r in (0, rows - 1):
            assert mod.vec_dot(int(t), W[r], X[k], path=p) == alone[k, r]


# --------------------------------------------------------------------------------------------
# the SIMDe build runs the product's AVX-512 code


@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_simde_build_equals_native_avx512(t, kernels_simde):
    """On a CPU with AVX-512, the SIMDe build's avx512 path (the same sources with the 512-bit
    intrinsics emulated on AVX2) gives the native avx512 path's results bit for bit: what the
    avx512-simde tests check on machines without AVX-512 is the code the product runs."""
    _need("avx512")
    rng = np.random.default_rng(700 + int(t))
    n = _n_for(t, 23, 3)
    rows = 37                                   # 2 groups of 16 rows + 5
    W = qp.random_rows(t, rows, n, rng)
    for ntok in (1, 2, 3, 4, 5, 8, 9, 17, 40):
        X = _x(rng, ntok, n, "outliers" if ntok == 5 else "normal")
        for threads in (1, 2):
            want = q.matmul(int(t), W, rows, n, X, nthreads=threads, path="avx512")
            got = kernels_simde.matmul(int(t), W, rows, n, X, nthreads=threads, path="avx512")
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{T(t).name} ntok={ntok} threads={threads}")
    for r in (0, rows - 1):
        x = _x(rng, 1, n, "outliers")[0]
        assert kernels_simde.vec_dot(int(t), W[r], x, path="avx512") == q.vec_dot(int(t), W[r], x, path="avx512")


def test_simde_build_quantizes_like_native_avx512(kernels_simde):
    _need("avx512")
    rng = np.random.default_rng(13)
    x = _x(rng, 1, 4096, "outliers")[0]
    x[96:128] = 1e-30
    x[160:192] *= np.float32(1e-39)
    x[256:288] = np.float32(0.5) * np.arange(-16, 16, dtype=np.float32)   # exact halves ...
    x[256] = 127.0                                                        # ... at d = 1
    for want, got in zip(q.quantize_act(x, path="avx512"), kernels_simde.quantize_act(x, path="avx512")):
        np.testing.assert_array_equal(got, want)
