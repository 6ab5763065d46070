"""`rqllm summarize`: map -> reduce summaries of many documents, as rq jobs with dependencies.

    files/folders/globs --collect--> documents (skipped ones reported with the reason)
    document --chunk by model tokens--> one map job per chunk    (jobs.summarize_tasks.summarize_chunk)
             ------------------------> reduce job(s) depends_on the map jobs (.reduce_summaries)
                                       in levels when one reduce cannot hold all partial summaries
    follow the jobs --> one JSONL line (or a Markdown section) per document, as documents finish

Budgets. A worker's KV cache holds `capacity` tokens: the prompt plus the reply must fit. A map
prompt is the template around a chunk, so chunks are sized with the model's tokenizer on the
fully rendered chat prompt: tokens(prompt) + max_summary_tokens <= capacity. A reduce prompt holds
up to `fan_in` partial summaries, each at most max_summary_tokens long; fan_in follows from the same
inequality. More partial summaries than fan_in are reduced in levels (a tree), planned at submission.

Embedded vs remote: with no REDIS_URL the run happens inside pipeline.embedded's private cluster
(redis-server + --workers worker processes, stopped at the end); with REDIS_URL the command only
submits and follows, and the workers are whoever serves that Redis.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from engine.defaults import DEFAULT_KV_BUDGET, DEFAULT_MODEL
from pipeline.chunking import Chunk, ChunkingError, chunk_text

TASK_MAP = "jobs.summarize_tasks.summarize_chunk"
TASK_REDUCE = "jobs.summarize_tasks.reduce_summaries"
DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "templates" / "summarize.toml"
DEFAULT_MAX_SUMMARY_TOKENS = 160
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
DEFAULT_OVERLAP_TOKENS = 32
# Map and reduce jobs guess tokens by prompt lookup: summaries copy phrases from their input, and
# greedy output is the same either way (bench/bench_speculative.py measures the gain).
DEFAULT_SPECULATIVE = "prompt_lookup"
# Most document tokens per chunk, whatever the KV budget allows: small instruct models summarise a
# page far better than a whole report, attention cost grows with the square of the prompt, and more
# chunks spread a document's map jobs across workers.
DEFAULT_CHUNK_TOKENS = 1024
JOB_TIMEOUT = 1800
RESULT_TTL = 24 * 3600
PROMPT_MARGIN = 4  # tokens of slack against off-by-a-few differences in how a prompt is tokenized


class SummarizeError(RuntimeError):
    """A run that cannot go ahead (bad template, budget too small, ...), with the reason."""


# ------------------------------------------------------------------------------------ templates

@dataclass(frozen=True)
class Templates:
    map_system: str
    map_user: str
    reduce_system: str
    reduce_user: str
    part: str
    separator: str
    source: str = "built-in"

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Templates:
        """The built-in templates, with any keys of `path` (TOML or JSON) laid over them."""
        base = _read_template_file(DEFAULT_TEMPLATE)
        source = "built-in"
        if path is not None:
            user = _read_template_file(Path(path))
            for section in ("map", "reduce"):
                extra = user.get(section) or {}
                if not isinstance(extra, dict):
                    raise SummarizeError(f"{path}: [{section}] must be a table")
                unknown = set(extra) - set(base[section])
                if unknown:
                    raise SummarizeError(f"{path}: unknown key(s) in [{section}]: {', '.join(sorted(unknown))}")
                base[section].update(extra)
            unknown_sections = set(user) - {"map", "reduce"}
            if unknown_sections:
                raise SummarizeError(f"{path}: unknown section(s): {', '.join(sorted(unknown_sections))}")
            source = str(path)
        m, r = base["map"], base["reduce"]
        t = cls(map_system=m.get("system", ""), map_user=m["user"], reduce_system=r.get("system", ""),
                reduce_user=r["user"], part=r.get("part", "Part {n}: {summary}"),
                separator=r.get("separator", "\n\n"), source=source)
        for name, value, needed in (("[map] user", t.map_user, "{text}"), ("[reduce] user", t.reduce_user, "{text}"),
                                    ("[reduce] part", t.part, "{summary}")):
            if not isinstance(value, str) or needed not in value:
                raise SummarizeError(f"{source}: {name} must contain {needed}")
        if "{text}" in t.map_system or "{text}" in t.reduce_system:
            raise SummarizeError(f"{source}: put {{text}} in the user message, not the system message")
        return t

    def map_messages(self, text: str, words: int) -> list[dict[str, str]]:
        """System + user message for one chunk. Everything before {text} is the same for every chunk."""
        w = str(words)
        messages = []
        if self.map_system:
            messages.append({"role": "system", "content": self.map_system.replace("{words}", w)})
        messages.append({"role": "user", "content": self.map_user.replace("{words}", w).replace("{text}", text)})
        return messages

    def reduce_spec(self, model: str, words: int) -> dict[str, Any]:
        """The template part of a reduce job's arguments (filled by the worker at run time)."""
        return {"model": model, "system": self.reduce_system, "user": self.reduce_user, "part": self.part,
                "separator": self.separator, "words": words}


def _read_template_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SummarizeError(f"cannot read template file {path}: {e.strerror or e}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SummarizeError(f"template file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise SummarizeError(f"template file {path} must hold a table with [map] and/or [reduce]")
    return {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}


def words_for(max_summary_tokens: int) -> int:
    """How many words to ask for so the reply usually ends before max_summary_tokens."""
    return max(8, int(max_summary_tokens * 0.6))


# ------------------------------------------------------------------------------------ inputs

@dataclass
class Document:
    path: str  # as shown to the user
    text: str
    size: int


@dataclass
class Skipped:
    path: str
    reason: str


_GLOB_CHARS = re.compile(r"[*?\[]")


def collect_documents(paths: Iterable[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[list[Document], list[Skipped]]:
    """Files, folders (recursively, hidden entries left out) and globs -> readable text documents.

    Everything else is reported, never silently dropped: missing paths, unreadable files, empty
    files, binary or non-UTF-8 files, and files over `max_bytes`.
    """
    files: list[Path] = []
    skipped: list[Skipped] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            files.extend(_walk(p))
        elif p.exists() or p.is_symlink():
            files.append(p)
        elif _GLOB_CHARS.search(raw):
            matches = sorted(glob.glob(os.path.expanduser(raw), recursive=True))
            if not matches:
                skipped.append(Skipped(raw, "no file matches this pattern"))
            for m in matches:
                mp = Path(m)
                files.extend(_walk(mp) if mp.is_dir() else [mp])
        else:
            skipped.append(Skipped(raw, "not found"))
    docs: list[Document] = []
    seen: set[str] = set()
    for f in files:
        try:
            key = str(f.resolve())
        except OSError:
            key = str(f.absolute())
        if key in seen:
            continue
        seen.add(key)
        doc_or_skip = read_document(f, max_bytes=max_bytes)
        (docs if isinstance(doc_or_skip, Document) else skipped).append(doc_or_skip)
    return docs, skipped


def _walk(folder: Path) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(Path(root) / n for n in sorted(names) if not n.startswith("."))
    return out


def read_document(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Document | Skipped:
    shown = str(path)
    try:
        st = path.stat()
    except OSError as e:
        return Skipped(shown, f"unreadable: {e.strerror or e}")
    if not path.is_file():
        return Skipped(shown, "not a regular file")
    if st.st_size > max_bytes:
        return Skipped(shown, f"too large: {st.st_size:,} bytes (limit {max_bytes:,}; see --max-bytes)")
    try:
        data = path.read_bytes()
    except OSError as e:
        return Skipped(shown, f"unreadable: {e.strerror or e}")
    if not data.strip():
        return Skipped(shown, "empty")
    if b"\x00" in data[:8192]:
        return Skipped(shown, "binary (contains NUL bytes)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return Skipped(shown, f"binary or not UTF-8 text (byte {e.start} is invalid)")
    control = sum(1 for ch in text[:8192] if ord(ch) < 32 and ch not in "\n\r\t\f\v\x1b")
    if control > max(8, len(text[:8192]) // 100):
        return Skipped(shown, "binary (many control characters)")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return Skipped(shown, "empty")
    return Document(shown, text, len(data))


# ------------------------------------------------------------------------------------ the model's view

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
    def for_model(cls, model: str) -> PromptMeter:
        """The meter for a model name or .gguf path: as engine.Engine.prompt_ids(messages=...) does,
        the chat template renders the prompt (with its own BOS) and the text is encoded without
        adding another."""
        from engine.chat import ChatFormat
        from engine.gguf_file import GGUFFile
        from engine.registry import resolve
        from engine.tokenizer import Tokenizer

        gguf = GGUFFile(resolve(model))
        tokenizer = Tokenizer.from_gguf(gguf)
        chat = ChatFormat.from_gguf(gguf, tokenizer)
        return cls(tokenizer, lambda messages: chat.render(list(messages), add_generation_prompt=True),
                   lambda text: tokenizer.encode(text, add_bos=False))


_TOKENS_RE = re.compile(r"(\d+)\s*(?:t|tok|toks|token|tokens)", re.I)


def _kv_layout(model: str) -> tuple[Any, list[int | None]]:
    from engine.gguf_file import GGUFFile
    from engine.model import MAX_UBATCH, Config
    from engine.registry import resolve

    cfg = Config.from_gguf(GGUFFile(resolve(model)))
    local = [cfg.sliding_window + MAX_UBATCH - 1 if cfg.layer_is_local(il) else None for il in range(cfg.n_layer)]
    return cfg, local


def _capacity_for_bytes(cfg: Any, local: list[int | None], budget_bytes: int) -> int:
    # The worker sizes its cache with KVCache.from_budget; ask it the same question. (Its arrays are
    # np.zeros, i.e. untouched calloc pages, so building one to read its capacity costs next to nothing.)
    from engine.kv_cache import KVCache

    return KVCache.from_budget(budget_bytes, cfg.n_layer, cfg.kv_dim, local, cfg.n_ctx_train).capacity


def kv_capacity(model: str, kv_budget: str | int) -> int:
    """Tokens a worker's KV cache holds for `model` under `kv_budget`.

    `kv_budget` is what `rqllm worker --kv-budget` takes (bytes: 256MiB, 1GiB, ...), or a token count
    written with a unit: 1024tok / 1024tokens (capped at the model's context length).
    """
    from engine.kv_cache import parse_bytes

    text = str(kv_budget).strip()
    cfg, local = _kv_layout(model)
    m = _TOKENS_RE.fullmatch(text)
    if m:
        return min(int(m.group(1)), cfg.n_ctx_train)
    try:
        budget = parse_bytes(text)
    except ValueError as e:
        raise SummarizeError(f"--kv-budget: {e}; or give tokens, e.g. 1024tok") from None
    try:
        return _capacity_for_bytes(cfg, local, budget)
    except ValueError as e:
        raise SummarizeError(f"--kv-budget: {e}") from None


def worker_kv_budget(model: str, kv_budget: str) -> str:
    """What to pass to `rqllm worker --kv-budget` for the user's --kv-budget: bytes stay as they are;
    a token count becomes the smallest byte budget whose cache holds that many tokens."""
    m = _TOKENS_RE.fullmatch(str(kv_budget).strip())
    if not m:
        return str(kv_budget)
    cfg, local = _kv_layout(model)
    tokens = min(int(m.group(1)), cfg.n_ctx_train)
    row = 2 * cfg.kv_dim * 4  # K and V rows, f32, per layer and token: an upper bound to start from
    hi = max(1, tokens * row * cfg.n_layer)
    while _capacity_for_bytes(cfg, local, hi) < tokens:
        hi *= 2
    lo = 1
    while lo < hi:  # smallest budget that still holds `tokens`
        mid = (lo + hi) // 2
        try:
            ok = _capacity_for_bytes(cfg, local, mid) >= tokens
        except ValueError:
            ok = False
        if ok:
            hi = mid
        else:
            lo = mid + 1
    return str(hi)


# ------------------------------------------------------------------------------------ planning

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
    spec = templates.reduce_spec("", words)
    from jobs.summarize_tasks import reduce_messages

    def cost(n: int) -> int:
        # A part costs its label and separator plus up to max_summary_tokens of text; measure with a
        # filler of exactly max_summary_tokens tokens' worth so labels and joins are counted for real.
        return meter.count(reduce_messages(spec, [_filler(meter, budget.max_summary_tokens)] * n))

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


def plan_document(index: int, doc: Document, *, run_id: str, model: str, meter: PromptMeter, templates: Templates,
                  budget: Budget, fan_in: int) -> DocPlan:
    words = words_for(budget.max_summary_tokens)

    def measure(text: str) -> int:
        return meter.count(templates.map_messages(text, words))

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
    return DocPlan(index=index, doc=doc, chunks=chunks, map_ids=map_ids,
                   map_messages=[templates.map_messages(c.text, words) for c in chunks],
                   reduces=reduces, prompt_tokens=[c.tokens for c in chunks])


# ------------------------------------------------------------------------------------ submission

def submit_plans(connection: Any, plans: Sequence[DocPlan], *, model: str, templates: Templates, budget: Budget,
                 priority: str = "default", seed: int | None = None, speculative: str = DEFAULT_SPECULATIVE) -> None:
    """Enqueue every map job, then the reduce jobs (deferred until their inputs finish).
    speculative: the jobs' params.speculative (engine.params.SpeculativeMode)."""
    from rq import Queue, Retry
    from rq.job import Dependency

    from jobs import keys
    from jobs.schemas import TaskOptions
    from jobs.schemas import GenerationJob, model_key, queue_name
    from jobs.redis_conn import SERIALIZER

    queue = Queue(queue_name(model, priority), connection=connection, serializer=SERIALIZER)
    options = TaskOptions(result_ttl=RESULT_TTL, stream_ttl=3600).model_dump()
    words = words_for(budget.max_summary_tokens)
    params = {"max_tokens": budget.max_summary_tokens, "temperature": 0.0, "repetition_penalty": 1.1,
              "speculative": speculative}
    if seed is not None:
        params["seed"] = seed
    spec_base = templates.reduce_spec(model, words)
    common = dict(timeout=JOB_TIMEOUT, result_ttl=RESULT_TTL, failure_ttl=RESULT_TTL, retry=Retry(max=1))
    maps = []
    for plan in plans:
        for chunk, job_id, messages in zip(plan.chunks, plan.map_ids, plan.map_messages):
            gjob = GenerationJob(model=model, messages=messages, params=params,
                                 metadata={"summarize": plan.doc.path, "chunk": chunk.index})
            maps.append(Queue.prepare_data(TASK_MAP, args=(gjob.to_payload(), options), job_id=job_id,
                                           description=f"summarize {plan.doc.path} chunk {chunk.index + 1}/{len(plan.chunks)}",
                                           **common))
    for i in range(0, len(maps), 500):
        with connection.pipeline() as p:
            queue.enqueue_many(maps[i:i + 500], pipeline=p)
            p.execute()
    for plan in plans:
        for node in plan.reduces:
            spec = dict(spec_base, params=params, metadata={"summarize": plan.doc.path, "level": node.level})
            # enqueue_at_front: a reduce whose inputs are done goes ahead of the map jobs still
            # queued, so documents finish (and are written) one after another, not all at the end.
            queue.enqueue_call(TASK_REDUCE, args=(spec, node.inputs, options), job_id=node.job_id,
                               depends_on=Dependency(jobs=list(node.inputs), enqueue_at_front=True),
                               description=f"summarize {plan.doc.path} reduce level {node.level}", **common)
    # Wake idle workers of this model now rather than at their next poll.
    bell = keys.doorbell_key(model_key(model))
    with connection.pipeline(transaction=False) as p:
        p.rpush(bell, *(["1"] * min(64, max(1, len(maps)))))
        p.ltrim(bell, -256, -1)
        p.expire(bell, 3600)
        p.execute()


# ------------------------------------------------------------------------------------ following

@dataclass
class DocState:
    plan: DocPlan
    submitted_at: float
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    ended_at: float | None = None

    @property
    def maps_done(self) -> int:
        return sum(1 for j in self.plan.map_ids if j in self.results)

    @property
    def done(self) -> bool:
        return self.error is not None or self.plan.final_id in self.results

    def record(self, model: str) -> dict[str, Any]:
        plan = self.plan
        final = self.results.get(plan.final_id) or {}
        rec: dict[str, Any] = {
            "path": plan.doc.path,
            "summary": final.get("summary") if self.error is None else None,
            "chunks": len(plan.chunks),
            "reduce_levels": plan.levels,
            "jobs": len(plan.job_ids),
            "tokens_in": sum(r.get("prompt_tokens", 0) for r in self.results.values()),
            "tokens_out": sum(r.get("completion_tokens", 0) for r in self.results.values()),
            "prefix_hit_tokens": sum(r.get("prefix_hit_tokens", 0) for r in self.results.values()),
            "draft_tokens": sum(r.get("draft_tokens", 0) for r in self.results.values()),
            "accepted_tokens": sum(r.get("accepted_tokens", 0) for r in self.results.values()),
            "seconds": round((self.ended_at or time.time()) - self.submitted_at, 3),
            "compute_seconds": round(sum(r.get("seconds", 0.0) for r in self.results.values()), 3),
            "model": model,
            "bytes": plan.doc.size,
        }
        if self.error is not None:
            rec["error"] = self.error
        elif final.get("finish_reason") == "length":
            rec["truncated"] = True
        return rec


class Progress:
    """One live line on stderr: documents and chunks done. Plain lines when stderr is not a terminal."""

    def __init__(self, total_docs: int, total_chunks: int, stream: IO[str] | None = None, width: int = 24):
        self.total_docs = total_docs
        self.total_chunks = total_chunks
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width
        self.t0 = time.monotonic()
        self._last: tuple[int, int, int] | None = None
        self._last_draw = 0.0

    def line(self, docs: int, chunks: int, failed: int) -> str:
        frac = (chunks + docs) / max(1, self.total_chunks + self.total_docs)
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        text = (f"[{bar}] documents {docs}/{self.total_docs}  chunks {chunks}/{self.total_chunks}"
                f"  {time.monotonic() - self.t0:6.1f}s")
        if failed:
            text += f"  ({failed} failed)"
        return text

    def update(self, docs: int, chunks: int, failed: int = 0, *, force: bool = False) -> None:
        state = (docs, chunks, failed)
        now = time.monotonic()
        if self.tty:
            if state == self._last and not force and now - self._last_draw < 0.5:
                return
            self.stream.write("\r\x1b[2K" + self.line(docs, chunks, failed))
        else:
            # A log, not a screen: a line when a document ends, otherwise at most one a second.
            if not force and (state == self._last or (
                    self._last is not None and state[0::2] == self._last[0::2] and now - self._last_draw < 1.0)):
                return
            self.stream.write(self.line(docs, chunks, failed) + "\n")
        self.stream.flush()
        self._last, self._last_draw = state, now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A line above the bar (the bar is redrawn by the next update)."""
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last = None


def follow(connection: Any, states: Sequence[DocState], *, on_done: Callable[[DocState], None],
           progress: Progress | None = None, health: Callable[[], None] | None = None, poll: float = 0.2,
           no_worker_warning: Callable[[], bool] | None = None) -> None:
    """Poll the jobs of unfinished documents until every document has a summary or an error."""
    from rq.job import Job

    from jobs.redis_conn import SERIALIZER

    pending = [s for s in states if not s.done]
    last_change = time.monotonic()
    warned = False
    sleep = 0.05
    while pending:
        if health is not None:
            health()
        ids = [j for s in pending for j in s.plan.job_ids if j not in s.results]
        with connection.pipeline(transaction=False) as p:
            for j in ids:
                p.hget(Job.key_for(j), "status")
            statuses = dict(zip(ids, (x.decode() if x else None for x in p.execute())))
        finished = [j for j, st in statuses.items() if st == "finished"]
        changed = False
        if finished:
            jobs = Job.fetch_many(finished, connection=connection, serializer=SERIALIZER)
            values = {j: (job.return_value() if job is not None else None) for j, job in zip(finished, jobs)}
        else:
            values = {}
        for s in pending:
            for j in s.plan.job_ids:
                if j in s.results:
                    continue
                st = statuses.get(j)
                if st == "finished":
                    v = values.get(j)
                    if isinstance(v, dict):
                        s.results[j] = v
                        changed = True
                    else:
                        s.error = f"job {j} finished but its result is gone (expired?)"
                        _cancel_rest(connection, s)
                        changed = True
                        break
                elif st in ("failed", "canceled", "stopped") or (st is None and j in statuses):
                    s.error = _job_error(connection, j, st)
                    _cancel_rest(connection, s)
                    changed = True
                    break
            if s.done:
                s.ended_at = time.time()
                on_done(s)
        pending = [s for s in pending if not s.done]
        if progress is not None:
            docs_done = sum(1 for s in states if s.done)
            progress.update(docs_done, sum(s.maps_done for s in states), sum(1 for s in states if s.error))
        if changed:
            last_change = time.monotonic()
            sleep = 0.05
        elif pending:
            if not warned and no_worker_warning is not None and time.monotonic() - last_change > 10:
                warned = no_worker_warning()
            time.sleep(sleep)
            sleep = min(poll, sleep * 1.5)


def _job_error(connection: Any, job_id: str, status: str | None) -> str:
    from rq.job import Job

    from jobs.redis_conn import SERIALIZER

    if status is None:
        return f"job {job_id} disappeared from Redis (deleted or expired) before it finished"
    why = ""
    try:
        job = Job.fetch(job_id, connection=connection, serializer=SERIALIZER)
        latest = job.latest_result()
        lines = [ln for ln in ((latest.exc_string if latest else "") or "").strip().splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else ""
    except Exception:  # noqa: BLE001 - the status alone is still worth reporting
        pass
    return f"job {job_id} {status}" + (f": {why}" if why else "")


def _cancel_rest(connection: Any, state: DocState) -> None:
    """A document that failed: stop its other jobs (its deferred reduces would wait forever)."""
    from rq.job import Job

    from jobs.redis_conn import SERIALIZER

    for j in state.plan.job_ids:
        if j in state.results:
            continue
        try:
            job = Job.fetch(j, connection=connection, serializer=SERIALIZER)
            if job.get_status() in ("queued", "deferred", "scheduled"):
                job.cancel()
        except Exception:  # noqa: BLE001 - best effort
            pass


# ------------------------------------------------------------------------------------ output

class Output:
    """JSONL: a line per document as it finishes. Markdown: a report written at the end."""

    def __init__(self, stream: IO[str], fmt: str, *, model: str):
        if fmt not in ("jsonl", "md"):
            raise ValueError(f"unknown format {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self.model = model
        self.records: list[tuple[int, dict[str, Any]]] = []

    def add(self, index: int, record: dict[str, Any]) -> None:
        self.records.append((index, record))
        if self.fmt == "jsonl":
            self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.stream.flush()

    def finish(self, skipped: Sequence[Skipped], *, wall_seconds: float) -> None:
        if self.fmt == "md":
            self.stream.write(markdown_report([r for _, r in sorted(self.records, key=lambda x: x[0])], skipped,
                                              model=self.model, wall_seconds=wall_seconds))
            self.stream.flush()


def markdown_report(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *, model: str,
                    wall_seconds: float) -> str:
    ok = [r for r in records if not r.get("error")]
    failed = [r for r in records if r.get("error")]
    lines = ["# Summaries", ""]
    lines.append(f"{len(ok)} document{'s' if len(ok) != 1 else ''} summarised"
                 + (f", {len(failed)} failed" if failed else "")
                 + (f", {len(skipped)} skipped" if skipped else "")
                 + f" with `{model}` in {wall_seconds:.1f} s.")
    lines.append("")
    for r in ok:
        lines += [f"## {r['path']}", "", (r.get("summary") or "_(empty summary)_").strip(), ""]
        detail = (f"{r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}"
                  + (f", {r['reduce_levels']} reduce level{'s' if r['reduce_levels'] != 1 else ''}" if r["reduce_levels"] else "")
                  + f" · {r['tokens_in']:,} tokens in, {r['tokens_out']:,} out · {r['seconds']:.1f} s")
        lines += [f"_{detail}_", ""]
    if failed:
        lines += ["## Failed", ""]
        lines += [f"- `{r['path']}`: {r['error']}" for r in failed]
        lines.append("")
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- `{s.path}`: {s.reason}" for s in skipped]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the run

@dataclass
class RunReport:
    documents: int
    summarised: int
    failed: int
    skipped: list[Skipped]
    chunks: int
    tokens_in: int
    tokens_out: int
    wall_seconds: float
    records: list[dict[str, Any]]


def summarize(paths: Sequence[str], *, output: IO[str], fmt: str = "jsonl", model: str = DEFAULT_MODEL,
              workers: int | None = None, threads: int | None = None, template: str | None = None,
              kv_budget: str | None = None, max_summary_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS,
              overlap_tokens: int = DEFAULT_OVERLAP_TOKENS, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
              max_bytes: int = DEFAULT_MAX_BYTES, redis_url: str | None = None, progress_stream: IO[str] | None = None,
              meter: PromptMeter | None = None, repack: bool = True,
              speculative: str = DEFAULT_SPECULATIVE) -> RunReport:
    """Summarise every readable document under `paths`; see the module docstring. repack=False: the
    embedded workers run with --no-repack. speculative: how the jobs guess tokens ("off": plain)."""
    err = progress_stream if progress_stream is not None else sys.stderr
    t0 = time.monotonic()
    templates = Templates.load(template)
    docs, skipped = collect_documents(paths, max_bytes=max_bytes)
    for s in skipped:
        err.write(f"skipped {s.path}: {s.reason}\n")
    if not docs:
        err.write("nothing to summarise\n")
        Output(output, fmt, model=model).finish(skipped, wall_seconds=time.monotonic() - t0)
        return RunReport(0, 0, 0, skipped, 0, 0, 0, time.monotonic() - t0, [])

    budget_text = kv_budget or DEFAULT_KV_BUDGET
    budget = Budget(capacity=kv_capacity(model, budget_text), max_summary_tokens=max_summary_tokens,
                    overlap_tokens=overlap_tokens, chunk_tokens=chunk_tokens)
    if budget.prompt_limit < 32:
        raise SummarizeError(f"the KV budget holds {budget.capacity} tokens: too few for a prompt plus a "
                             f"{max_summary_tokens}-token summary; raise --kv-budget or lower --max-summary-tokens")
    meter = meter or PromptMeter.for_model(model)
    words = words_for(max_summary_tokens)
    fan_in = reduce_fan_in(meter, templates, budget, words)
    run_id = uuid.uuid4().hex[:12]
    err.write(f"summarising {len(docs)} document{'s' if len(docs) != 1 else ''} with {model}; KV budget "
              f"{budget.capacity} tokens, summaries up to {max_summary_tokens} tokens, up to {fan_in} per reduce\n")
    out = Output(output, fmt, model=model)

    def run(connection: Any, health: Callable[[], None] | None, remote: bool) -> list[DocState]:
        from jobs.schemas import model_key

        # Plan and submit one document at a time: workers start on the first document's chunks
        # while later documents are still being tokenized.
        states: list[DocState] = []
        progress = Progress(len(docs), 0, stream=err)
        for i, d in enumerate(docs):
            plan = plan_document(i, d, run_id=run_id, model=model, meter=meter, templates=templates,
                                 budget=budget, fan_in=fan_in)
            submit_plans(connection, [plan], model=model, templates=templates, budget=budget,
                         speculative=speculative)
            states.append(DocState(plan, time.time()))
            progress.total_chunks += len(plan.chunks)
        progress.update(0, 0, force=True)

        def on_done(s: DocState) -> None:
            out.add(s.plan.index, s.record(model))
            if s.error:
                progress.message(f"failed {s.plan.doc.path}: {s.error}")

        def no_workers() -> bool:
            if not remote:
                return True
            n = _count_workers(connection, model_key(model))
            if n == 0:
                progress.message(f"no worker for model {model} is connected to this Redis yet; waiting "
                                 f"(start one with: rqllm worker --model {model})")
            return True

        try:
            follow(connection, states, on_done=on_done, progress=progress, health=health,
                   no_worker_warning=no_workers)
        except KeyboardInterrupt:
            # Do not leave work behind in a shared Redis: cancel what has not started.
            pending = [s for s in states if not s.done]
            for st in pending:
                _cancel_rest(connection, st)
            progress.message(f"interrupted: canceled the queued jobs of {len(pending)} unfinished "
                             f"document{'s' if len(pending) != 1 else ''}")
            raise
        finally:
            progress.close()
        return states

    url = redis_url
    if url is None:
        from jobs.redis_conn import redis_url_from_env

        url = redis_url_from_env()
    if url:
        from jobs.redis_conn import connect

        if workers is not None or threads:
            err.write("note: --workers and --threads only apply without REDIS_URL; the workers are the ones "
                      "already serving that Redis\n")
        states = run(connect(url), None, True)
    else:
        from pipeline.embedded import choose_embedded_split, embedded_cluster
        from jobs.redis_conn import connect

        # map jobs, roughly (4 characters a token): enough to tell one worker's worth from several
        jobs = sum(max(1, len(d.text) // 4 // max(1, budget.prompt_limit) + 1) for d in docs)
        split = choose_embedded_split(model, jobs, workers=workers, threads=threads,
                                      kv_budget=worker_kv_budget(model, budget_text), repack=repack)
        with embedded_cluster(model, workers=split.workers, threads=split.threads,
                              kv_budget=worker_kv_budget(model, budget_text), repack=repack,
                              split_reason=split.reason) as cluster:
            err.write(f"embedded: {cluster.split}\n")
            states = run(connect(cluster.redis_url), cluster.check, False)
    wall = time.monotonic() - t0
    out.finish(skipped, wall_seconds=wall)
    records = [s.record(model) for s in states]
    report = RunReport(
        documents=len(states), summarised=sum(1 for s in states if not s.error),
        failed=sum(1 for s in states if s.error), skipped=skipped, chunks=sum(r["chunks"] for r in records),
        tokens_in=sum(r["tokens_in"] for r in records), tokens_out=sum(r["tokens_out"] for r in records),
        wall_seconds=wall, records=records,
    )
    err.write(f"done: {report.summarised} summarised, {report.failed} failed, {len(skipped)} skipped; "
              f"{report.tokens_in:,} tokens in, {report.tokens_out:,} out; {wall:.1f} s\n")
    return report


def _count_workers(connection: Any, mkey: str) -> int:
    from rq import SimpleWorker

    from jobs.redis_conn import SERIALIZER

    from jobs.schemas import model_key

    n = 0
    for w in SimpleWorker.all(connection=connection, serializer=SERIALIZER):
        model = connection.hget(w.key, "rqllm_model")
        try:
            if model is not None and model_key(model.decode()) == mkey:
                n += 1
        except ValueError:
            continue
    return n
