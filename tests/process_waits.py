"""Waiting for processes to end, in tests of process lifetimes (psutil)."""
from __future__ import annotations

import subprocess
import time

import psutil


def exited(p: psutil.Process) -> bool:
    """Gone, or a zombie: it has exited and only its reaping is left, which is not ours to wait for
    (a parent killed with SIGKILL leaves its children to PID 1, which in some containers never reaps)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of `procs` still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        alive = [p for p in alive if not exited(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, then SIGKILL if it is still running after `grace` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
