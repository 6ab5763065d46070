"""The cgroups this process belongs to, read from /proc/self/cgroup (shared by the CPU-quota and
memory-limit checks)."""
from __future__ import annotations

from pathlib import Path

PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def own_cgroups(controller: str, proc_cgroup: Path = PROC_SELF_CGROUP) -> list[tuple[str, str]]:
    """(hierarchy, path) pairs of the cgroups that can hold `controller`'s limits: ('', path) for
    cgroup v2, (the v1 controllers, e.g. 'cpu,cpuacct', path) for a v1 hierarchy with it."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out.append(("", path))
        elif controller in controllers.split(","):
            out.append((controllers, path))
    return out
