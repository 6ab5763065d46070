"""Whether a model can follow chat prompts, told from its GGUF metadata alone.

A base (pretrained-only) model given a chat prompt continues the text instead of answering it:
the Gemma 3 270M that `rqllm models pull gemma3-270m` fetches is the base model, its GGUF has no
chat template, and llama.cpp's chat completion with it returns an empty answer; our summaries with
it echo the prompt. engine.chat still renders such a model's chats with a built-in format (that
is what its family's instruct variant was trained on), so nothing fails: callers use this to warn,
and to keep the model out of the summarisation choices (raw completion stays fine).

A model counts as able to chat when its GGUF carries a chat template (tokenizer.chat_template:
whoever converted it shipped a chat format), or when its name says it was instruction-tuned
(general.name, general.finetune, general.basename or the file name holding the word instruct,
chat or it, as in "SmolLM2-135M-Instruct", "gemma-3-270m-it", "Llama-2-7b-chat").
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Metadata fields that name the model; the file name is looked at too.
NAME_FIELDS = ("general.name", "general.finetune", "general.basename")
# Words (between separators, any case) that mark an instruction-tuned model.
INSTRUCT_WORDS = frozenset({"instruct", "chat", "it"})
_WORDS = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class ChatCapability:
    has_template: bool
    instruct_evidence: str | None  # e.g. "general.finetune = 'Instruct'"; None: no name says so

    @property
    def can_chat(self) -> bool:
        return self.has_template or self.instruct_evidence is not None

    def describe(self, model: str) -> str:
        """One line on why `model` can or cannot chat."""
        if self.has_template:
            return f"{model} can chat: its GGUF carries a chat template"
        if self.instruct_evidence is not None:
            return f"{model} can chat: no chat template, but it looks instruction-tuned ({self.instruct_evidence})"
        return (f"{model} looks like a base model: its GGUF has no chat template and no name saying instruct, "
                f"chat or it. Chat prompts (rqllm summarize, chat completions) get a continuation of the prompt "
                f"rather than an answer; use it for raw completion, or an instruction-tuned model")


def looks_instruction_tuned(name: str) -> bool:
    """Whether one of the words of `name` is instruct, chat or it ("Qwen2.5-0.5B-Instruct": yes,
    "instructor-base": no, "gemma-3-270m-it": yes, "italian-gpt": no)."""
    return any(w in INSTRUCT_WORDS for w in _WORDS.findall(name.lower()))


def chat_capability(metadata: Mapping[str, Any], path: str | os.PathLike[str] | None = None) -> ChatCapability:
    """From a GGUF's metadata (GGUFFile.metadata, or any mapping of its keys) and, when given, its
    file name."""
    template = metadata.get("tokenizer.chat_template")
    has_template = isinstance(template, str) and bool(template.strip())
    names = [(field, metadata.get(field)) for field in NAME_FIELDS]
    if path is not None:
        names.append(("file name", Path(path).name))
    evidence = next((f"{field} = {value!r}" for field, value in names
                     if isinstance(value, str) and looks_instruction_tuned(value)), None)
    return ChatCapability(has_template, evidence)


def model_chat_capability(path: str | os.PathLike[str]) -> ChatCapability:
    """chat_capability of the GGUF file at `path` (reads its header only)."""
    from engine.gguf_file import GGUFFile

    with GGUFFile(path) as gguf:
        return chat_capability(gguf.metadata, path)
