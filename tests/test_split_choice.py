"""The embedded workers x threads split (engine.cpus.choose_split), from given CPU counts."""
from __future__ import annotations

from engine.cpus import UsableCpus, choose_split

TWO = UsableCpus(2, "affinity mask: 2 CPUs")
EIGHT = UsableCpus(8, "affinity mask: 8 CPUs")


def test_one_single_threaded_worker_per_cpu_when_there_are_jobs_for_them():
    s = choose_split(10, cpus=EIGHT, environ={})
    assert (s.workers, s.threads) == (8, 1)
    assert "affinity mask: 8 CPUs" in s.reason and "10 job(s)" in s.reason


def test_fewer_jobs_than_cpus_turn_the_spare_cpus_into_threads():
    assert (lambda s: (s.workers, s.threads))(choose_split(1, cpus=TWO, environ={})) == (1, 2)
    assert (lambda s: (s.workers, s.threads))(choose_split(3, cpus=EIGHT, environ={})) == (3, 2)


def test_memory_bounds_the_workers():
    s = choose_split(10, cpus=EIGHT, max_workers=2, environ={})
    assert (s.workers, s.threads) == (2, 4)
    assert "memory for 2 worker(s)" in s.reason


def test_a_thread_count_that_is_set_is_kept():
    assert (lambda s: (s.workers, s.threads))(choose_split(10, cpus=EIGHT, threads=2, environ={})) == (4, 2)
    assert (lambda s: (s.workers, s.threads))(choose_split(1, cpus=EIGHT, threads=1, environ={})) == (1, 1)
    assert (lambda s: (s.workers, s.threads))(choose_split(10, cpus=EIGHT, environ={"RQLLM_THREADS": "4"})) == (2, 4)


def test_given_workers_split_the_cpus_as_before():
    s = choose_split(10, workers=2, cpus=EIGHT, environ={})
    assert (s.workers, s.threads) == (2, 4)
