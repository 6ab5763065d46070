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

A model file's template is untrusted code, so rendering runs under limits (``TemplateLimitError``,
one line naming the template): a time limit (``TIME_LIMIT``; a watchdog thread interrupts the render
loop wherever it is, nested loops and recursive macros included), a cap on any one string or list the
template builds (``MAX_TEXT_CHARS``, checked *before* ``'a' * n``, ``+``, ``%``, ``str.format``,
``center``/``replace``/``join``/``indent``... allocate it), on all the text one render builds
together (``MAX_BUILT_CHARS``) and on the rendered output (streamed, stopped past ``MAX_TEXT_CHARS``).
``stop_rendering_when(should_stop)`` makes a render stop with ``RenderStopped`` as soon as
``should_stop()`` says so: the worker passes its job's timeout and forced stop that way.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import json
import os
import re
import string
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

__all__ = ["ChatFormat", "ChatMessage", "ChatError", "ChatTemplateError", "TemplateLimitError", "RenderStopped",
           "stop_rendering_when", "GEMMA_TEMPLATE", "CHATML_TEMPLATE"]

ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """Invalid chat messages (unknown role, non-string content, empty conversation)."""


class ChatTemplateError(ChatError):
    """The chat template is broken, raised an exception, or tried something the sandbox refuses."""


class TemplateLimitError(ChatTemplateError):
    """The chat template went past a limit: its time, the size of a string or list it builds, its output."""


class RenderStopped(RuntimeError):
    """Rendering was stopped from outside (``stop_rendering_when``: a job's timeout, a forced stop). Not a
    ChatError: the template did nothing wrong, the caller decides what the stop means."""


TIME_LIMIT = 5.0  # seconds one render may take (normal templates take milliseconds)
MAX_TEXT_CHARS = 4_000_000  # the rendered prompt, and any one string or list built (engine.engine.MAX_PROMPT_CHARS)
MAX_BUILT_CHARS = 8 * MAX_TEXT_CHARS  # all the strings and lists one render builds, together
MAX_INT_BITS = 4096  # integers a template computes with * and **
MAX_JSON_INDENT = 16
MAX_LIPSUM = 100  # paragraphs (or words per paragraph) of lipsum()
WATCH_INTERVAL = 0.02  # seconds between the watchdog's looks at the renders in progress


class ChatMessage(BaseModel):
    """One turn as the chat template renders it: role and text only (a request's own message form, with
    content parts and a name, is reduced to this)."""

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
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        _refuse(f"tojson(indent={indent}) is over the limit of {MAX_JSON_INDENT}")
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# ------------------------------------------------------------------ limits: sizes
class _Budget:
    """What one render has built so far (characters of strings, items of lists), across all operations."""

    __slots__ = ("built",)

    def __init__(self) -> None:
        self.built = 0


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("rqllm_chat_budget", default=None)


def _refuse(reason: str) -> NoReturn:
    raise TemplateLimitError(reason)


def _check(size: int, what: str) -> None:
    """Refuse, before building it, a value of `size` characters (or items) over MAX_TEXT_CHARS."""
    if size > MAX_TEXT_CHARS:
        _refuse(f"{what} would hold {size:,} characters or items (the limit is {MAX_TEXT_CHARS:,})")


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _deep_size(value: Any, limit: int = MAX_TEXT_CHARS) -> int:
    """About how many characters str(value) holds (a lower bound), counted up to just past `limit`
    without building it: a list holding one long string a million times is caught here."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        total = 2
        for item in (value.items() if isinstance(value, dict) else value):
            total += 2 + _deep_size(item, limit - total)
            if total > limit:
                break
        return total
    return 1


def _charge(result: Any) -> Any:
    """After an operation: its result counts against the render's budget."""
    size = _length(result)
    if size:
        _check(size, "a value")
        budget = _BUDGET.get()
        if budget is not None:
            budget.built += size
            if budget.built > MAX_BUILT_CHARS:
                _refuse(f"built more than {MAX_BUILT_CHARS:,} characters of strings and lists in all")
    return result


def _check_int(value: Any, what: str) -> None:
    """A width or count argument: at most MAX_TEXT_CHARS."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TEXT_CHARS:
        _refuse(f"{what} is {value:,} (the limit is {MAX_TEXT_CHARS:,})")


_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _number(digits: str | None, what: str) -> int:
    if not digits:
        return 0
    if digits == "*":
        _refuse(f"{what} takes its width from an argument ('*'), which templates may not")
    if len(digits) > 9:
        _refuse(f"{what} has a width of {len(digits)} digits")
    return int(digits)


def _args_size(args: Any) -> int:
    if isinstance(args, dict):
        args = list(args.values())
    elif not isinstance(args, (tuple, list)):
        args = [args]
    return max((_deep_size(a) for a in args), default=0)


def _percent_size(fmt: str, args: Any) -> int:
    """What `fmt % args` (and the format filter) can produce at most: each conversion as wide as its
    width or the largest argument."""
    largest = _args_size(args)
    size = len(fmt)
    for m in _PERCENT.finditer(fmt):
        width, precision, kind = m.groups()
        if kind == "%":
            continue
        size += max(_number(width, "a % conversion"), _number(precision, "a % conversion"), largest)
    return size


def _format_size(fmt: str, args: Any, kwargs: Any) -> int:
    """What `fmt.format(*args, **kwargs)` can produce at most."""
    largest = max(_args_size(args), _args_size(kwargs))
    size = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # format() will say what is wrong with it
    for literal, field, spec, _conversion in fields:
        size += len(literal)
        if field is None:
            continue
        if spec and "{" in spec:
            _refuse("str.format with a nested {} in a format spec")
        widths = [_number(d, "a format spec") for d in re.findall(r"\d+", spec or "")]
        size += max([largest, *widths])
    return size


def _replace_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return _deep_size(s)
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _join_size(sep: str, items: list[Any]) -> int:
    total = len(sep) * max(0, len(items) - 1)
    for item in items:
        total += _deep_size(item)
        if total > MAX_TEXT_CHARS:
            break
    return total


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> None:
    """Size checks before calling str method `name` of `s` (format/format_map: wrap_str_format; join: call)."""
    what = f"str.{name}()"
    if name in ("center", "ljust", "rjust", "zfill"):
        _check_int(args[0] if args else kwargs.get("width"), what)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _check(len(s) + max(0, tab) * s.count("\t"), what)
    elif name == "replace":
        _check(_replace_size(s, *args[:3], **kwargs), what)


def _sum_size(value: Any, *args: Any, **kwargs: Any) -> int:
    items = list(value) if isinstance(value, (list, tuple)) else []
    return sum(_length(i) for i in items)


def _indent_size(s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    if not isinstance(s, str):
        return _deep_size(s)
    step = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(s) + max(0, step) * (s.count("\n") + 1)


def _wordwrap_size(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                   *args: Any, **kwargs: Any) -> int:
    wrap = kwargs.get("wrapstring", wrapstring)
    if not isinstance(s, str):
        return _deep_size(s)
    return len(s) + (len(wrap) if isinstance(wrap, str) else 2) * (len(s) // 2 + 1)


# filter name -> an upper bound of its result's size, from its arguments (computed before it runs)
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "replace": lambda s, old="", new="", count=None, **kw: _replace_size(
        s, old, new, -1 if count is None else count),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "format": lambda value, *args, **kwargs: _percent_size(str(value), kwargs or args)
    if isinstance(value, str) else _deep_size(value),
    "join": lambda value, d="", *args, **kwargs: _join_size(d if isinstance(d, str) else "", list(value)),
    "sum": _sum_size,
}
# filters that turn their whole input into text: the input must be small enough to print
_TEXT_FILTERS = frozenset({"string", "e", "escape", "forceescape", "pprint", "urlize", "safe", "striptags", "trim",
                           "title", "upper", "lower", "capitalize", "truncate", "wordcount", "center", "tojson",
                           "replace", "indent", "wordwrap", "format", "xmlattr", "urlencode"})


def _limited_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A Jinja filter with size checks around it (its pass_context/eval_context marker kept)."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    estimate = _FILTER_SIZES.get(name)

    @functools.wraps(func)
    def limited(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip:
            value, rest = args[skip], args[skip + 1:]
            if name in ("join", "sum") and not isinstance(value, (list, tuple)):
                value = list(value)  # measured, then joined: an iterator is read once
                args = (*args[:skip], value, *rest)
            for a in (*rest, *kwargs.values()):
                _check_int(a, f"an argument of the {name} filter")
            if name in _TEXT_FILTERS:
                _check(_deep_size(value), f"the input of the {name} filter")
            if estimate is not None:
                _check(estimate(value, *rest, **kwargs), f"the result of the {name} filter")
        return _charge(func(*args, **kwargs))

    return limited


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - Jinja's names
    if any(isinstance(v, int) and v > MAX_LIPSUM for v in (n, min, max)):
        _refuse(f"lipsum() arguments over {MAX_LIPSUM}")
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _finalize(value: Any) -> Any:
    """Every {{ value }} printed: refused when its text would be too long (before str() builds it)."""
    if not isinstance(value, str):
        _check(_deep_size(value), "a printed value")
    return value


# ------------------------------------------------------------------ limits: time
class _OutOfTime(TemplateLimitError):
    """Raised in the rendering thread by the watchdog (a class raised without arguments)."""

    def __init__(self, *args: Any):
        super().__init__(*(args or ("ran past its time limit",)))


class _StoppedFromOutside(RenderStopped):
    def __init__(self, *args: Any):
        super().__init__(*(args or ("rendering the chat template was stopped (the job must stop)",)))


_STOP_CHECK: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "rqllm_chat_stop_check", default=None)


@contextlib.contextmanager
def stop_rendering_when(should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Renders in this context stop with RenderStopped once should_stop() returns True (checked by the
    watchdog every WATCH_INTERVAL, from another thread: it must be cheap and thread-safe)."""
    token = _STOP_CHECK.set(should_stop)
    try:
        yield
    finally:
        _STOP_CHECK.reset(token)


def _raise_in_thread(ident: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `ident` at its next bytecode boundary; None withdraws one not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


class _Watch:
    __slots__ = ("ident", "deadline", "should_stop", "fired_at", "done")

    def __init__(self, ident: int, deadline: float, should_stop: Callable[[], bool] | None):
        self.ident, self.deadline, self.should_stop = ident, deadline, should_stop
        self.fired_at: float | None = None
        self.done = False


class _Watchdog:
    """One daemon thread that interrupts renders past their deadline or told to stop: a template's loop
    runs Python bytecode, so an exception raised into its thread stops it wherever it is."""

    REFIRE = 0.5  # seconds: raise again if something swallowed the first one

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._watches: dict[int, _Watch] = {}
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, should_stop: Callable[[], bool] | None) -> _Watch:
        w = _Watch(threading.get_ident(), deadline, should_stop)
        with self._cond:
            self._watches[w.ident] = w
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rqllm-template-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return w

    def release(self, w: _Watch) -> None:
        w.done = True
        with self._cond:
            if self._watches.get(w.ident) is w:
                del self._watches[w.ident]
            if w.fired_at is not None:
                _raise_in_thread(w.ident, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._watches:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                for ident, w in list(self._watches.items()):
                    if w.done:
                        del self._watches[ident]
                    elif w.fired_at is None or now - w.fired_at > self.REFIRE:
                        exc: type[BaseException] | None = None
                        if now >= w.deadline:
                            exc = _OutOfTime
                        elif w.should_stop is not None and _asks_to_stop(w.should_stop):
                            exc = _StoppedFromOutside
                        if exc is not None:
                            w.fired_at = now
                            _raise_in_thread(ident, exc)
                self._cond.wait(WATCH_INTERVAL)


def _asks_to_stop(should_stop: Callable[[], bool]) -> bool:
    try:
        return bool(should_stop())
    except Exception:  # noqa: BLE001 - a broken check stops nothing; the time limit still holds
        return False


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._reset)  # the thread does not survive a fork


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


class _LimitedCodeGenerator(CodeGenerator):
    """Jinja's code generator, except that `a ~ b` goes through the environment's size check."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.join_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus size checks before the operations that can build long strings or
    lists: * + % ** (intercepted binary operators), ~ (join_checked), str methods and str.format (call,
    wrap_str_format), filters (wrapped in _environment), captured blocks and macro bodies (concat)."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check(len(seq) * n, "a repeated string or list")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    _refuse(f"a product of integers over {MAX_INT_BITS} bits")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check(len(left) + len(right), "a concatenation")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and \
                    (right > MAX_INT_BITS or left.bit_length() * right > MAX_INT_BITS):
                _refuse(f"a power of integers over {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check(_percent_size(left, right), "a % formatted string")
        return _charge(super().call_binop(context, operator, left, right))

    def join_checked(self, parts: tuple) -> str:
        _check(_join_size("", list(parts)), "a ~ concatenation")
        return _charge("".join(map(str, parts)))

    def concat(self, parts: Any) -> str:  # noqa: D401 - replaces Environment.concat ("".join)
        buf, size = [], 0
        for part in parts:
            size += len(part) if isinstance(part, str) else 0
            if size > MAX_TEXT_CHARS:
                _check(size, "a captured block or macro output")
            buf.append(part)
        return _charge("".join(buf))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(obj, "__name__", "")
            if name == "join" and args:
                items = list(args[0])
                _check(_join_size(owner, items), "str.join()")
                return _charge(super().call(context, obj, items))
            _check_str_method(owner, name, args, kwargs)
        return _charge(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / str.format_map as the sandbox runs them, measured first."""
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        fmt, name = value.__self__, value.__name__

        def measured(*args: Any, **kwargs: Any) -> str:
            if name == "format_map" and len(args) == 1 and not kwargs:
                _check(_format_size(fmt, (), args[0]), "str.format_map()")
            else:
                _check(_format_size(fmt, args, kwargs), f"str.{name}()")
            return _charge(sandboxed(*args, **kwargs))

        return functools.update_wrapper(measured, value)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False,
        undefined=_RefusingUndefined, finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["lipsum"] = _lipsum
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
                 tokenizer: Tokenizer | None = None, time_limit: float = TIME_LIMIT):
        self.template_source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.tokenizer = tokenizer
        self.time_limit = time_limit
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
        """The prompt text, rendered under the limits (module docstring): TemplateLimitError past one,
        RenderStopped when stop_rendering_when's check asks for it."""
        msgs = validate_messages(messages)
        budget = _BUDGET.set(_Budget())
        watch = _WATCHDOG.watch(time.monotonic() + self.time_limit, _STOP_CHECK.get())
        try:
            out: list[str] = []
            size = 0
            for chunk in self._template.generate(
                messages=[{"role": m.role, "content": m.content} for m in msgs],
                add_generation_prompt=bool(add_generation_prompt),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            ):
                size += len(chunk)
                if size > MAX_TEXT_CHARS:
                    _refuse(f"would render more than {MAX_TEXT_CHARS:,} characters")
                out.append(chunk)
            return "".join(out)
        except RenderStopped:
            raise
        except _OutOfTime:
            raise TemplateLimitError(f"chat template {self.name!r} was stopped: it ran past its time limit of "
                                     f"{self.time_limit:g} s") from None
        except TemplateLimitError as e:
            raise TemplateLimitError(f"chat template {self.name!r} was stopped: {e}") from None
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template {self.name!r} was refused by the sandbox: {e}") from None
        except RecursionError:
            raise ChatTemplateError(f"chat template {self.name!r} failed: it recursed too deeply") from None
        except (TemplateError, TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError,
                MemoryError) as e:
            raise ChatTemplateError(f"chat template {self.name!r} failed: {type(e).__name__}: {e}") from None
        finally:
            _WATCHDOG.release(watch)
            _BUDGET.reset(budget)

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
