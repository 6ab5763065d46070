"""`rqllm summarize`: map -> reduce summaries of many documents, as one batch of rq jobs.

    files/folders/globs --collect--> documents (skipped ones reported with the reason)   documents
    document --chunk by model tokens--> one map job per chunk                            plan
             (jobs.summarize_tasks.summarize_chunk)
             ------------------------> reduce job(s) depends_on the map jobs              plan
             (.reduce_summaries), in levels when one reduce cannot hold all partial summaries
    the jobs go in as one batch through pipeline.client.Client                            run
    the batch's events --> one JSONL line (or a Markdown section) per document           follow, report

The prompts come from the templates (templates); SummarizeError says why a run cannot go ahead.
"""
from __future__ import annotations

from pipeline.summarize.documents import DEFAULT_MAX_BYTES, Document, Skipped, collect_documents, read_document
from pipeline.summarize.errors import SummarizeError
from pipeline.summarize.follow import DocState, follow
from pipeline.summarize.plan import (DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_SUMMARY_TOKENS, DEFAULT_OVERLAP_TOKENS, Budget,
                                     DocPlan, PromptMeter, ReduceNode, kv_capacity, plan_document, reduce_fan_in,
                                     reduce_tree, worker_kv_budget)
from pipeline.summarize.report import Output, Progress, RunReport, html_report, markdown_report
from pipeline.summarize.run import DEFAULT_SPECULATIVE, submit_plans, summarize
from pipeline.summarize.templates import DEFAULT_STYLE, DEFAULT_TEMPLATE, STYLES, Templates, document_context, words_for

__all__ = [
    "DEFAULT_CHUNK_TOKENS", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_SUMMARY_TOKENS", "DEFAULT_OVERLAP_TOKENS",
    "DEFAULT_SPECULATIVE", "DEFAULT_STYLE", "DEFAULT_TEMPLATE", "STYLES", "Budget", "DocPlan", "DocState", "Document", "Output", "Progress",
    "PromptMeter", "ReduceNode", "RunReport", "Skipped", "SummarizeError", "Templates", "collect_documents",
    "document_context", "follow", "html_report", "kv_capacity", "markdown_report", "plan_document", "read_document", "reduce_fan_in", "reduce_tree",
    "submit_plans", "summarize", "words_for", "worker_kv_budget",
]
