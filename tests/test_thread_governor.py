"""The thread governor's decisions, driven by scripted clocks (the decision logic only; bench/bench_load.py
measures the effect on real processes sharing cores)."""
from __future__ import annotations

import pytest

from engine import thread_governor as tg
from engine.thread_governor import ThreadGovernor


class Clocks:
    """Wall and CPU clocks that a scripted pass advances."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def pass_taking(self, wall: float, cpu_share: float):
        def one_pass(threads: int) -> None:
            self.wall += wall
            self.cpu += wall * threads * cpu_share
            self.threads_seen.append(threads)

        self.threads_seen: list[int] = []
        return one_pass


def governor(clocks: Clocks, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, enabled=True, wall_clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)


def test_keeps_all_threads_when_they_get_the_cpu():
    clocks = Clocks()
    gov = governor(clocks)
    step = clocks.pass_taking(0.05, 0.95)
    for _ in range(100):
        gov.run(step)
    assert set(clocks.threads_seen) == {2}


def test_drops_to_one_thread_when_starved_and_retries_later():
    clocks = Clocks()
    gov = governor(clocks)
    starved = clocks.pass_taking(0.05, 0.3)
    for _ in range(5):  # 0.25 s: one window
        gov.run(starved)
    assert gov.threads == 1
    gov.run(starved)
    assert clocks.threads_seen[-1] == 1
    clocks.wall += tg.RETRY_S  # time passes: the next pass tries both threads again
    gov.run(clocks.pass_taking(0.05, 0.95))
    assert clocks.threads_seen == [2]


def test_failed_retries_wait_longer_each_time():
    clocks = Clocks()
    gov = governor(clocks)
    starved = clocks.pass_taking(0.25, 0.3)
    waits = []
    for _ in range(8):
        gov.run(starved)  # a window of all threads: starved, drop
        assert gov.threads == 1
        waits.append(gov._retry_at - clocks.wall)
        clocks.wall = gov._retry_at
    assert waits[:4] == pytest.approx([tg.RETRY_S, 2 * tg.RETRY_S, 4 * tg.RETRY_S, 8 * tg.RETRY_S])
    assert max(waits) == pytest.approx(tg.RETRY_MAX_S)


def test_a_good_retry_resets_the_wait():
    clocks = Clocks()
    gov = governor(clocks)
    gov.run(clocks.pass_taking(0.25, 0.3))
    clocks.wall = gov._retry_at
    gov.run(clocks.pass_taking(0.25, 0.3))  # failed retry: wait doubles
    clocks.wall = gov._retry_at
    gov.run(clocks.pass_taking(0.25, 0.95))  # good retry
    gov.run(clocks.pass_taking(0.25, 0.3))  # starved again
    assert gov._retry_at - clocks.wall == pytest.approx(tg.RETRY_S)


def test_disabled_or_single_thread_never_switches(monkeypatch):
    clocks = Clocks()
    monkeypatch.setenv("RQLLM_ADAPTIVE_THREADS", "0")
    gov = ThreadGovernor(2, wall_clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    starved = clocks.pass_taking(0.25, 0.1)
    for _ in range(4):
        gov.run(starved)
    assert set(clocks.threads_seen) == {2}
    one = governor(clocks, threads=1)
    step = clocks.pass_taking(0.25, 0.1)
    one.run(step)
    assert clocks.threads_seen == [1]


def test_model_switches_threads_without_changing_results(smollm2_path):
    """The compiled model takes a new thread count between passes; the logits stay bit-identical."""
    import numpy as np

    from engine.model import Model

    model = Model.load(smollm2_path, threads=2, kv_budget="16MiB")
    tokens = [int(t) for t in np.random.default_rng(7).integers(100, 40000, size=20)]
    both = model.forward_all(tokens).copy()
    assert model._fwd.set_threads(1) == 1
    model._threads_set = 1
    one = model._fwd
    out = np.zeros_like(both)
    one.forward(tokens, 0, out, True)
    np.testing.assert_array_equal(out, both)
    assert model._fwd.set_threads(5) == 2  # never more than it was built for
