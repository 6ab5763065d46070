"""Repacked weights (R16, quants.c): the same bits as the GGUF rows in 16-row groups.

A matmul on the R16 copy must give the GGUF layout's results bit for bit, for every type with an
R16 layout, any token count (decode, the few-token kernel, the expand-then-prefill route) and any
thread count; its size must be the GGUF's (plus a little for Q4_K's and IQ4_XS's unpacked scales).
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests import quant_pack as qp
from tests.conftest import SIMDE_PATH, VNNI_PATH, VNNI_SIMDE_PATH

q = pytest.importorskip("engine.kernels._kernels", reason="build the kernels: python setup.py build_ext --inplace")

R16_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]


def _n_for(t) -> int:
    return 256 * 3 if T(t) in qp.BLOCK256_TYPES else 32 * 23   # odd block count for the legacy types


def _repack(t, W, rows, cols, chunks=1):
    R = np.full(q.r16_bytes(int(t), rows, cols), 0xA5, dtype=np.uint8)   # junk: repacking must overwrite it all
    groups = (rows + 15) // 16
    edges = np.linspace(0, groups, chunks + 1).astype(int)
    for g0, g1 in zip(edges[:-1], edges[1:]):
        q.r16_repack(int(t), W, rows, cols, R, int(g0), int(g1), 2)
    return R


def test_types_and_sizes():
    for t in qp.ALL_TYPES:
        assert q.r16_supported(int(t)) == (t in R16_TYPES), T(t).name
    for t in R16_TYPES:
        n = _n_for(t)
        gguf = 16 * q.row_bytes(int(t), n)
        # Q4_K and Q5_K keep scales and mins as bytes, IQ4_XS its scales
        extra = {T.Q4_K: 64, T.Q5_K: 64, T.IQ4_XS: 32}.get(t, 0) * (n // 256)
        assert q.r16_bytes(int(t), 16, n) == gguf + extra, T(t).name
        assert q.r16_bytes(int(t), 17, n) == 2 * (gguf + extra)   # rows padded to whole groups
    assert q.r16_bytes(int(T.Q2_K), 16, 256) == 0


@pytest.mark.parametrize("t", R16_TYPES, ids=[T(t).name for t in R16_TYPES])
def test_repack_is_deterministic_and_chunkable(t):
    rng = np.random.default_rng(70 + int(t))
    n, rows = _n_for(t), 50
    W = qp.random_rows(t, rows, n, rng)
    a, b = _repack(t, W, rows, n), _repack(t, W, rows, n, chunks=3)
    np.testing.assert_array_equal(a, b)
    W2 = W.copy()
    W2[33, 5] ^= 0x10                     # one bit of one row changes the copy
    assert not np.array_equal(_repack(t, W2, rows, n), a)


# avx512-simde: the AVX-512 R16 kernels built with SIMDe for AVX2 (conftest's `kern`), so they run
# on CPUs without AVX-512 too; the same for the AVX2 path's AVX-VNNI kernels (avx2-vnni-simde)
R16_PATHS = ["avx2", VNNI_PATH, "avx512", SIMDE_PATH, VNNI_SIMDE_PATH]


@pytest.mark.parametrize("path", R16_PATHS)
@pytest.mark.parametrize("t", R16_TYPES, ids=[T(t).name for t in R16_TYPES])
def test_r16_matmul_equals_gguf_layout_bit_for_bit(t, path, kern):
    mod, p = kern
    rng = np.random.default_rng(80 + int(t))
    n, rows = _n_for(t), 37
    W = qp.random_rows(t, rows, n, rng)
    R = _repack(t, W, rows, n)
    for ntok in (1, 2, 3, 5, 11, 12, 29):   # the few-token kernel and the expand route (>= 12)
        X = rng.standard_normal((ntok, n)).astype(np.float32)
        want = q.matmul(int(t), W, rows, n, X, nthreads=1, path="avx2")   # the product build, GGUF rows
        for threads in (1, 2):
            got = mod.matmul_r16(int(t), W, R, rows, n, X, nthreads=threads, path=p)
            np.testing.assert_array_equal(got, want, err_msg=f"ntok={ntok} threads={threads}")


def test_paths_without_r16_kernels_use_the_gguf_rows():
    rng = np.random.default_rng(5)
    t, n, rows = T.Q4_K, 512, 20
    W = qp.random_rows(t, rows, n, rng)
    R = np.zeros(q.r16_bytes(int(t), rows, n), dtype=np.uint8)   # never repacked: all zero
    X = rng.standard_normal((3, n)).astype(np.float32)
    for path in ("scalar",):
        if q.cpu_supports(path):
            np.testing.assert_array_equal(q.matmul_r16(int(t), W, R, rows, n, X, path=path),
                                          q.matmul(int(t), W, rows, n, X, path=path))


def test_r16_multi_op_shares_cover_every_group_once():
    """A multi-op call splits the ops' concatenated groups into chunks of equal bytes (8 a thread, taken
    by whichever thread is free): every group falls in exactly one chunk. (A share ending inside q once
    also took all of k and v, computed again by the next thread: the 1.5B shape's decode qkv ran 96
    groups on one thread and 64 on the other.)"""
    rng = np.random.default_rng(7)
    shapes = [[(T.Q4_K, 1536), (T.Q4_K, 256), (T.Q6_K, 256)],   # 1.5B shape q, k, v
              [(T.Q4_K, 4096), (T.Q4_K, 1024), (T.Q6_K, 1024)],  # 8B shape
              [(T.Q4_K, 8960), (T.Q4_K, 8960)]]                  # gate, up
    for _ in range(20):
        shapes.append([(rng.choice([T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0]), int(rng.integers(1, 2000)))
                       for _ in range(int(rng.integers(1, 6)))])
    for ops in shapes:
        for cols in (1536, 4096):
            gb = [q.r16_bytes(int(t), 16, cols) for t, _ in ops]
            ng = [(rows + 15) // 16 for _, rows in ops]
            total = sum(g * n for g, n in zip(gb, ng))
            for nth in (1, 2, 3, 4, 7, 16, 24, 56):   # chunks: 8 per thread
                seen = [np.zeros(n, dtype=int) for n in ng]
                for me in range(nth):
                    lo, hi, base = total * me // nth, total * (me + 1) // nth, 0
                    for i, (g, n) in enumerate(zip(gb, ng)):
                        share = q.r16_multi_share(lo, hi, base, g, n)
                        if share is not None:
                            seen[i][share[0]:share[1]] += 1
                        base += g * n
                for i, s in enumerate(seen):
                    assert (s == 1).all(), (ops, cols, nth, i, s.min(), s.max())


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_r16_decode_split_between_threads_is_exact(path):
    """Decode-sized jobs big enough to be shared (above the serial threshold): chunks taken by whichever
    thread is free, 2-4 threads, give 1 thread's results bit for bit, one op and a q/k/v-style multi-op
    job of mixed types."""
    if not q.cpu_supports(path):
        pytest.skip(f"no {path}")
    rng = np.random.default_rng(21)
    n = 1536
    specs = []
    for t, rows in ((T.IQ4_XS, 1000), (T.Q4_K, 256), (T.Q5_K, 272), (T.Q6_K, 333)):
        W = qp.random_rows(t, rows, n, rng)
        specs.append((int(t), W, rows, _repack(t, W, rows, n)))
    X = rng.standard_normal((1, n)).astype(np.float32)
    t, W, rows, R = specs[0]
    want = q.matmul_r16(t, W, R, rows, n, X, nthreads=1, path=path)
    want_multi = q.matmul_multi(specs, n, X, nthreads=1, path=path)
    for threads in (2, 3, 4):
        for _ in range(3):
            np.testing.assert_array_equal(q.matmul_r16(t, W, R, rows, n, X, nthreads=threads, path=path), want)
            for got, w in zip(q.matmul_multi(specs, n, X, nthreads=threads, path=path), want_multi):
                np.testing.assert_array_equal(got, w, err_msg=f"threads={threads}")


@pytest.mark.parametrize("path", R16_PATHS)
def test_r16_experts_with_their_own_tokens_equal_one_by_one(path, kern):
    """A mixture-of-experts pass: 20 ops (more than a dense layer's) with R16 copies, each over its own
    tokens (1 to 20: packed groups, and expanded ones from 8 tokens on AVX2, 12 on AVX-512, in one job
    split by cost over all ops), as the GGUF layout."""
    mod, p = kern
    rng = np.random.default_rng(400)
    n = 512
    specs = []
    for i in range(20):
        t = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0)[i % 4]
        rows, ntok = 16 * (1 + i % 3), (1, 2, 8, 9, 3, 20, 1)[i % 7]
        W = qp.random_rows(t, rows, n, rng)
        specs.append((int(t), W, rows, _repack(t, W, rows, n), rng.standard_normal((ntok, n)).astype(np.float32)))
    for threads in (1, 2):
        got = mod.matmul_multi(specs, n, None, nthreads=threads, path=p)
        for (t, W, rows, R, X), out in zip(specs, got):
            np.testing.assert_array_equal(out, q.matmul(t, W, rows, n, X, path="avx2"), err_msg=f"{T(t).name}")


@pytest.mark.parametrize("path", R16_PATHS)
def test_r16_experts_of_one_token_share_its_tile(path, kern):
    """A decode step's experts all read the routed token: ops with the same activations and a type of
    the same offset share one token tile (Q8_0 and IQ4_XS do, Q4_K and Q6_K do not: the tile's nq
    differs), and every op still gets the GGUF layout's result."""
    mod, p = kern
    rng = np.random.default_rng(410)
    n = 512
    token, other = (rng.standard_normal((k, n)).astype(np.float32) for k in (1, 2))
    specs = []
    for i, t in enumerate((T.Q4_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.Q4_K, T.Q6_K)):
        rows = 16 * (1 + i % 3)
        W = qp.random_rows(t, rows, n, rng)
        specs.append((int(t), W, rows, _repack(t, W, rows, n), other if i in (4, 7) else token))
    for threads in (1, 2):
        got = mod.matmul_multi(specs, n, None, nthreads=threads, path=p)
        for (t, W, rows, R, X), out in zip(specs, got):
            # both activations are shared with a Q4_K op: quantized with its span
            np.testing.assert_array_equal(out, q.matmul(t, W, rows, n, X, path="avx2", span=256), err_msg=f"{T(t).name}")


@pytest.mark.parametrize("path", R16_PATHS)
@pytest.mark.parametrize("ntok", [1, 2, 3, 5, 8, 9])
def test_r16_multi_op_matmul_equals_one_by_one(ntok, path, kern):
    """q/k/v-style calls with R16 copies of mixed types (different offsets: one token tile per op), as one
    parallel job up to 8 tokens (decode and speculative verification) and one by one above."""
    mod, p = kern
    rng = np.random.default_rng(300 + ntok)
    n = 512
    specs = []
    for t, rows in ((T.Q4_K, 48), (T.Q6_K, 16), (T.Q8_0, 33), (T.Q5_0, 70), (T.IQ4_XS, 20)):
        W = qp.random_rows(t, rows, n, rng)
        specs.append((int(t), W, rows, _repack(t, W, rows, n)))
    X = rng.standard_normal((ntok, n)).astype(np.float32)
    for threads in (1, 2):
        got = mod.matmul_multi(specs, n, X, nthreads=threads, path=p)
        for (t, W, rows, R), out in zip(specs, got):
            np.testing.assert_array_equal(out, q.matmul(t, W, rows, n, X, path="avx2", span=256), err_msg=f"{T(t).name}")


@pytest.mark.parametrize("build", ["product", "simde"])
def test_avx2_prefill_runs_the_vnni_kernels_when_they_are_on(build, request):
    """The avx2 path's expanded (prefill) route takes the AVX-VNNI kernels exactly when they are on (the
    bit-for-bit tests above cannot tell the two apart); one-token calls and the avx512 path never do."""
    mod = q if build == "product" else request.getfixturevalue("kernels_simde")
    if not mod.cpu_supports("avx2"):
        pytest.skip("this CPU cannot run the avx2 path")
    before = mod.avxvnni()
    try:
        try:
            mod.set_avxvnni(True)
        except ValueError:
            pytest.skip("this CPU has no AVX-VNNI")
        for t in R16_TYPES:
            assert mod.matmul_route(int(t), 64, path="avx2") == "r16-expanded-vnni", T(t).name
            assert mod.matmul_route(int(t), 1, path="avx2") == "r16", T(t).name
            assert mod.matmul_route(int(t), 64, r16=False, path="avx2") != "r16-expanded-vnni", T(t).name
            if mod.cpu_supports("avx512"):
                assert mod.matmul_route(int(t), 64, path="avx512") == "r16-expanded", T(t).name
        mod.set_avxvnni(False)
        for t in R16_TYPES:
            assert mod.matmul_route(int(t), 64, path="avx2") == "r16-expanded", T(t).name
    finally:
        mod.set_avxvnni(before)


def _gated_want(mod, p, gate, up, kind):
    return np.stack([mod.gated_act_f32(gate[k], up[k], kind == "gelu", path=p) for k in range(gate.shape[0])])


@pytest.mark.parametrize("path", R16_PATHS)
@pytest.mark.parametrize("ntok", [1, 3, 8, 20])
def test_gated_pairs_give_the_activation_of_gate_and_up(ntok, path, kern):
    """Gated pairs (gate, then up) in one job: the gate's result is act(gate) * up, bit for bit as the two
    matmuls and then the activation over whole rows. Experts with their own tokens (1 to 20) and a dense
    pair on the call's tokens; with R16 copies the pairs of jobs up to 8 tokens (and all experts) are
    activated row range by row range as the job computes them, the others after."""
    mod, p = kern
    rng = np.random.default_rng(500 + ntok)
    n = 512
    X = rng.standard_normal((ntok, n)).astype(np.float32)
    experts, gated = [], {}
    for e, (t, rows, own) in enumerate(((T.Q4_K, 48, 1), (T.Q6_K, 40, 9), (T.IQ4_XS, 32, 20), (T.Q8_0, 64, 3))):
        Xe = rng.standard_normal((own, n)).astype(np.float32)
        for _ in range(2):   # gate, up: same type, rows and tokens
            W = qp.random_rows(t, rows, n, rng)
            experts.append((int(t), W, rows, _repack(t, W, rows, n), Xe))
        gated[2 * e] = ("silu", "gelu")[e % 2]
    dense = []
    for _ in range(2):
        W = qp.random_rows(T.Q4_K, 80, n, rng)
        dense.append((int(T.Q4_K), W, 80, _repack(T.Q4_K, W, 80, n)))
    for specs, gates in ((experts, gated), (dense, {0: "gelu"})):
        for threads in (1, 2):
            plain = mod.matmul_multi(specs, n, X, nthreads=threads, path=p)
            got = mod.matmul_multi(specs, n, X, nthreads=threads, path=p, gated=gates)
            for i in range(len(specs)):
                want = _gated_want(mod, p, plain[i], plain[i + 1], gates[i]) if i in gates else plain[i]
                np.testing.assert_array_equal(got[i], want, err_msg=f"op {i} threads={threads}")
    with pytest.raises(ValueError, match="gated"):
        mod.matmul_multi(dense, n, X, path=p, gated={1: "silu"})   # the last op has no up after it
