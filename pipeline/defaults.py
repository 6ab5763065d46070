"""Defaults of the pipeline layer (the commands' runs and reports): one place to change them.
The engine's are in engine.defaults, the queue's in jobs.defaults."""
from __future__ import annotations

# A summarise or extract run reads its jobs' results while it follows its batch, so they need to
# outlive the run, not the week jobs.defaults keeps a submitted batch's results; the batch's own
# keys live as long (pipeline.client). Token streams only serve `rqllm watch` while a job runs.
RUN_RESULT_TTL = 24 * 3600
RUN_STREAM_TTL = 3600

# What `rqllm summarize --format` writes (pipeline.summarize.report).
REPORT_FORMATS: tuple[str, ...] = ("jsonl", "md", "html")
