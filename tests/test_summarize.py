"""`rqllm summarize` end to end: the real SmolLM2 model, a real Redis, real worker processes.

Kept small for CI on 2 cores: summaries of at most 40 tokens and a 640-token KV budget, so the
long example splits into many chunks and its reduce runs in two levels.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.process_waits import stop

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODEL = "smollm2-135m"
KV = "640tok"
MAX_SUMMARY = "40"

def rqllm(*args: str, env: dict[str, str] | None = None, timeout: float = 800) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (as a user would), with stderr kept apart from stdout."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env.pop("REDIS_URL", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args],
                          cwd=str(ROOT), env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def engine_ready():
    """The model file (pulled into the cache when missing) and an importable engine with its kernels.

    Failing, not skipping: this is the test that says the main job works at all."""
    from engine.registry import pull

    path = pull(MODEL, quiet=True)
    try:
        from engine.engine import Engine  # noqa: F401
        from pipeline.summarize import PromptMeter

        PromptMeter.for_model(MODEL)
    except ImportError as e:  # pragma: no cover - the kernels are built by .ci/run / pip install
        pytest.fail(f"the engine is not importable (build the kernels first): {e}")
    return path


@pytest.fixture()
def corpus(tmp_path):
    """The three examples plus files that must be skipped, one per reason."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for f in EXAMPLES.glob("*.md"):
        shutil.copy(f, docs / f.name)
    (docs / "empty.txt").write_text("\n  \n")
    (docs / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(range(256)) * 4)
    os.symlink(docs / "gone.md", docs / "unreadable.md")  # dangling: cannot be opened
    return docs


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_summarize_folder_embedded(engine_ready, corpus, tmp_path):
    out = tmp_path / "summaries.jsonl"
    t0 = time.monotonic()
    proc = rqllm("summarize", str(corpus), "-o", str(out), "--model", MODEL, "--workers", "2", "--kv-budget", KV,
                 "--max-summary-tokens", MAX_SUMMARY)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_jsonl(out)
    by_name = {Path(r["path"]).name: r for r in records}
    assert set(by_name) == {p.name for p in EXAMPLES.glob("*.md")}, proc.stderr[-3000:]
    for name, r in by_name.items():
        assert isinstance(r["summary"], str) and r["summary"].strip(), (name, r)
        assert r["tokens_in"] > 0 and r["tokens_out"] > 0
        assert r["seconds"] > 0
        assert "error" not in r
    # The short document is one chunk (no reduce); the long one needs map -> reduce in levels.
    short = by_name["team-sync-notes.md"]
    assert short["chunks"] == 1 and short["reduce_levels"] == 0 and short["jobs"] == 1
    long = by_name["design-tiered-storage.md"]
    assert long["chunks"] >= 8, long
    assert long["reduce_levels"] >= 2, long
    assert long["jobs"] > long["chunks"]
    # The map prompts share their instructions: the worker reused cached prompt prefixes.
    assert sum(r["prefix_hit_tokens"] for r in records) > 0
    # Map and reduce jobs decode with prompt lookup by default; the records count the guesses.
    assert 0 < sum(r["accepted_tokens"] for r in records) <= sum(r["draft_tokens"] for r in records)

    err = proc.stderr
    assert "documents 3/3" in err, err[-2000:]
    total_chunks = sum(r["chunks"] for r in records)
    assert f"chunks {total_chunks}/{total_chunks}" in err
    skipped = {line.split(":")[0].rsplit("/", 1)[-1]: line for line in err.splitlines() if line.startswith("skipped ")}
    assert "empty" in skipped["empty.txt"]
    assert "binary" in skipped["photo.jpg"]
    assert "unreadable" in skipped["unreadable.md"]
    assert "3 summarised, 0 failed, 3 skipped" in err
    print(f"\nembedded run, 2 workers: {wall:.1f} s; "
          + "; ".join(f"{n}: {r['chunks']} chunks, {r['tokens_in']} in / {r['tokens_out']} out"
                      for n, r in by_name.items()))


@pytest.fixture()
def redis_and_worker(engine_ready, tmp_path):
    """A real redis-server and one `rqllm worker` process, as docker-compose runs them."""
    from pipeline.embedded import RedisServer
    from pipeline.summarize import worker_kv_budget

    server = RedisServer().start()
    log = open(tmp_path / "worker.log", "wb")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["REDIS_URL"] = server.url
    worker = subprocess.Popen(
        [sys.executable, "-c", "from pipeline.cli import main; main()", "worker", "--model", MODEL,
         "--threads", "2", "--kv-budget", worker_kv_budget(MODEL, KV)],
        cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield server.url
    finally:
        stop(worker)
        log.close()
        server.stop()


@pytest.mark.slow  # ~3 min on 2 cores; the embedded test covers map -> reduce in the default run
def test_summarize_remote_markdown(redis_and_worker, tmp_path):
    """With REDIS_URL the command only submits and follows; the worker is someone else's."""
    out = tmp_path / "report.md"
    notes = EXAMPLES / "team-sync-notes.md"
    telegraph = EXAMPLES / "history-of-the-telegraph.md"
    proc = rqllm("summarize", str(notes), str(telegraph), "--format", "md", "-o", str(out), "--model", MODEL,
                 "--kv-budget", KV, "--max-summary-tokens", MAX_SUMMARY, env={"REDIS_URL": redis_and_worker})
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = out.read_text()
    assert md.startswith("# Summaries")
    assert f"## {notes}" in md and f"## {telegraph}" in md
    for section in md.split("\n## ")[1:]:
        body = section.split("\n", 1)[1].strip()
        assert body and not body.startswith("_(empty"), section
    assert "documents 2/2" in proc.stderr
    # The telegraph history is about 1,000 words: several chunks at this budget, one reduce.
    assert "reduce level" in md


def test_a_run_reads_the_model_file_once(engine_ready, monkeypatch):
    """The run's ModelInfo serves the file check, the KV plan, the worker budget, the token meter and the
    memory guard's split: the GGUF is opened once (by name, each of them opens it again)."""
    import engine.gguf_file as gguf_file
    from pipeline.embedded import choose_embedded_split
    from pipeline.summarize.plan import PromptMeter, kv_capacity, worker_kv_budget
    from pipeline.summarize.run import open_model

    opened: list[str] = []
    real_init = gguf_file.GGUFFile.__init__

    def counting_init(self, path, **kw):
        opened.append(str(path))
        real_init(self, path, **kw)

    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", counting_init)
    with open_model(MODEL) as info:
        capacity = kv_capacity(info, KV)
        budget = worker_kv_budget(info, KV)
        meter = PromptMeter.for_model(info)
        assert meter.count([{"role": "user", "content": "Hello."}]) > 0
        choose_embedded_split(MODEL, 4, workers=None, threads=None, kv_budget=budget, info=info)
    assert capacity == 640 and len(opened) == 1
    opened.clear()
    assert kv_capacity(MODEL, KV) == 640 and len(opened) == 1  # by name: a file opened (and closed) per call
