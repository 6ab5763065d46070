"""`rqllm extract` on documents longer than a worker's KV budget: each chunk gives an object under the
schema (map), then one job merges them into one object under the same schema (reduce). The model
chooses the scalars with the chunk objects as its input; top-level arrays are joined and de-duplicated
here, in document order (cut to the schema's maxItems), rather than trusted to a small model.
"""
from __future__ import annotations

import json
from typing import Any

from jobs.summary_unit import ReduceSpec
from pipeline.chunking import ChunkingError, chunk_text
from pipeline.summarize.errors import SummarizeError
from pipeline.summarize.plan import PromptMeter

REDUCE_SYSTEM = ("You merge partial extractions taken from consecutive parts of one document into one JSON object "
                 "that follows this JSON schema. Prefer values stated most completely; do not invent facts.\n"
                 "Schema: {schema}")


def document_messages(doc_text: str, path: str, schema: dict[str, Any], instructions: str | None) -> list[dict]:
    from pipeline.extract import SYSTEM

    system = SYSTEM.format(schema=json.dumps(schema, ensure_ascii=False))
    if instructions:
        system += "\n" + instructions
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Document {path}:\n\n{doc_text}"}]


def chunk_messages(text: str, path: str, schema: dict[str, Any], instructions: str | None, meter: PromptMeter,
                   prompt_limit: int, chunk_tokens: int | None = None) -> list[list[dict]]:
    """One prompt per chunk of `text`, each within prompt_limit tokens (pipeline.chunking's boundaries)."""
    widest = f"{path} (part 999)"

    def measure(piece: str) -> int:
        return meter.count(document_messages(piece, widest, schema, instructions))

    limit = prompt_limit if chunk_tokens is None else min(prompt_limit, measure("") + chunk_tokens)
    try:
        chunks = chunk_text(text, meter.tokenizer, limit, measure=measure)
    except ChunkingError as exc:
        raise SummarizeError(f"{path}: {exc}; raise --kv-budget or lower --max-tokens") from None
    return [document_messages(c.text, f"{path} (part {c.index + 1} of {len(chunks)})", schema, instructions)
            for c in chunks]


def reduce_spec(model: str, path: str, schema: dict[str, Any], instructions: str | None) -> ReduceSpec:
    """The merge prompt, as summarisation's reduce prompt is built (jobs.summary_unit): the chunk objects
    are its parts, one JSON object a line."""
    system = REDUCE_SYSTEM.format(schema=json.dumps(schema, ensure_ascii=False))
    if instructions:
        system += "\n" + instructions
    return ReduceSpec(model=model, system=system, user=f"Partial extractions from document {path}:\n{{text}}",
                      part="Part {n}: {summary}", separator="\n", words=0)


def reduce_messages(path: str, schema: dict[str, Any], instructions: str | None, parts: list[dict[str, Any]],
                    meter: PromptMeter, prompt_limit: int) -> list[dict]:
    """The merge prompt for the chunk objects; the last ones are left out if they do not all fit."""
    spec = reduce_spec("", path, schema, instructions)
    objects = [json.dumps(p, ensure_ascii=False) for p in parts]
    n = spec.leading_that_fit(objects, meter.count, prompt_limit)
    if n == 0:
        raise SummarizeError(f"{path}: one chunk's extraction alone does not fit a merge prompt; raise --kv-budget")
    return spec.messages(objects[:n])


def join_arrays(merged: dict[str, Any], parts: list[dict[str, Any]], schema: dict[str, Any]) -> dict[str, Any]:
    """`merged` with each top-level array property replaced by the parts' arrays joined, first occurrence
    first, duplicates dropped, cut to the property's maxItems."""
    out = dict(merged)
    for name, prop in (schema.get("properties") or {}).items():
        if not isinstance(prop, dict) or prop.get("type") != "array":
            continue
        joined: list[Any] = []
        seen: set[str] = set()
        for part in parts:
            for item in part.get(name) or []:
                key = json.dumps(item, sort_keys=True, ensure_ascii=False)
                if key not in seen:
                    seen.add(key)
                    joined.append(item)
        if len(joined) < max(1, int(prop.get("minItems") or 0)):
            continue  # too few to satisfy the schema: the model's merged array stays
        cap = prop.get("maxItems")
        out[name] = joined[:cap] if isinstance(cap, int) else joined
    return out
