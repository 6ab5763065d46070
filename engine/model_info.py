"""What a producer needs to know about a model without loading its weights: the GGUF header, the config,
the tokenizer, the chat template, the KV plan for a budget and the memory a worker of it needs.

A run (`rqllm summarize`, `rqllm extract`) opens one ModelInfo and hands it to its planner, the memory
guard and the choice of workers, so the file's header is parsed once and the tokenizer built once. The
tokenizer, chat template, config and tensor table are read when first asked for: a header-only GGUF (the
one live workers publish, pipeline.model_header) serves to count tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from engine.gguf_file import GGUFFile

if TYPE_CHECKING:
    from engine.chat import ChatFormat
    from engine.model import Config, KVPlan, Weights
    from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class WeightFootprint:
    """The model file's bytes and what the repacked weight cache changes in what a worker reads."""

    model_bytes: int
    replaced_bytes: int = 0  # GGUF bytes the forward pass no longer reads (their repacked copy is used)
    repacked_bytes: int = 0  # the repacked cache file, read instead
    tensor_error: str | None = None  # a tensor missing or not as the metadata says (the file is unusable)

    @property
    def weight_bytes(self) -> int:
        return self.model_bytes - self.replaced_bytes + self.repacked_bytes


class ModelInfo:
    """One model's metadata, read from its GGUF on demand (see the module). Close it, or use `with`."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.gguf = GGUFFile(self.path, index_cache=True)  # the engine opens it next: keep its string index
        self._footprints: dict[bool, WeightFootprint] = {}

    @classmethod
    def open(cls, model: str | os.PathLike[str], *, auto_pull: bool = True) -> ModelInfo:
        """A known model name (fetched when missing, if auto_pull) or a .gguf path."""
        from engine.registry import resolve

        return cls(resolve(model, auto_pull=auto_pull))

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> ModelInfo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @cached_property
    def config(self) -> Config:
        from engine.model import Config

        return Config.from_gguf(self.gguf)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        from engine.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.gguf)

    @cached_property
    def chat(self) -> ChatFormat:
        from engine.chat import ChatFormat

        return ChatFormat.from_gguf(self.gguf, self.tokenizer)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text engine.Engine.prompt_ids(messages=...) encodes (the template writes its BOS)."""
        return self.chat.render(list(messages), add_generation_prompt=True)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False)

    def kv_plan(self, kv_budget: str | int, max_context: int | None = None) -> KVPlan:
        """The KV cache a worker of this model makes under kv_budget (ValueError: a bad budget)."""
        from engine.model import kv_plan

        return kv_plan(self.config, kv_budget, max_context)

    @cached_property
    def _weights(self) -> Weights | str:
        """The tensor table as Model.load checks it, or what is wrong with it."""
        from engine.model import ModelError, Weights

        config = self.config  # (a config that cannot be read is the caller's error, not the table's)
        try:
            return Weights(self.gguf, config)
        except ModelError as e:
            return str(e)

    def footprint(self, repack: bool | None = None) -> WeightFootprint:
        """What a worker's weights take in memory; repack as for Model.load (None: the default
        decision). The tensor table is checked as Model.load checks it (only the table is read)."""
        from engine import repack as repack_cache

        enabled = repack_cache.decide(repack).enabled
        if enabled not in self._footprints:
            weights = self._weights
            if isinstance(weights, str):
                self._footprints[enabled] = WeightFootprint(self.gguf.size, tensor_error=weights)
            elif enabled:
                replaced, repacked = repack_cache.resident_change(self.gguf, weights.matmul_names(),
                                                                  still_read=("token_embd.weight",))
                self._footprints[enabled] = WeightFootprint(self.gguf.size, replaced, repacked)
            else:
                self._footprints[enabled] = WeightFootprint(self.gguf.size)
        return self._footprints[enabled]
