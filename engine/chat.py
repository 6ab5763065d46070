"""Chat prompt rendering: the GGUF's ``tokenizer.chat_template`` in a Jinja2 sandbox, or a built-in format.

* Templates run in ``jinja2.sandbox.ImmutableSandboxedEnvironment`` (as HF
  transformers does): attribute access to Python internals (``__class__``,
  ``__globals__``...) and mutation of the inputs are refused with
  ``ChatTemplateError``.  The template sees ``messages``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token``, ``raise_exception(msg)``, ``strftime_now(fmt)`` and
  the ``tojson`` filter.
* Gemma GGUFs carry no template: the built-in Gemma turn format folds system
  prompts into the next user turn (as llama.cpp's built-in "gemma" template does)
  and starts with ``<bos>`` (as HF's Gemma template does).
* Anything else without a template falls back to ChatML.
* The rendered text already holds the BOS token when the model needs one: tokenize
  it with ``add_bos=False`` (``ChatFormat.encode`` does that, never doubling BOS).

Messages are validated first (pydantic): role in system/user/assistant, content a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

__all__ = ["ChatFormat", "ChatMessage", "ChatError", "ChatTemplateError", "GEMMA_TEMPLATE", "CHATML_TEMPLATE"]

ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """Invalid chat messages (unknown role, non-string content, empty conversation)."""


class ChatTemplateError(ChatError):
    """The chat template is broken, raised an exception, or tried something the sandbox refuses."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    role: Literal["system", "user", "assistant"]
    content: StrictStr


# llama.cpp's built-in "gemma" format: system text (trimmed) goes at the top of the
# next user turn followed by a blank line; "assistant" is called "model"; content is
# trimmed.  Like HF's Gemma template it starts with the BOS token.
GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- set ns.system = ns.system + (m.content | trim) -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if ns.system and role != 'model' -%}{{ ns.system + '\\n\\n' }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ (m.content | trim) + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

CHATML_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _RefusingUndefined(jinja2.Undefined):
    """Plain ``Undefined`` renders as '' -- fine for missing variables, but the sandbox
    answers an unsafe attribute (``__globals__``...) with an Undefined too, which would
    silently print nothing.  Make any use of those raise the SecurityError instead."""

    __slots__ = ()

    def _refuse(self) -> None:
        if self._undefined_exception is SecurityError:
            self._fail_with_undefined_error()

    def __str__(self) -> str:
        self._refuse()
        return super().__str__()

    def __bool__(self) -> bool:
        self._refuse()
        return super().__bool__()

    def __iter__(self):
        self._refuse()
        return super().__iter__()

    def __len__(self) -> int:
        self._refuse()
        return super().__len__()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False,
        undefined=_RefusingUndefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatError(f"messages must be a list of {{'role', 'content'}} dicts, not {type(messages).__name__}")
    if not messages:
        raise ChatError("messages is empty")
    out = []
    for k, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        if not isinstance(m, Mapping):
            raise ChatError(f"message {k}: expected a dict with 'role' and 'content', got {type(m).__name__}")
        try:
            out.append(ChatMessage.model_validate(dict(m)))
        except ValidationError as e:
            problems = []
            for err in e.errors():
                field = ".".join(str(x) for x in err["loc"]) or "message"
                if field == "role" and err["type"] == "literal_error":
                    problems.append(f"unknown role {m.get('role')!r} (expected one of: {', '.join(ROLES)})")
                elif field == "content" and err["type"] == "string_type":
                    problems.append(f"content must be a string, got {type(m.get('content')).__name__}")
                else:
                    problems.append(f"{field}: {err['msg']}")
            raise ChatError(f"message {k}: " + "; ".join(problems)) from None
    return out


class ChatFormat:
    """Turns a list of chat messages into the prompt text a model expects."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "", name: str = "custom",
                 tokenizer: Tokenizer | None = None):
        self.template_source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.tokenizer = tokenizer
        try:
            self._template = _environment().from_string(template)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template {name!r} does not compile: {e}") from e

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, tokenizer: Tokenizer | None = None) -> ChatFormat:
        """The GGUF's own template; else Gemma's turn format for Gemma models; else ChatML.

        The rendered text carries the BOS token when the model wants one (GGUF templates
        write ``bos_token`` themselves; the built-ins write it when the GGUF's
        ``add_bos_token`` is true), so tokenize it with ``add_bos=False`` -- or use ``encode``.
        """
        bos = eos = ""
        if tokenizer is not None:
            bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
            eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        template = gguf.get("tokenizer.chat_template")
        label = gguf.path.name
        if isinstance(template, str) and template.strip():
            return cls(template, bos_token=bos, eos_token=eos, name=f"{label}:tokenizer.chat_template",
                       tokenizer=tokenizer)
        builtin_bos = bos if tokenizer is not None and tokenizer.add_bos else ""
        arch = gguf.arch or ""
        has_gemma_turns = tokenizer is not None and tokenizer.token_to_id("<start_of_turn>") is not None
        if arch.startswith("gemma") or has_gemma_turns:
            return cls(GEMMA_TEMPLATE, bos_token=builtin_bos, eos_token=eos, name="gemma (built-in)",
                       tokenizer=tokenizer)
        return cls(CHATML_TEMPLATE, bos_token=builtin_bos, eos_token=eos, name="chatml (built-in)",
                   tokenizer=tokenizer)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        msgs = validate_messages(messages)
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in msgs],
                add_generation_prompt=bool(add_generation_prompt),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template {self.name!r} was refused by the sandbox: {e}") from None
        except (TemplateError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise ChatTemplateError(f"chat template {self.name!r} failed: {type(e).__name__}: {e}") from None

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Render and tokenize; BOS appears once (added only if the model wants it and the template did not write it)."""
        if self.tokenizer is None:
            raise ChatError("ChatFormat.encode needs a tokenizer (use ChatFormat.from_gguf(gguf, tokenizer))")
        text = self.render(messages, add_generation_prompt)
        tok = self.tokenizer
        add_bos = tok.add_bos and not (self.bos_token and text.startswith(self.bos_token))
        return tok.encode(text, add_bos=add_bos, parse_special=True)

    def __repr__(self) -> str:
        return f"ChatFormat({self.name!r})"
