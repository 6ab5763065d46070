"""Thread choice (engine.cpus): the affinity mask, cgroup v1/v2 CPU quotas read from fake trees in
tmp_path, the override order (--threads, RQLLM_THREADS, detection), and what the worker does with it."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.cpus import (
    ENV_THREADS,
    ThreadChoice,
    ThreadSettingError,
    UsableCpus,
    cgroup_cpu_quota,
    choose_threads,
    usable_cpus,
)
from tests.conftest_redis import redis_server, redis_url  # noqa: F401

FOUR = {0, 1, 2, 3}


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cgroup_tree(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> dict[str, Path]:
    """A fake /proc/self/cgroup and /sys/fs/cgroup; `files` are paths under the root with contents."""
    proc = tmp_path / "proc-self-cgroup"
    write(proc, proc_cgroup)
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir()
    for rel, text in files.items():
        write(root / rel, text)
    return {"proc_cgroup": proc, "cgroup_root": root}


def cpus(tmp_path: Path, proc_cgroup: str, files: dict[str, str], mask=FOUR) -> UsableCpus:
    return usable_cpus(affinity=lambda: mask, **cgroup_tree(tmp_path, proc_cgroup, files))


# --- cgroup v2 ------------------------------------------------------------------------------------

def test_v2_quota_is_rounded_down(tmp_path):
    got = cpus(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert got.count == 1
    assert got.reason == "4 CPUs in the affinity mask; cgroup cpu.max 150000/100000 -> 1"


def test_v2_whole_cpus(tmp_path):
    assert cpus(tmp_path, "0::/\n", {"cpu.max": "200000 100000\n"}).count == 2


def test_v2_quota_under_one_cpu_still_gives_one_thread(tmp_path):
    assert cpus(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"}).count == 1


def test_v2_max_is_no_quota(tmp_path):
    got = cpus(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert got == UsableCpus(4, "4 CPUs in the affinity mask; no cgroup CPU quota")


def test_quota_above_the_affinity_mask_does_not_raise_the_count(tmp_path):
    got = cpus(tmp_path, "0::/\n", {"cpu.max": "800000 100000\n"}, mask={0, 1})
    assert got.count == 2
    assert got.reason == "2 CPUs in the affinity mask; cgroup cpu.max 800000/100000 allows 8"


def test_v2_nested_path_takes_the_tightest_level(tmp_path):
    proc = "0::/user.slice/user-1000.slice/app.scope\n"
    got = cpus(tmp_path, proc, {
        "user.slice/cpu.max": "300000 100000\n",
        "user.slice/user-1000.slice/cpu.max": "max 100000\n",
        "user.slice/user-1000.slice/app.scope/cpu.max": "250000 100000\n",
    })
    assert got.count == 2 and "250000/100000" in got.reason
    tighter_parent = cpus(tmp_path / "b", proc, {
        "user.slice/cpu.max": "100000 100000\n",
        "user.slice/user-1000.slice/app.scope/cpu.max": "400000 100000\n",
    })
    assert tighter_parent.count == 1 and "100000/100000" in tighter_parent.reason


def test_v2_container_without_cgroup_namespace_reads_the_mount_top(tmp_path):
    # The path is the host's (/system.slice/docker-<id>.scope) and absent under the container's mount.
    got = cpus(tmp_path, "0::/system.slice/docker-0123abcd.scope\n", {"cpu.max": "200000 100000\n"})
    assert got.count == 2


def test_missing_files_mean_no_quota(tmp_path):
    assert cpus(tmp_path, "0::/\n", {}).reason.endswith("; no cgroup CPU quota")
    tree = cgroup_tree(tmp_path / "b", "", {})
    assert cgroup_cpu_quota(proc_cgroup=tmp_path / "no-such-proc-file", cgroup_root=tree["cgroup_root"]) is None
    assert cgroup_cpu_quota(proc_cgroup=tree["proc_cgroup"], cgroup_root=tmp_path / "no-such-root") is None


def test_unreadable_quota_text_is_ignored(tmp_path):
    assert cpus(tmp_path, "0::/\n", {"cpu.max": "lots\n"}).count == 4
    assert cpus(tmp_path / "b", "0::/\n", {"cpu.max": "100000 0\n"}).count == 4


# --- cgroup v1 ------------------------------------------------------------------------------------

V1_PROC = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"


def test_v1_quota(tmp_path):
    got = cpus(tmp_path, V1_PROC, {"cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
                                   "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert got.count == 2
    assert got.reason == ("4 CPUs in the affinity mask; cgroup cpu.cfs_quota_us/cpu.cfs_period_us "
                          "250000/100000 -> 2")


def test_v1_minus_one_is_no_quota(tmp_path):
    got = cpus(tmp_path, V1_PROC, {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                   "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert got.count == 4 and got.reason.endswith("no cgroup CPU quota")


def test_v1_nested_path_and_the_plain_cpu_mount(tmp_path):
    # Only the "cpu" name is mounted (no "cpu,cpuacct" directory); the quota sits on the job's own cgroup.
    got = cpus(tmp_path, "3:cpu,cpuacct:/batch/job7\n", {
        "cpu/batch/cpu.cfs_quota_us": "-1\n", "cpu/batch/cpu.cfs_period_us": "100000\n",
        "cpu/batch/job7/cpu.cfs_quota_us": "100000\n", "cpu/batch/job7/cpu.cfs_period_us": "100000\n",
    })
    assert got.count == 1


def test_v1_missing_period_is_no_quota(tmp_path):
    assert cpus(tmp_path, V1_PROC, {"cpu,cpuacct/cpu.cfs_quota_us": "100000\n"}).count == 4


def test_hybrid_hierarchy_reads_the_v1_cpu_controller(tmp_path):
    # systemd's hybrid layout: controllers on v1, an empty v2 tree (no cpu.max) alongside.
    got = cpus(tmp_path, "1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "100000\n",
                                             "cpu/cpu.cfs_period_us": "50000\n", "unified/cgroup.procs": ""})
    assert got.count == 2


# --- the real process and the affinity mask ------------------------------------------------------

def test_this_process_never_exceeds_its_affinity_mask():
    got = usable_cpus()
    assert 1 <= got.count <= len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)
    assert "affinity mask" in got.reason


def test_affinity_mask_of_one_cpu(tmp_path):
    assert cpus(tmp_path, "0::/\n", {}, mask={3}).reason == "1 CPU in the affinity mask; no cgroup CPU quota"


# --- the override order ---------------------------------------------------------------------------

DETECTED = UsableCpus(4, "4 CPUs in the affinity mask; no cgroup CPU quota")


def test_threads_option_wins_over_the_environment_and_detection():
    assert choose_threads(3, environ={ENV_THREADS: "2"}, cpus=DETECTED) == ThreadChoice(3, "--threads 3")


def test_environment_wins_over_detection():
    assert choose_threads(environ={ENV_THREADS: " 2 "}, cpus=DETECTED) == ThreadChoice(2, "RQLLM_THREADS=2")
    assert choose_threads(environ={ENV_THREADS: "2"}, workers=4, cpus=DETECTED).threads == 2  # per worker


def test_empty_environment_value_is_unset():
    # compose passes `RQLLM_THREADS: ${RQLLM_THREADS:-}` as "" when .env leaves it out.
    assert choose_threads(environ={ENV_THREADS: ""}, cpus=DETECTED) == ThreadChoice(4, DETECTED.reason)


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_bad_environment_value_is_an_error(bad):
    with pytest.raises(ThreadSettingError, match="RQLLM_THREADS"):
        choose_threads(environ={ENV_THREADS: bad}, cpus=DETECTED)


def test_workers_share_the_detected_cpus():
    assert choose_threads(workers=2, environ={}, cpus=DETECTED) == \
        ThreadChoice(2, DETECTED.reason + "; shared by 2 workers -> 2 each")
    assert choose_threads(workers=8, environ={}, cpus=DETECTED).threads == 1


def test_engine_default_follows_the_environment(monkeypatch):
    from engine.model import default_threads

    monkeypatch.setenv(ENV_THREADS, "3")
    assert default_threads() == 3
    monkeypatch.delenv(ENV_THREADS)
    assert default_threads() == usable_cpus().count


def test_embedded_default_splits_the_usable_cpus(monkeypatch):
    import pipeline.embedded as embedded

    started = []
    monkeypatch.delenv(ENV_THREADS, raising=False)
    monkeypatch.setattr(embedded, "choose_threads", lambda **kw: choose_threads(cpus=DETECTED, environ={}, **kw))
    monkeypatch.setattr(embedded.Cluster, "start_worker", lambda self, **kw: started.append(kw["threads"]))
    with embedded.embedded_cluster("smollm2-135m", workers=2):
        pass
    assert started == [2, 2]


# --- the worker -----------------------------------------------------------------------------------

def test_worker_refuses_a_bad_rqllm_threads_without_a_traceback():
    from pipeline.cli_worker import worker_command

    result = CliRunner().invoke(worker_command, ["--model", "smollm2-135m"], env={ENV_THREADS: "lots"})
    assert result.exit_code == 2
    assert "RQLLM_THREADS must be a whole number" in result.output and "Traceback" not in result.output


class _FakeEngine:
    def __init__(self, threads: int):
        self.threads = threads


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_worker_logs_the_thread_count_and_why(redis_url, monkeypatch):  # noqa: F811
    import pipeline.worker as worker

    loaded = []
    monkeypatch.setattr(worker, "load_engine",
                        lambda model, threads, kv_budget, **kw: loaded.append(threads) or _FakeEngine(threads))
    monkeypatch.setenv(ENV_THREADS, "3")
    lines = _Lines()
    rq_log = logging.getLogger("rq.worker")  # rq's handlers do not propagate: listen on its own logger
    rq_log.addHandler(lines)
    try:
        worker.run_worker("smollm2-135m", redis_url=redis_url, burst=True, name="threads-log")
    finally:
        rq_log.removeHandler(lines)
    assert loaded == [3]
    assert any("3 engine threads (RQLLM_THREADS=3)" in line for line in lines.lines), lines.lines
