"""Process lifetimes: children that stop with their parent, signals that end a command through its
`finally`, and a Redis password kept out of argv (pipeline.embedded and `rqllm serve` use them).

* set_parent_death_signal (prctl PR_SET_PDEATHSIG, Linux): the kernel signals a child when the thread
  that started it ends, its process killed by SIGKILL included. die_with_parent_preexec sets it in a child
  between fork and exec (redis-server); a worker sets it itself from its environment
  (die_with_parent_from_env), which is safe from a threaded parent;
* exit_on_signals: SIGTERM and SIGHUP raise SystemExit, as Ctrl-C raises KeyboardInterrupt, so cleanup
  code runs (Python's default for them ends the process on the spot); signals_held while it does;
* move_redis_url_to_env: a Redis URL holding a password, given on the command line, is moved into
  REDIS_URL by starting the program again in the same process (`ps` shows argv to every local user).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


PARENT_PID_ENV = "RQLLM_PARENT_PID"  # a worker started by an rqllm command: stop when that process dies
PARENT_DEATH_SIGNAL_ENV = "RQLLM_PARENT_DEATH_SIGNAL"  # ... with this signal (a name: KILL, TERM)
_PR_SET_PDEATHSIG = 1


def _libc_prctl():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl() if sys.platform.startswith("linux") else None


def set_parent_death_signal(sig: int, parent_pid: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux; False elsewhere). With
    `parent_pid`, a parent that already died (before this call) is acted on at once. The signal comes when
    the parent *thread* that started this process ends, so start long-lived children from a thread that
    lives as long as they should."""
    if _PRCTL is None or _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def die_with_parent_preexec(sig: int = signal.SIGTERM):
    """A preexec_fn: the child gets `sig` when the process that started it dies, even by SIGKILL, so a
    killed `rqllm serve` leaves no redis-server behind (a restart would start a second one on the same
    append-only file). Resolved before the fork: the child only makes the one call."""
    parent = os.getpid()
    return lambda: set_parent_death_signal(sig, parent)


def die_with_parent_from_env() -> None:
    """In a worker: the parent-death signal its starter asked for (PARENT_PID_ENV, PARENT_DEATH_SIGNAL_ENV),
    set by the worker itself rather than by a preexec_fn, which is unsafe in a threaded parent (`rqllm
    serve` restarts workers from a thread). The variables are not passed on to its own children."""
    parent = os.environ.pop(PARENT_PID_ENV, "").strip()
    name = os.environ.pop(PARENT_DEATH_SIGNAL_ENV, "").strip() or "KILL"
    if parent.isdigit():
        set_parent_death_signal(getattr(signal, "SIG" + name.upper(), signal.SIGKILL), int(parent))


def _has_credentials(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        return bool(parts.password or parts.username) or "password=" in parts.query
    except ValueError:
        return "@" in url


def move_redis_url_to_env(url: str | None, option: str = "--redis-url") -> None:
    """A Redis URL holding a password, given on this process's command line (`--redis-url URL`), is
    visible to every local user in `ps` for as long as the process runs: start this program again in
    the same process (os.execve: the pid, open files and parent stay) with the URL in REDIS_URL and
    without the option. Returns when there is nothing to move (or it cannot be done safely)."""
    if not url or not _has_credentials(url) or sys.argv[:1] == ["-"]:
        return
    args = sys.argv[1:]  # this program's own arguments, at the end of the interpreter's command line
    orig = list(getattr(sys, "orig_argv", []))
    if not args or len(orig) <= len(args) or orig[len(orig) - len(args):] != args:
        return  # not a command line of ours (e.g. the command invoked in-process)
    for i, token in enumerate(args):
        if token == option and args[i + 1:i + 2] == [url]:
            kept = args[:i] + args[i + 2:]
            break
        if token == f"{option}={url}":
            kept = args[:i] + args[i + 1:]
            break
    else:
        return
    env = dict(os.environ, REDIS_URL=url)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.execve(sys.executable, [sys.executable, *orig[1:len(orig) - len(args)], *kept], env)


_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end this process through SystemExit (like Ctrl-C through KeyboardInterrupt), so
    the `finally` that stops its children runs; Python's default for them ends it on the spot. Only in
    the main thread (where signal handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_exit) for sig in _EXIT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """While children are being stopped: a second Ctrl-C or SIGTERM does not cut that short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (*_EXIT_SIGNALS, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
