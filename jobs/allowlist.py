"""Which task functions an rqllm worker agrees to run.

Anyone who can write to Redis can enqueue an rq job naming any importable function (`os.system`),
a callback, or a webhook URL. The worker checks every dequeued job before running it:

* the function is `<module>.<name>` with module in ALLOWED_MODULES, name a public identifier, and the
  object a plain function *defined in* that module (so `jobs.tasks.os.system` or an imported helper
  are refused);
* success/failure/stopped callbacks, when set, pass the same check;
* no bound instance (rq's `instance.method` form) and no webhooks.
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

ALLOWED_MODULES: frozenset[str] = frozenset({"jobs.tasks", "jobs.summarize_tasks"})

_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


class RefusedJob(Exception):
    """The job names something the worker will not run."""


def check_function(dotted: str | None) -> str | None:
    """None when `dotted` names an allowed task function, else the reason it is refused."""
    if not dotted or not isinstance(dotted, str):
        return "no function name"
    module_name, _, attr = dotted.rpartition(".")
    if module_name not in ALLOWED_MODULES:
        return f"{dotted!r} is not in an allowed module ({', '.join(sorted(ALLOWED_MODULES))})"
    if not _IDENT.match(attr):
        return f"{dotted!r} is not a public function name"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return f"cannot import {module_name}: {e}"
    obj = getattr(module, attr, None)
    if not inspect.isfunction(obj) or obj.__module__ != module_name:
        return f"{dotted!r} is not a function defined in {module_name}"
    exported = getattr(module, "__all__", None)
    if exported is not None and attr not in exported:
        return f"{dotted!r} is not exported by {module_name}.__all__"
    return None


def check_job(job: Any) -> str | None:
    """None when an rq Job may run, else the reason it is refused (never imports the job's function)."""
    try:
        func_name = job.func_name
        instance = job.instance
    except Exception as e:  # noqa: BLE001 - undecodable payloads are refused, not crashed on
        return f"job payload cannot be decoded: {type(e).__name__}: {e}"
    if instance is not None:
        return "jobs bound to an instance are not allowed"
    reason = check_function(func_name)
    if reason:
        return reason
    for attr in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
        name = getattr(job, attr, None)
        if name:
            reason = check_function(name)
            if reason:
                return f"callback refused: {reason}"
    if getattr(job, "webhooks", None):
        return "webhooks are not allowed"
    return None


def is_allowed(dotted: str) -> bool:
    return check_function(dotted) is None
