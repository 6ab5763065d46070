"""Planning a document: the model's view of a prompt (tokens, KV capacity), chunks that fit it, and
the tree of reduce jobs over the chunks' summaries.

Budgets. A worker's KV cache holds `capacity` tokens: the prompt plus the reply must fit. A map
prompt is the template around a chunk, so chunks are sized with the model's tokenizer on the
fully rendered chat prompt: tokens(prompt) + max_summary_tokens <= capacity. A reduce prompt holds
up to `fan_in` partial summaries, each at most max_summary_tokens long; fan_in follows from the same
inequality. More partial summaries than fan_in are reduced in levels (a tree), planned at submission.

The engine modules (GGUF reader, tokenizer, model config) are imported inside the functions that
need them: every `rqllm` command imports this package, and only a run should pay for them.
"""
from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.chunking import Chunk, ChunkingError, chunk_text
from pipeline.summarize.documents import Document
from pipeline.summarize.errors import SummarizeError
from pipeline.structure import MAX_HEADING_CHARS, Heading, outline, section_paths
from pipeline.summarize.templates import Templates, document_context, words_for

if TYPE_CHECKING:
    from engine.model_info import ModelInfo

DEFAULT_MAX_SUMMARY_TOKENS = 160
DEFAULT_OVERLAP_TOKENS = 32
# Most document tokens per chunk, whatever the KV budget allows: small instruct models summarise a
# page far better than a whole report, attention cost grows with the square of the prompt, and more
# chunks spread a document's map jobs across workers.
DEFAULT_CHUNK_TOKENS = 1024
PROMPT_MARGIN = 4  # tokens of slack against off-by-a-few differences in how a prompt is tokenized


class PromptMeter:
    """Counts the tokens a chat prompt costs on the model, the way the worker's engine counts them.

    Loads only the GGUF metadata (tokenizer and chat template), never the weights.
    """

    def __init__(self, tokenizer: Any, render_chat: Callable[[list[dict[str, str]]], str],
                 encode_prompt: Callable[[str], list[int]] | None = None):
        self.tokenizer = tokenizer
        self.render_chat = render_chat
        self._encode_prompt = encode_prompt or (lambda s: tokenizer.encode(s))

    def count(self, messages: list[dict[str, str]]) -> int:
        return len(self._encode_prompt(self.render_chat(messages)))

    @classmethod
    def for_model(cls, model: str | ModelInfo) -> PromptMeter:
        """The meter for a run's ModelInfo, or a model name or .gguf path: as
        engine.Engine.prompt_ids(messages=...) does, the chat template renders the prompt (with its own
        BOS) and the text is encoded without adding another."""
        from engine.model_info import ModelInfo

        info = model if isinstance(model, ModelInfo) else ModelInfo.open(model)
        return cls(info.tokenizer, info.render_chat, info.encode_prompt)


TOKENS_RE = re.compile(r"(\d+)\s*(?:t|tok|toks|token|tokens)", re.I)


@contextlib.contextmanager
def _model_info(model: str | ModelInfo) -> Iterator[ModelInfo]:
    """A run's ModelInfo as it is, or one opened for a model name or path (closed after)."""
    from engine.model_info import ModelInfo

    if isinstance(model, ModelInfo):
        yield model
    else:
        with ModelInfo.open(model) as info:
            yield info


def kv_capacity(model: str | ModelInfo, kv_budget: str | int) -> int:
    """Tokens a worker's KV cache holds for `model` under `kv_budget`.

    `kv_budget` is what `rqllm worker --kv-budget` takes (bytes: 256MiB, 1GiB, ...), or a token count
    written with a unit: 1024tok / 1024tokens (capped at the model's context length).
    """
    from engine.kv_cache import parse_bytes

    text = str(kv_budget).strip()
    with _model_info(model) as info:
        m = TOKENS_RE.fullmatch(text)
        if m:
            return min(int(m.group(1)), info.config.n_ctx_train)
        try:
            budget = parse_bytes(text)
        except ValueError as e:
            raise SummarizeError(f"--kv-budget: {e}; or give tokens, e.g. 1024tok") from None
        try:
            return info.kv_plan(budget).tokens
        except ValueError as e:
            raise SummarizeError(f"--kv-budget: {e}") from None


def worker_kv_budget(model: str | ModelInfo, kv_budget: str) -> str:
    """What to pass to `rqllm worker --kv-budget` for the user's --kv-budget: bytes stay as they are;
    a token count becomes the smallest byte budget whose cache holds that many tokens."""
    m = TOKENS_RE.fullmatch(str(kv_budget).strip())
    if not m:
        return str(kv_budget)
    with _model_info(model) as info:
        cfg = info.config

        def capacity(budget: int) -> int:
            return info.kv_plan(budget).tokens  # the worker sizes its cache by the same arithmetic

        tokens = min(int(m.group(1)), cfg.n_ctx_train)
        row = 2 * cfg.kv_dim * 4  # K and V rows, f32, per layer and token: an upper bound to start from
        hi = max(1, tokens * row * cfg.n_layer)
        while capacity(hi) < tokens:
            hi *= 2
        lo = 1
        while lo < hi:  # smallest budget that still holds `tokens`
            mid = (lo + hi) // 2
            try:
                ok = capacity(mid) >= tokens
            except ValueError:
                ok = False
            if ok:
                hi = mid
            else:
                lo = mid + 1
        return str(hi)


@dataclass
class ReduceNode:
    job_id: str
    inputs: list[str]  # job ids, in document order
    level: int


@dataclass
class DocPlan:
    index: int
    doc: Document
    chunks: list[Chunk]
    map_ids: list[str]
    map_messages: list[list[dict[str, str]]]
    reduces: list[ReduceNode]
    prompt_tokens: list[int]  # per map job, as measured
    title: str = ""  # the document's title (its first heading, else its file name)
    sections: tuple[str, ...] = ()  # its outline: the titles of its top two heading levels, in order

    @property
    def final_id(self) -> str:
        return self.reduces[-1].job_id if self.reduces else self.map_ids[0]

    @property
    def job_ids(self) -> list[str]:
        return self.map_ids + [r.job_id for r in self.reduces]

    @property
    def levels(self) -> int:
        return max((r.level for r in self.reduces), default=0)


@dataclass
class Budget:
    capacity: int  # tokens the worker's KV cache holds
    max_summary_tokens: int
    overlap_tokens: int = DEFAULT_OVERLAP_TOKENS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # most document tokens per map prompt

    @property
    def prompt_limit(self) -> int:
        """Most tokens a prompt may cost so the reply still fits."""
        return self.capacity - self.max_summary_tokens - PROMPT_MARGIN


def reduce_fan_in(meter: PromptMeter, templates: Templates, budget: Budget, words: int) -> int:
    """How many partial summaries (each at most max_summary_tokens) one reduce prompt can hold."""
    spec = templates.reduce_spec("", words, document_context("x" * MAX_HEADING_CHARS))  # the longest title

    def cost(n: int) -> int:
        # A part costs its label and separator plus up to max_summary_tokens of text; measure with a
        # filler of exactly max_summary_tokens tokens' worth so labels and joins are counted for real.
        return meter.count(spec.messages([_filler(meter, budget.max_summary_tokens)] * n))

    if cost(2) > budget.prompt_limit:
        raise SummarizeError(
            f"the KV budget ({budget.capacity} tokens) cannot hold a reduce prompt with two summaries of "
            f"{budget.max_summary_tokens} tokens plus the reply: raise --kv-budget or lower --max-summary-tokens")
    lo, hi = 2, 2
    while cost(hi * 2) <= budget.prompt_limit and hi < 4096:
        hi *= 2
    hi = min(hi * 2, 4096)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget.prompt_limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


_FILLERS: dict[tuple[int, int], str] = {}


def _filler(meter: PromptMeter, n_tokens: int) -> str:
    """Text that encodes to at least n_tokens tokens (a stand-in for a worst-case summary)."""
    key = (id(meter), n_tokens)
    if key not in _FILLERS:
        unit = "The team agreed on the plan, and the numbers were checked twice. "
        text = unit
        while len(meter.tokenizer.encode(text)) < n_tokens:
            text += unit
        ids = meter.tokenizer.encode(text)
        _FILLERS[key] = meter.tokenizer.decode(ids[:max(n_tokens, 1)])
        while len(meter.tokenizer.encode(_FILLERS[key])) < n_tokens:
            _FILLERS[key] += " x"
    return _FILLERS[key]


def reduce_tree(n_leaves: int, fan_in: int) -> list[list[list[int]]]:
    """Levels of consecutive groups: level k's groups index into level k-1's outputs (level 0 = leaves).

    Groups are as even as possible; no group of one is made (it would only copy a summary).
    """
    if fan_in < 2:
        raise ValueError("fan_in must be >= 2")
    levels: list[list[list[int]]] = []
    n = n_leaves
    while n > 1:
        k = math.ceil(n / fan_in)
        size, extra = divmod(n, k)
        groups, start = [], 0
        for g in range(k):
            end = start + size + (1 if g < extra else 0)
            groups.append(list(range(start, end)))
            start = end
        levels.append(groups)
        n = k
    return levels


MAX_OUTLINE = 40  # sections listed in a report


def document_title(doc: Document, headings: list[Heading]) -> str:
    """The first heading when the document opens with one (under 400 characters of text before it),
    else the file's name without its folder and extension."""
    if headings and len(doc.text[:headings[0].start].strip()) < 400:
        return headings[0].title
    name = doc.path.replace("\\", "/").rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[0] if "." in name[1:] else name


def plan_document(index: int, doc: Document, *, run_id: str, model: str, meter: PromptMeter, templates: Templates,
                  budget: Budget, fan_in: int) -> DocPlan:
    words = words_for(budget.max_summary_tokens)
    headings = outline(doc.text)
    title = document_title(doc, headings)
    # Chunks are sized with the longest context any of them gets (each gets its own section's).
    widest = document_context(title, max(section_paths(headings), key=lambda p: len(" > ".join(p)), default=()))

    def measure(text: str) -> int:
        return meter.count(templates.map_messages(text, words, widest))

    try:
        limit = min(budget.prompt_limit, measure("") + budget.chunk_tokens)
        chunks = chunk_text(doc.text, meter.tokenizer, limit, overlap_tokens=budget.overlap_tokens,
                            measure=measure)
    except ChunkingError as e:
        raise SummarizeError(f"{doc.path}: {e}; raise --kv-budget or lower --max-summary-tokens") from None
    prefix = f"sum-{run_id}-d{index}"
    map_ids = [f"{prefix}-m{c.index}" for c in chunks]
    reduces: list[ReduceNode] = []
    outputs = list(map_ids)
    for level_no, groups in enumerate(reduce_tree(len(chunks), fan_in), 1):
        nxt = []
        for g, members in enumerate(groups):
            node = ReduceNode(f"{prefix}-r{level_no}-{g}", [outputs[i] for i in members], level_no)
            reduces.append(node)
            nxt.append(node.job_id)
        outputs = nxt
    messages = [templates.map_messages(c.text, words, document_context(title, c.section_path)) for c in chunks]
    return DocPlan(index=index, doc=doc, chunks=chunks, map_ids=map_ids, map_messages=messages,
                   reduces=reduces, prompt_tokens=[meter.count(m) for m in messages], title=title,
                   sections=tuple(h.title for h in headings if h.level <= 2)[:MAX_OUTLINE])
