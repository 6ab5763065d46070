"""Which models jobs can name: a model no live worker holds and engine.registry does not know would
leave its jobs waiting on a queue nobody serves, so producers refuse it at validation (model_not_found):
the API's batch runner, `rqllm submit` and `rqllm summarize`."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.schemas import InvalidJob, model_key
from pipeline.client import Client

if TYPE_CHECKING:
    from engine.model_info import ModelInfo


def served_model_keys(client: Client) -> set[str]:
    """The model keys (jobs.schemas.model_key) of the models live workers hold."""
    out: set[str] = set()
    for w in client.workers():
        try:
            if w.get("model"):
                out.add(model_key(w["model"]))
        except InvalidJob:
            pass  # a worker started under a name no job can reach
    return out


class ModelCheck:
    """Whether jobs naming a model can run: a live worker holds it, or engine.registry knows it (a known
    name, which a worker pulls; with files=True also a path to an existing .gguf file, for a worker on
    this machine). Called with a model name: None when it can, else why not (one line), so a line naming
    it is refused at validation (model_not_found) instead of waiting on a queue nobody serves.
    served=None: no workers are asked (the model must be known or, with files, a file here)."""

    def __init__(self, served: Iterable[str] | None = (), *, files: bool = False):
        self.served = set(served) if served is not None else None
        self.files = files
        self._verdicts: dict[str, str | None] = {}

    @classmethod
    def live(cls, client: Client | None, *, files: bool = False) -> ModelCheck:
        """The models `client`'s live workers hold now (none without a client), plus the known ones."""
        return cls(served_model_keys(client) if client is not None else (), files=files)

    def __call__(self, model: str) -> str | None:
        if model not in self._verdicts:
            self._verdicts[model] = self._why_not(model)
        return self._verdicts[model]

    def _why_not(self, model: str) -> str | None:
        from engine.registry import KNOWN_MODELS

        try:
            key = model_key(model)
        except InvalidJob as e:
            return str(e)
        if key in (self.served or ()) or key in {model_key(name) for name in KNOWN_MODELS}:
            return None
        name = model.strip()
        if self.files and name.lower().endswith(".gguf") and Path(name).expanduser().is_file():
            return None
        shown = repr(model) if len(model) <= 80 else repr(model[:80]) + "..."
        served = "" if self.served is None else \
            f"not served by any live worker (they hold: {', '.join(sorted(self.served)) or 'none'}) and "
        return (f"model {shown} is {served}not a known model ({', '.join(sorted(KNOWN_MODELS))})"
                + (" nor an existing .gguf file" if self.files else ""))


def model_file_problem(model: str | ModelInfo, kv_budget: str | int | None = None) -> str | None:
    """What a worker's start-up check (pipeline.memory_guard.check_worker_start) would refuse in `model`'s
    file, without the memory comparison: a file that is no GGUF, an unknown architecture, missing or
    mis-shaped tensors, a bad KV budget. None when a worker would load it. A producer that starts
    workers (embedded mode) asks first, so the user gets this one line instead of the workers' exits.
    A known model not yet cached is fetched (the workers need it anyway). model: a name or path, or
    a run's ModelInfo."""
    from pipeline.memory_guard import MemoryGuardError, check_worker_start

    try:
        check_worker_start(model, kv_budget, memory_check=False, repack=False)
    except MemoryGuardError as e:
        return str(e)
    return None
