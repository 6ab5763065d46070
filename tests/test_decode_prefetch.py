"""The decode prefetch (engine/decode_prefetch.py): chosen by timing at load, or forced by
RQLLM_DECODE_PREFETCH; the logits are the same bit for bit whatever it is, on both SIMD paths."""
from __future__ import annotations

import numpy as np
import pytest

from engine import decode_prefetch
from engine.kernels import _kernels as q
from engine.model import Model


@pytest.fixture(autouse=True)
def _restore():
    before = q.r16_set_prefetch(0)
    q.r16_set_prefetch(*before)
    yield
    q.r16_set_prefetch(*before)


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_results_do_not_depend_on_the_distance(smollm2_path, path, monkeypatch):
    from engine.kernels import _kernels

    if not q.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    before = _kernels.kernel_path()
    _kernels.set_path(path)
    ids = [1, 504, 3000, 17, 9000, 42, 7, 256]
    got = []
    try:
        for setting, want in (("off", (0, False)), ("64", (64, False)), ("6144:l2", (6144, True)),
                              ("65536", (65536, False))):
            monkeypatch.setenv(decode_prefetch.ENV, setting)
            model = Model.load(str(smollm2_path), threads=2, kv_budget="4MiB")
            assert q.r16_set_prefetch(*want) == want  # the load set it
            assert f"{decode_prefetch.ENV}" in model.layout.describe()
            model.forward(ids[:4], 0)
            got.append(np.stack([model.forward([t], 4 + i).copy() for i, t in enumerate(ids[4:])]))
    finally:
        _kernels.set_path(before)
    for other in got[1:]:
        np.testing.assert_array_equal(other, got[0])


def test_measured_choice_is_one_of_the_candidates_and_says_why(smollm2_path, monkeypatch):
    monkeypatch.delenv(decode_prefetch.ENV, raising=False)
    model = Model.load(str(smollm2_path), threads=1, kv_budget="4MiB")
    if model.repacked is None:
        pytest.skip("no repacked layout on this kernel path")
    text = model.layout.describe()
    assert "decode prefetch" in text and "measured on a" in text and "GB/s" in text
    distance, to_l2 = q.r16_set_prefetch(0)
    chosen = decode_prefetch.Prefetch(distance, to_l2)
    assert chosen in decode_prefetch.CANDIDATES
    assert f"decode prefetch {chosen} (" in text
    for candidate in decode_prefetch.CANDIDATES:  # each was timed
        assert f"{candidate}: " in text


def test_a_bad_setting_is_refused(smollm2_path, monkeypatch):
    monkeypatch.setenv(decode_prefetch.ENV, "lots")
    with pytest.raises(ValueError, match="RQLLM_DECODE_PREFETCH must be off, <bytes> or <bytes>:l2, not 'lots'"):
        Model.load(str(smollm2_path), threads=1, kv_budget="4MiB")
