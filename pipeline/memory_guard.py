"""A worker's start-up check: model + KV cache fit in memory, and the model file is a GGUF we can run.

Run before the engine loads (and before Redis is touched), so a worker that cannot work says why at
once instead of being OOM-killed halfway through a job or failing every job it takes:

* the GGUF header, the model's config and its tensor table are checked as Model.load would
  (milliseconds; a truncated or corrupt file, an unknown architecture or quant type, a tensor shape
  that does not match the metadata... is reported here with the reader's message, no traceback);
* the memory needed is the model file's size (its weights are memory-mapped and used in place; other
  workers on the host share the same page-cache pages, so the file counts once, not per thread) plus
  the bytes the KV cache will really allocate (the budget, capped by what the model's context length
  can use). With the repacked weight cache (engine.repack) the matmul weights are read from that
  file instead: their GGUF bytes are not counted, the cache file is (once: it is shared too); a
  tied token_embd counts in both, since the embedding lookup still reads its GGUF rows;
* the memory the process can have is the smallest of its cgroup limit (v2 memory.max, v1
  memory.limit_in_bytes, along its cgroup path) and MemAvailable (psutil).

`--no-memory-check` or RQLLM_NO_MEMORY_CHECK=1 skips the memory comparison (the file checks stay).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click
import psutil

from engine.cgroups import own_cgroups
from engine.kv_cache import format_bytes
from engine.defaults import DEFAULT_KV_BUDGET

if TYPE_CHECKING:
    from engine.model_info import ModelInfo

ENV_SKIP = "RQLLM_NO_MEMORY_CHECK"
_NO_LIMIT = 1 << 60  # cgroup v1 reports "unlimited" as a huge page-aligned number


class MemoryGuardError(click.ClickException):
    """The worker must not start; the message names the numbers (click prints it, exit status 1)."""


@dataclass(frozen=True)
class MemoryPlan:
    model_path: Path
    model_bytes: int
    kv_budget: int
    kv_bytes: int  # what the KV cache will allocate (<= kv_budget)
    kv_tokens: int
    max_tokens: int  # the model's context length (the KV cache never holds more)
    limit_bytes: int
    limit_source: str
    tensor_error: str | None = None  # a tensor missing or not as the metadata says (the file is unusable)
    replaced_bytes: int = 0  # GGUF bytes the forward pass no longer reads (their R16 copy is used)
    repacked_bytes: int = 0  # the repacked cache file, read instead

    @property
    def weight_bytes(self) -> int:
        return self.model_bytes - self.replaced_bytes + self.repacked_bytes

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.limit_bytes

    def describe(self) -> str:
        capped = "" if self.kv_tokens < self.max_tokens else \
            f" (--kv-budget {format_bytes(self.kv_budget)}, capped by the model's context length)"
        weights = f"model {self.model_path.name} {format_bytes(self.model_bytes)}"
        if self.repacked_bytes:
            weights = (f"model {self.model_path.name} {format_bytes(self.model_bytes)} - "
                       f"{format_bytes(self.replaced_bytes)} read from the repacked cache "
                       f"{format_bytes(self.repacked_bytes)} instead")
        return (f"{weights} + KV cache "
                f"{format_bytes(self.kv_bytes)} for {self.kv_tokens} tokens{capped} = "
                f"{format_bytes(self.needed_bytes)} needed; {format_bytes(self.limit_bytes)} available "
                f"({self.limit_source})")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if value < _NO_LIMIT else None


def cgroup_limit(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """The tightest memory limit along this process's cgroup path, with the file it came from."""
    best: tuple[int, str] | None = None
    for controllers, path in own_cgroups("memory"):
        hierarchy = "memory" if controllers else ""   # v1: the memory controller's own mount
        base = root / hierarchy if hierarchy else root
        name = "memory.limit_in_bytes" if hierarchy else "memory.max"
        rel = Path(path.lstrip("/"))
        # Inside a container the cgroup path may not exist under the mount (the mount is the
        # container's own cgroup): then the mount's top-level file is ours.
        candidates = [base.joinpath(*rel.parts[:i]) for i in range(len(rel.parts), -1, -1)]
        for directory in candidates:
            value = _read_int(directory / name)
            if value is not None and (best is None or value < best[0]):
                best = (value, str(directory / name))
    return best


def memory_limit() -> tuple[int, str]:
    """(bytes this process can have, where that number comes from)."""
    available = psutil.virtual_memory().available
    limit, source = available, "MemAvailable"
    cg = cgroup_limit()
    if cg is not None and cg[0] < limit:
        limit, source = cg[0], f"cgroup limit {cg[1]}"
    return limit, source


def open_model_info(model: str) -> ModelInfo:
    """The model's ModelInfo (its header parsed); MemoryGuardError when there is no such model or its
    file is no GGUF we can read (what the worker's start-up check would say)."""
    from engine import registry
    from engine.gguf_file import GGUFError
    from engine.model_info import ModelInfo

    try:
        path = registry.resolve(model)
    except registry.ModelError as e:
        raise MemoryGuardError(str(e)) from None
    try:
        return ModelInfo(path)
    except GGUFError as e:
        raise MemoryGuardError(f"cannot use the model: {e}") from None


def plan(model: str | ModelInfo, kv_budget: str | int | None, repack: bool | None = None,
         max_context: int | None = None) -> MemoryPlan:
    """Read the model's header and work out what the worker will need; MemoryGuardError when the file
    or the budget cannot be used. model: a name or path, or a run's ModelInfo (read, not closed).
    repack as for Model.load (None: the default decision); max_context caps the KV cache's tokens (a
    draft model's: the target's)."""
    from engine.gguf_file import GGUFError
    from engine.model import ModelError, kv_plan
    from engine.model_info import ModelInfo

    info = model if isinstance(model, ModelInfo) else None
    opened = info if info is not None else open_model_info(model)
    path = opened.path
    try:
        try:
            cfg = opened.config
            # Every tensor the model needs is there with the shape and type its metadata implies (the
            # checks Model.load makes); reported by check_worker_start after the memory comparison.
            weights = opened.footprint(repack)
        finally:
            if info is None:
                opened.close()
    except (GGUFError, ModelError) as e:
        raise MemoryGuardError(f"cannot use the model: {e}") from None
    try:
        kv = kv_plan(cfg, kv_budget or DEFAULT_KV_BUDGET, max_context)
    except ValueError as e:
        raise MemoryGuardError(f"--kv-budget: {e}") from None
    limit, source = memory_limit()
    return MemoryPlan(Path(path), weights.model_bytes, kv.budget_bytes, kv.kv_bytes, kv.tokens, kv.max_tokens, limit,
                      source, weights.tensor_error, weights.replaced_bytes, weights.repacked_bytes)


WORKER_OVERHEAD_BYTES = 150 * 2**20  # a worker's own memory besides its KV cache (bench_memory --pss: ~90 MB)


def workers_that_fit(model: str | ModelInfo, kv_budget: str | int | None, repack: bool | None = None) -> int | None:
    """How many workers of `model` this machine's memory holds (the weights once, in the page cache;
    each worker its KV cache and own memory), or None when that cannot be worked out."""
    try:
        p = plan(model, kv_budget, repack=repack)
    except Exception:  # an unusable model is reported by the workers' own start-up check
        return None
    per_worker = p.kv_bytes + WORKER_OVERHEAD_BYTES
    return max(1, (p.limit_bytes - p.weight_bytes) // per_worker)


def check_worker_start(model: str | ModelInfo, kv_budget: str | int | None, *, memory_check: bool = True,
                       repack: bool | None = None, draft: str | None = None) -> MemoryPlan:
    """The start-up check; raises MemoryGuardError naming every number when the worker would not fit.
    draft: a draft model (--draft) loaded too, with a KV cache of as many tokens as the model's; its
    vocabulary must be the model's."""
    p = plan(model, kv_budget, repack)
    d = None
    if draft is not None:
        d = plan(draft, 1 << 50, repack, max_context=p.kv_tokens)  # the budget never binds: the tokens do
        _check_draft_vocabulary(p.model_path, d.model_path)
    skip = not memory_check or os.environ.get(ENV_SKIP, "").strip() not in ("", "0")
    needed = p.needed_bytes + (d.needed_bytes if d is not None else 0)
    if not skip and needed > p.limit_bytes:
        both = p.describe() if d is None else (
            f"{p.describe()}; with the draft model {d.model_path.name} ({format_bytes(d.weight_bytes)} + KV cache "
            f"{format_bytes(d.kv_bytes)}) {format_bytes(needed)} in all")
        raise MemoryGuardError(
            f"not starting the worker: {both}. Lower --kv-budget, use a smaller model, give the "
            f"process more memory, or pass --no-memory-check (or {ENV_SKIP}=1) to start anyway.")
    for what, q in (("the model", p), ("the draft model", d)):
        if q is not None and q.tensor_error is not None:
            raise MemoryGuardError(f"cannot use {what}: {q.tensor_error}")
    return p


def _check_draft_vocabulary(model: Path, draft: Path) -> None:
    from engine.drafting import VocabularyMismatch, check_same_vocabulary
    from engine.gguf_file import GGUFFile

    with GGUFFile(model, index_cache=True) as target, GGUFFile(draft, index_cache=True) as small:
        try:
            check_same_vocabulary(target, small)
        except VocabularyMismatch as e:
            raise MemoryGuardError(str(e)) from None


def no_memory_check_option(fn):
    """The worker's --no-memory-check flag (sets RQLLM_NO_MEMORY_CHECK for check_worker_start)."""

    def _set(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            os.environ[ENV_SKIP] = "1"

    return click.option("--no-memory-check", is_flag=True, expose_value=False, callback=_set, is_eager=True,
                        help="Start even when model + KV budget exceed the memory available (experts).")(fn)
