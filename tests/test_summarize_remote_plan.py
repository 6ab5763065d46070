"""A producer-only `rqllm summarize` (REDIS_URL set, the workers elsewhere) plans by the live workers:
chunks are sized to the smallest KV capacity the workers of the model publish, not to the
256 MiB default (a chunk larger than a small worker's budget would fail there), and tokens are
counted with the tokenizer and chat template the workers published, so the producer's host needs no
model file: its cache stays without models/.

Real Redis, a real SmolLM2 worker with a small KV budget, the real command in a subprocess whose
RQLLM_CACHE is an empty directory.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine.gguf_file import GGUFFile
from engine.model import Config, kv_plan
from pipeline.client import Client
from pipeline.model_header import header_key
from tests.conftest_redis import redis_server, redis_url, spawn_worker, wait_for_workers  # noqa: F401
from tests.model_available import needs_model

ROOT = Path(__file__).resolve().parent.parent
M = "smollm2-135m"
WORKER_BUDGET = "14MiB"  # about 600 tokens of SmolLM2's f16 cache: a 1,024-token chunk would not fit

pytestmark = needs_model(M)


def _capacity(model_path: Path, budget: str) -> int:
    with GGUFFile(model_path) as g:
        return kv_plan(Config.from_gguf(g), budget).tokens


def test_summarize_plans_by_the_live_workers_and_counts_tokens_without_the_model(redis_url, spawn_worker,  # noqa: F811
                                                                                  smollm2_path, tmp_path):
    capacity = _capacity(smollm2_path, WORKER_BUDGET)
    assert 400 < capacity < 1024
    w = spawn_worker(M, name="plan-w1", kv_budget=WORKER_BUDGET, threads=2)
    client = Client(redis_url)
    wait_for_workers(client.connection, [w.name])

    # what the worker publishes: its KV capacity, and its model's header without the weights
    (mine,) = [x for x in client.workers() if x["name"] == w.name]
    assert mine["kv_tokens"] == capacity
    packed = client.connection.hget(header_key(M), "gguf")
    assert packed is not None and len(packed) < smollm2_path.stat().st_size / 20
    with GGUFFile(smollm2_path) as g:
        header = g.metadata_only()  # what the worker published: the header, no tensors

    doc = tmp_path / "telegraph.md"
    doc.write_text((ROOT / "examples" / "history-of-the-telegraph.md").read_text())
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "PYTHONPATH": str(ROOT),
           "REDIS_URL": redis_url, "RQLLM_CACHE": str(cache)}
    out = tmp_path / "out.jsonl"
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "summarize", str(doc),
                        "--model", M, "--max-summary-tokens", "40", "-o", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    planned = re.search(r"KV budget (\d+) tokens", p.stderr)
    assert planned and int(planned.group(1)) == capacity, p.stderr  # not the 256 MiB default's
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert "error" not in record and record["chunks"] >= 3 and record["summary"], record
    # no model file came to this host: only the published header (and the tokenizer built from it)
    assert not (cache / "models").exists(), sorted(str(x.relative_to(cache)) for x in cache.rglob("*"))
    (kept,) = (cache / "headers").glob("*.gguf")
    assert kept.read_bytes() == header


def test_a_header_without_tensors_counts_tokens_as_the_model_file_does(smollm2_path, tmp_path):
    from pipeline.summarize import PromptMeter

    with GGUFFile(smollm2_path) as g:
        blob = g.metadata_only()
        keys = set(g.metadata)
    header = tmp_path / "header.gguf"
    header.write_bytes(blob)
    with GGUFFile(header) as h:
        assert h.tensors == {} and set(h.metadata) == keys
    messages = [{"role": "system", "content": "Summarise in 20 words."},
                {"role": "user", "content": "Grüße, <b>naïve</b> café — 3.14 × 2 ≈ 6.28!\n\nSecond paragraph."}]
    full, light = PromptMeter.for_model(str(smollm2_path)), PromptMeter.for_model(str(header))
    assert light.count(messages) == full.count(messages) > 20
