"""How decode runs over repacked weights (engine/decode_tuning.py): the kernels (the path's R16
kernels, the AVX2 R16 kernels on the avx512 path, or the GGUF layout) and the prefetch, chosen by
timing at load or fixed by RQLLM_DECODE_KERNELS / RQLLM_DECODE_PREFETCH; the logits are the same bit
for bit whatever they are, on both SIMD paths."""
from __future__ import annotations

import numpy as np
import pytest

from engine import decode_tuning
from engine.kernels import _kernels as q
from engine.model import Model
from tests import quant_pack as qp


@pytest.fixture(autouse=True)
def _restore():
    before = q.r16_set_prefetch(0)
    mode = q.set_decode_mode("r16")
    q.set_decode_mode(mode)
    q.r16_set_prefetch(*before)
    yield
    q.set_decode_mode(mode)
    q.r16_set_prefetch(*before)


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_results_do_not_depend_on_the_kernels_or_the_distance(smollm2_path, path, monkeypatch):
    if not q.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    before = q.kernel_path()
    q.set_path(path)
    ids = [1, 504, 3000, 17, 9000, 42, 7, 256]
    got = []
    settings = [("r16", "off", (0, False)), ("r16", "64", (64, False)), ("r16", "6144:l2", (6144, True)),
                ("r16-256", "65536", (65536, False)), ("gguf", None, None)]
    try:
        for kernels, prefetch, want in settings:
            monkeypatch.setenv(decode_tuning.ENV_KERNELS, kernels)
            if prefetch is None:
                monkeypatch.delenv(decode_tuning.ENV, raising=False)
            else:
                monkeypatch.setenv(decode_tuning.ENV, prefetch)
            model = Model.load(str(smollm2_path), threads=2, kv_budget="4MiB")
            text = model.layout.reason
            assert decode_tuning.ENV_KERNELS in text
            effective = "r16" if kernels == "r16-256" and path == "avx2" else kernels
            assert q.set_decode_mode(effective) == effective  # the load set it
            if want is not None:
                assert q.r16_set_prefetch(*want) == want
                assert decode_tuning.ENV in text
            model.forward(ids[:4], 0)
            got.append(np.stack([model.forward([t], 4 + i).copy() for i, t in enumerate(ids[4:])]))
    finally:
        q.set_path(before)
    for other in got[1:]:
        np.testing.assert_array_equal(other, got[0])


@pytest.mark.parametrize("t", [qp.T.Q4_K, qp.T.Q6_K, qp.T.IQ4_XS, qp.T.Q8_0])
def test_every_decode_mode_gives_the_same_bits(t):
    """rq_matmul_r16 and rq_matmul_multi for 1 and 3 tokens, in each mode, against the "r16" mode."""
    rng = np.random.default_rng(5 + int(t))
    rows, cols = 80, 512
    W = qp.random_rows(t, rows, cols, rng)
    R = np.zeros(q.r16_bytes(int(t), rows, cols), dtype=np.uint8)
    q.r16_repack(int(t), W, rows, cols, R, 0, (rows + 15) // 16)
    X = rng.standard_normal((3, cols)).astype(np.float32)
    results = {}
    for mode in decode_tuning.KERNELS:
        q.set_decode_mode(mode)
        one = q.matmul_r16(int(t), W, R, rows, cols, X[:1], 2)
        three = q.matmul_r16(int(t), W, R, rows, cols, X, 2)
        multi = q.matmul_multi([(int(t), W, rows, R), (int(t), W, 48, R)], cols, X[:1], 2)
        results[mode] = (one, three, multi[0], multi[1])
    for mode, got in results.items():
        for a, b in zip(got, results["r16"]):
            np.testing.assert_array_equal(a, b, err_msg=mode)
    # and the R16 result is the GGUF layout's plain matmul
    np.testing.assert_array_equal(results["r16"][0], q.matmul(int(t), W, rows, cols, X[:1]))


def test_measured_choice_is_made_per_type_among_the_candidates_and_says_why(smollm2_path, monkeypatch):
    import re

    from gguf import GGMLQuantizationType

    monkeypatch.delenv(decode_tuning.ENV, raising=False)
    monkeypatch.delenv(decode_tuning.ENV_KERNELS, raising=False)
    model = Model.load(str(smollm2_path), threads=1, kv_budget="4MiB")
    if model.repacked is None:
        pytest.skip("no repacked layout on this kernel path")
    text = model.layout.reason
    assert "measured per type on up to" in text and "GB/s" in text
    cands = decode_tuning.candidates(q.kernel_path())
    kinds = {c.kernels for c in cands}
    assert kinds == ({"r16", "r16-256"} if q.kernel_path() == "avx512" else {"r16"})  # the GGUF layout: not timed
    types = {t.type for t in model.repacked.plan.tensors}
    assert len(types) >= 2  # SmolLM2's Q4_1 file: Q4_1 layers and a Q8_0 embedding
    for t in types:
        name = GGMLQuantizationType(t).name
        mode = q.set_decode_mode("r16", t)
        distance, to_l2 = q.r16_set_prefetch(0, False, t)
        chosen = decode_tuning.Decode(mode, decode_tuning.Prefetch(distance, to_l2))
        assert chosen in cands, name
        assert f"{name}: {chosen}" in text
        timed = re.search(rf"{name} \d+ MB: ([^;)]*)", text).group(1)
        for candidate in cands:  # each was timed for this type
            assert re.search(rf"(^| ){re.escape(candidate.short())} \d+\.\d", timed), (name, candidate)


def test_the_timing_reads_each_matrix_cold_once_per_candidate(monkeypatch):
    """A decode pass reads a matrix a whole pass after it last did: the timing must not multiply a
    matrix just before timing it (that left one smaller than the last-level cache there, and the
    kernels that compute fastest won over those that stream fastest)."""
    rng = np.random.default_rng(3)
    t, rows, cols = 12, 32, 256  # Q4_K
    W = qp.random_rows(t, rows, cols, rng)
    R = np.zeros(q.r16_bytes(t, rows, cols), np.uint8)
    q.r16_repack(t, W, rows, cols, R, 0, rows // 16)
    reads = []
    real = q.matmul_r16

    def counting(t_, w, r, rows_, cols_, x, threads, path=None, reps=0, warm_up=True):
        reads.append(max(reps, 1) + (1 if warm_up and reps > 0 else 0))  # the kernel's calls
        return real(t_, w, r, rows_, cols_, x, threads, path, reps, warm_up)

    monkeypatch.setattr(q, "matmul_r16", counting)
    monkeypatch.setattr(decode_tuning, "KEEP_WITHIN", float("inf"))  # every candidate timed every round
    cands = decode_tuning.candidates(q.kernel_path())[:2]
    decode_tuning._time_candidates(cands, t, [(W, R, rows, cols)], 1)
    assert len(reads) == 1 + decode_tuning.ROUNDS * len(cands)  # the paging-in sweep, then one per candidate and round
    assert reads == [1] * len(reads)  # each call multiplies once: the timed call is the only read


def _one_q4k_matrix(rows=32, cols=256, seed=3):
    t = 12  # Q4_K
    W = qp.random_rows(t, rows, cols, np.random.default_rng(seed))
    R = np.zeros(q.r16_bytes(t, rows, cols), np.uint8)
    q.r16_repack(t, W, rows, cols, R, 0, rows // 16)
    return t, (W, R, rows, cols)


def test_a_candidate_far_behind_after_the_first_round_sits_out_the_rest(monkeypatch):
    """Sweeps past a large last-level cache are long: a candidate over KEEP_WITHIN x the first round's
    best is not timed again, the others are timed every round."""
    t, m = _one_q4k_matrix()
    fake = iter([9.0, 1.0, 2.0] + [1.0] * 20)  # warm-up, round one (cands[0], cands[1]), then cands[0] only
    calls = []

    def timed(*args, **kwargs):
        calls.append(1)
        return next(fake)

    monkeypatch.setattr(q, "matmul_r16", timed)
    cands = decode_tuning.candidates(q.kernel_path())[:2]
    best = decode_tuning._time_candidates(cands, t, [m], 1)
    assert len(calls) == 1 + len(cands) + (decode_tuning.ROUNDS - 1)
    assert best == {cands[0]: 1.0, cands[1]: 2.0}


def test_last_level_cache_size_from_sysfs(tmp_path):
    """The largest data/unified cache of cpu0 (instruction caches do not count); nothing readable: 0."""
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "64K"),
                                                 (2, "Unified", "2048K"), (3, "Unified", "491520K")]):
        d = tmp_path / "cpu0" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert decode_tuning.last_level_cache_bytes(tmp_path) == 491520 << 10
    assert decode_tuning.last_level_cache_bytes(tmp_path / "missing") == 0
    # a 480 MB cache: sweeps of 1.5x it; a 32 MB one (or none known): the 96 MB floor
    assert decode_tuning.stream_bytes(491520 << 10) == int(1.5 * (491520 << 10))
    assert decode_tuning.stream_bytes(32 << 20) == decode_tuning.MIN_STREAM_BYTES
    assert decode_tuning.stream_bytes(0) == decode_tuning.MIN_STREAM_BYTES


def test_a_type_short_of_the_sweep_is_swept_with_other_types_untimed():
    """A type whose matrices fit the cache is timed in sweeps filled up with other types' matrices
    (largest first, to the limit), so that its own come from memory as in a decode pass."""
    def fake(nbytes):
        return (np.zeros(1, np.uint8), np.zeros(nbytes, np.uint8), 16, 256)

    own = [fake(10), fake(30)]
    others = [(14, fake(50)), (14, fake(5)), (18, fake(40))]
    timed, filler = decode_tuning.streamed(own, others, limit=100)
    assert [m[1].nbytes for m in timed] == [30, 10]
    assert [(u, m[1].nbytes) for u, m in filler] == [(14, 50), (18, 40)]  # 30 + 10 + 50 + 40 >= 100: stop
    timed, filler = decode_tuning.streamed(own, others, limit=35)
    assert [m[1].nbytes for m in timed] == [30, 10] and filler == []
    timed, filler = decode_tuning.streamed(own + [fake(200)], others, limit=100)
    assert [m[1].nbytes for m in timed] == [200] and filler == []


def test_environment_narrows_the_candidates():
    def left(env, path="avx512"):
        return decode_tuning._narrowed(path, env)

    cands, used = left({"RQLLM_DECODE_KERNELS": "gguf"})
    assert cands == [decode_tuning.Decode("gguf", decode_tuning.OFF)] and used == ["RQLLM_DECODE_KERNELS"]
    cands, used = left({"RQLLM_DECODE_PREFETCH": "off"})
    assert cands == [decode_tuning.Decode("r16", decode_tuning.OFF), decode_tuning.Decode("r16-256", decode_tuning.OFF)]
    cands, _ = left({"RQLLM_DECODE_PREFETCH": "off"}, path="avx2")
    assert cands == [decode_tuning.Decode("r16", decode_tuning.OFF)]
    cands, _ = left({"RQLLM_DECODE_KERNELS": "r16-256", "RQLLM_DECODE_PREFETCH": "128:l2"}, path="avx2")
    assert cands == [decode_tuning.Decode("r16", decode_tuning.Prefetch(128, True))]
    assert len(left({})[0]) == 10  # r16 and r16-256 (avx512 path), each with off, 6K-L1 and 6K/12K/24K-L2


@pytest.mark.parametrize("var, value, message", [
    ("RQLLM_DECODE_PREFETCH", "lots", "RQLLM_DECODE_PREFETCH must be off, <bytes> or <bytes>:l2, not 'lots'"),
    ("RQLLM_DECODE_KERNELS", "fast", "RQLLM_DECODE_KERNELS must be one of r16, r16-256, gguf, not 'fast'"),
])
def test_a_bad_setting_is_refused(smollm2_path, monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        Model.load(str(smollm2_path), threads=1, kv_budget="4MiB")
