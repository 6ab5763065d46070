"""How many CPUs this process may really use, and so how many engine threads to run.

os.cpu_count() is the host's count. A process pinned to some cores (taskset, a cpuset: its affinity
mask) or a container given `cpus: 1.5` (a cgroup CPU quota) gets fewer, and an OpenMP team larger than
the CPUs it gets stalls at every barrier: two 2-thread workers on 2 cores ran 35x slower at prefill
than one. So the thread count comes from

* the affinity mask, os.sched_getaffinity(0) (it already reflects a cpuset);
* the tightest CPU quota along the process's own cgroup path (/proc/self/cgroup under /sys/fs/cgroup):
  cgroup v2 `cpu.max` ("150000 100000", or "max 100000" for none), cgroup v1 `cpu.cfs_quota_us` /
  `cpu.cfs_period_us` (-1 for none). This is what compose's `cpus:` and `docker run --cpus` set.

A quota is rounded down, with a minimum of 1: with 1.5 CPUs of quota, two threads use up the group's
time 3/4 of the way into each scheduler period and are then both throttled for the rest, so every
barrier waits out the throttle; one thread never hits the quota and the remaining half CPU runs the
worker's Python and Redis I/O. Below one CPU of quota one thread is still needed.

An explicit count wins: the `--threads` option, then the RQLLM_THREADS environment variable (an
empty value counts as unset, as compose passes an unset variable through). Every choice comes with a
reason, which `rqllm worker` logs at start-up.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.cgroups import PROC_SELF_CGROUP, own_cgroups

ENV_THREADS = "RQLLM_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")


class ThreadSettingError(ValueError):
    """RQLLM_THREADS is set to something that is not a thread count."""


@dataclass(frozen=True)
class CgroupCpuQuota:
    """A CPU quota: `quota_us` of CPU time per `period_us` of wall time, read from `files` in `directory`."""

    quota_us: int
    period_us: int
    directory: Path
    files: str  # "cpu.max" (v2) or "cpu.cfs_quota_us/cpu.cfs_period_us" (v1)

    @property
    def share(self) -> float:
        return self.quota_us / self.period_us

    @property
    def cpus(self) -> int:
        """Whole CPUs the quota allows, rounded down, at least 1 (see the module docstring)."""
        return max(1, self.quota_us // self.period_us)

    def describe(self) -> str:
        return f"cgroup {self.files} {self.quota_us}/{self.period_us}"


@dataclass(frozen=True)
class UsableCpus:
    count: int
    reason: str  # e.g. "2 CPUs in the affinity mask; cgroup cpu.max 150000/100000 -> 1"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def _read_v2(directory: Path) -> CgroupCpuQuota | None:
    try:
        fields = (directory / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit() or int(fields[1]) == 0:
        return None  # "max 100000": no quota
    return CgroupCpuQuota(int(fields[0]), int(fields[1]), directory, "cpu.max")


def _read_v1(directory: Path) -> CgroupCpuQuota | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None  # -1: no quota
    return CgroupCpuQuota(quota, period, directory, "cpu.cfs_quota_us/cpu.cfs_period_us")


def cgroup_cpu_quota(*, proc_cgroup: Path = PROC_SELF_CGROUP,
                     cgroup_root: Path = CGROUP_ROOT) -> CgroupCpuQuota | None:
    """The tightest CPU quota on this process's cgroup path and its ancestors (each level limits all
    below it), or None when there is none."""
    best: CgroupCpuQuota | None = None
    for hierarchy, path in own_cgroups("cpu", proc_cgroup):
        if hierarchy:
            # v1: mounted per controller set ("cpu,cpuacct", usually also reachable as "cpu").
            bases = [cgroup_root / hierarchy, cgroup_root / "cpu"]
            read = _read_v1
        else:
            bases = [cgroup_root]
            read = _read_v2
        rel = Path(path.lstrip("/")).parts
        for base in dict.fromkeys(bases):
            if not base.is_dir():
                continue
            # Inside a container without its own cgroup namespace the path is the host's and does
            # not exist under the mount (the mount is the container's own cgroup): then the mount's
            # top-level files are ours. Walking every ancestor covers both.
            for depth in range(len(rel), -1, -1):
                quota = read(base.joinpath(*rel[:depth]))
                if quota is not None and (best is None or quota.share < best.share):
                    best = quota
            break
    return best


def _affinity_count() -> tuple[int, str]:
    try:
        return len(os.sched_getaffinity(0)), "in the affinity mask"
    except AttributeError:  # not Linux: no affinity mask and no cgroups to read either
        return os.cpu_count() or 1, "on this machine (os.cpu_count(); no affinity mask here)"


def usable_cpus(*, affinity: Callable[[], Collection[int]] | None = None, proc_cgroup: Path = PROC_SELF_CGROUP,
                cgroup_root: Path = CGROUP_ROOT) -> UsableCpus:
    """CPUs this process may use: its affinity mask, capped by its cgroup CPU quota (rounded down)."""
    if affinity is None:
        count, where = _affinity_count()
    else:
        count, where = len(affinity()), "in the affinity mask"
    count = max(1, count)
    reason = f"{count} CPU{'s' if count != 1 else ''} {where}"
    quota = cgroup_cpu_quota(proc_cgroup=proc_cgroup, cgroup_root=cgroup_root)
    if quota is None:
        return UsableCpus(count, reason + "; no cgroup CPU quota")
    if quota.cpus < count:
        return UsableCpus(quota.cpus, f"{reason}; {quota.describe()} -> {quota.cpus}")
    return UsableCpus(count, f"{reason}; {quota.describe()} allows {quota.share:g}")


def threads_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """RQLLM_THREADS as a count, None when unset or empty; ThreadSettingError when it is not a count."""
    raw = (os.environ if environ is None else environ).get(ENV_THREADS, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ThreadSettingError(f"{ENV_THREADS} must be a whole number of threads, at least 1; got {raw!r}")
    return int(raw)


def choose_threads(requested: int | None = None, *, workers: int = 1, environ: Mapping[str, str] | None = None,
                   cpus: UsableCpus | None = None) -> ThreadChoice:
    """Engine threads for each of `workers` processes sharing this process's CPUs.

    `requested` is an explicit count (the --threads option) and wins; then RQLLM_THREADS; otherwise
    the usable CPUs (`cpus`, detected when not given) divided among the workers, at least 1 each.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if requested is not None:
        if requested < 1:
            raise ThreadSettingError(f"threads must be at least 1; got {requested}")
        return ThreadChoice(requested, f"--threads {requested}")
    from_env = threads_from_env(environ)
    if from_env is not None:
        return ThreadChoice(from_env, f"{ENV_THREADS}={from_env}")
    cpus = cpus or usable_cpus()
    if workers == 1:
        return ThreadChoice(cpus.count, cpus.reason)
    each = max(1, cpus.count // workers)
    return ThreadChoice(each, f"{cpus.reason}; shared by {workers} workers -> {each} each")


@dataclass(frozen=True)
class SplitChoice:
    workers: int
    threads: int
    reason: str


def choose_split(jobs: int, *, workers: int | None = None, threads: int | None = None,
                 max_workers: int | None = None, environ: Mapping[str, str] | None = None,
                 cpus: UsableCpus | None = None) -> SplitChoice:
    """Workers x engine threads for an embedded run of `jobs` independent jobs on this process's CPUs.

    Given `workers`, threads come from choose_threads. Otherwise one single-threaded worker per
    usable CPU (or per `threads` CPUs when a thread count is set), no more workers than jobs (an idle
    worker's CPU would be better used as a thread of a busy one) and than `max_workers` (memory: each
    worker has its own KV cache). Measured on 2 cores (bench/bench_summarize.py, examples/): 2 x 1
    summarised in 15.2 s, 1 x 2 in 17.6 s: decode gains little from a second thread of one job and
    all of it from a second job; bench/bench_load.py's prefill-heavy set ran within 8 % either way.
    """
    if workers is not None:
        choice = choose_threads(threads, workers=workers, environ=environ, cpus=cpus)
        return SplitChoice(workers, choice.threads, choice.reason)
    cpus = cpus or usable_cpus()
    given = threads if threads is not None else threads_from_env(environ)
    per = max(1, given or 1)
    n = max(1, min(cpus.count // per or 1, jobs, max_workers or jobs))
    if given is None and n < cpus.count:  # fewer jobs (or less memory) than CPUs: spare CPUs become threads
        per = max(1, cpus.count // n)
    limits = [f"{jobs} job(s)"] + ([f"memory for {max_workers} worker(s)"] if max_workers else [])
    return SplitChoice(n, per, f"{cpus.reason}; one worker per {per} CPU(s), at most {', '.join(limits)}")
