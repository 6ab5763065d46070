"""Defaults every layer shares (engine, jobs, pipeline, CLI): one place to change them."""
from __future__ import annotations

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"  # a job, batch line or command that names no model (README: Models)
DEFAULT_KV_BUDGET = "256MiB"  # a worker's KV cache when --kv-budget is not given
