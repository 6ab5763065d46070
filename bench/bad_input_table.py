"""Every kind of bad input against the real components, as a table for the note.

    python -m bench.bad_input_table            # prints a Markdown table (about 30 s; SmolLM2, private Redis)
    python -m bench.bad_input_table --json     # the rows as JSON

Real everything: a private redis-server, one `rqllm worker` process (SmolLM2-135M, --kv-budget 8MiB,
so 364 tokens of KV), `rqllm submit` on one OpenAI Batch JSONL file holding every bad request line
between good ones, `rqllm collect` for the output, attacker jobs written straight into Redis, and
`rqllm worker` started on broken copies of the SmolLM2 GGUF file.

Columns: the input | where it is caught | the error text (as the user sees it) | whether the worker
went on, and how that was checked:
* refused at submission: the line never reaches Redis; the file's other lines are submitted and done;
* failed inside the worker: the output line is a failed line with the reason, and the same worker
  then ran a later job of the batch (its result's started_at is after the failure's ended_at);
* a bad model file: `rqllm worker` exits 1 before loading anything or touching Redis; the running
  worker is unaffected (it still runs the jobs submitted after).
tests/test_bad_input.py runs this and checks every row against hand-written expectations.
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent

M = "smollm2-135m"
KV_BUDGET = "8MiB"  # 364 tokens of SmolLM2 in the default f16 cache


@dataclass
class Row:
    name: str  # the bad input
    where: str  # "submission", "worker", "worker start-up"
    error: str  # the message the user sees
    went_on: bool  # checked, see the module docstring
    how: str  # how went_on was checked


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _line(custom_id: str | None, body: dict, url: str = "/v1/chat/completions") -> str:
    obj = {"method": "POST", "url": url, "body": {"model": M, **body}}
    if custom_id is not None:
        obj = {"custom_id": custom_id, **obj}
    return json.dumps(obj)


def _chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


GOOD = _chat("Say hi.", max_tokens=3)

# (name, JSONL line as bytes): refused at submission
SUBMISSION_CASES: list[tuple[str, bytes]] = [
    ("empty prompt", _line("empty", {"prompt": "", "max_tokens": 3}, "/v1/completions").encode()),
    ("whitespace-only prompt", _line("blank", {"prompt": " \n ", "max_tokens": 3}, "/v1/completions").encode()),
    ("max_tokens = 0", _line("mt0", _chat("hi", max_tokens=0)).encode()),
    ("max_tokens < 0", _line("mtneg", _chat("hi", max_tokens=-5)).encode()),
    ("max_tokens huge (10^9)", _line("mthuge", _chat("hi", max_tokens=10**9)).encode()),
    ("temperature < 0", _line("tneg", _chat("hi", temperature=-1)).encode()),
    ("temperature > 10", _line("thigh", _chat("hi", temperature=11)).encode()),
    ("top_p = 0", _line("p0", _chat("hi", top_p=0)).encode()),
    ("top_p > 1", _line("p15", _chat("hi", top_p=1.5)).encode()),
    ("invalid UTF-8 bytes in the line", _line("utf8", _chat("caf!")).encode().replace(b"caf!", b"caf\xe9")),
    ("lone surrogate (\\ud800) in a prompt", _line("surrogate", {"prompt": "a\ud800b"}, "/v1/completions").encode()),
    ("chat message with an unknown role", _line("role", {"messages": [{"role": "wizard", "content": "hi"}]}).encode()),
    ("chat message list empty", _line("nomsg", {"messages": []}).encode()),
    ("chat message content not text", _line("content", {"messages": [{"role": "user", "content": 42}]}).encode()),
    ("50 MB prompt", _line("huge", {"prompt": "x" * (50 << 20)}, "/v1/completions").encode()),
    ("line that is not JSON", b'{"custom_id": "broken", "body": {'),
    ("line without custom_id", _line(None, GOOD).encode()),
    ("custom_id used twice", _line("good-1", GOOD).encode()),
]

# (name, custom_id, body): accepted at submission, failed by the worker (only it knows its KV budget)
WORKER_CASES: list[tuple[str, str, dict]] = [
    ("prompt + max_tokens over the worker's KV budget", "overkv", _chat("Say hi.", max_tokens=400)),
    ("max_tokens over the KV budget (within the schema's limit)", "mtkv", _chat("Say hi.", max_tokens=100_000)),
    ("prompt alone over the KV budget", "longprompt", _chat("word " * 600, max_tokens=2)),
]


def _gguf_cases(model: Path, directory: Path) -> list[tuple[str, Path]]:
    """Broken copies of the real model file."""
    from engine.gguf_file import GGUFFile

    data = model.read_bytes()
    with GGUFFile(model) as g:
        first = next(iter(g.tensors.values()))
        data_offset = g.data_offset
    first_name = first.name.encode()
    table = data.index(struct.pack("<Q", len(first_name)) + first_name)  # tensor #0's name length
    type_at = table + 8 + len(first_name) + 4 + 8 * len(first.shape)  # tensor #0's ggml type id

    def patched(at: int, new: bytes) -> bytes:
        return data[:at] + new + data[at + len(new):]

    emb = b"llama.embedding_length"
    emb_at = data.index(emb) + len(emb) + 4
    arch_at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    files = {
        "truncated GGUF (download cut short)": data[: len(data) // 2],
        "truncated inside the header": data[: data_offset // 2],
        "wrong magic": b"GGUX" + data[4:4096],
        "garbled tensor table": patched(table, b"\xff" * 64),
        "unknown architecture": patched(arch_at, b"mamba"),
        "unknown quant type id": patched(type_at, struct.pack("<I", 200)),
        "quant type we do not run (IQ4_NL)": patched(type_at, struct.pack("<I", 20)),
        "tensor shapes that do not match the metadata": patched(emb_at, struct.pack("<I", 594)),
    }
    out = []
    for i, (name, blob) in enumerate(files.items()):
        path = directory / f"bad-{i}.gguf"
        path.write_bytes(blob)
        out.append((name, path))
    return out


def _plant(conn, job_id: str, func: str, args: list, queue: str) -> None:
    """An rq job written straight into Redis (no submission path): only the worker can refuse it."""
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    conn.hset(f"rq:job:{job_id}", mapping={"data": zlib.compress(json.dumps([func, None, args, {}]).encode()),
                                           "created_at": now, "enqueued_at": now, "status": "queued",
                                           "origin": queue, "description": job_id, "timeout": "60"})
    conn.rpush(f"rq:queue:{queue}", job_id)


def run(workdir: Path) -> list[Row]:
    from pipeline.client import Client
    from pipeline.embedded import RedisServer, WorkerProcess, worker_argv
    from pipeline.memory_guard import check_worker_start

    model = check_worker_start(M, KV_BUDGET).model_path  # pulls the model if needed
    rows: list[Row] = []
    with RedisServer() as server:
        url = server.url
        client = Client(url)
        conn = client.connection

        # attacker / stale-client jobs bypassing submission, in the high queue: first for the worker
        _plant(conn, "bypass-os-system", "os.system", ["true"], f"rqllm:{M}:high")
        _plant(conn, "bypass-bad-payload", "jobs.tasks.generate",
               [{"prompt": "hi", "params": {"max_tokens": -1}}], f"rqllm:{M}:high")

        # one JSONL file: good lines around every bad one; worker-failing lines among them
        lines: list[bytes] = [_line("good-1", GOOD).encode()]
        line_of: dict[str, int] = {}
        for name, raw in SUBMISSION_CASES:
            lines.append(raw)
            line_of[name] = len(lines)
        for name, cid, body in WORKER_CASES:
            lines.append(_line(cid, body).encode())
            lines.append(_line(f"after-{cid}", GOOD | {"messages": [{"role": "user", "content": f"Say {cid}."}]})
                         .encode())
        lines.append(_line("good-last", _chat("Name a colour.", max_tokens=3)).encode())
        src = workdir / "requests.jsonl"
        src.write_bytes(b"\n".join(lines) + b"\n")
        n_good = 1 + len(WORKER_CASES) * 2 + 1  # lines that pass submission

        worker_log = workdir / "worker.log"
        w = WorkerProcess(worker_argv(url, M, threads=1, kv_budget=KV_BUDGET, name="table-w1"), str(worker_log))
        try:
            t0 = time.monotonic()
            sub = _cli("submit", str(src), "--redis-url", url)
            submit_s = time.monotonic() - t0
            # exit 1 says lines were refused (the point here); the batch is submitted all the same
            if sub.returncode != 0 and not (sub.returncode == 1 and "line(s) refused" in sub.stderr):
                raise RuntimeError(f"rqllm submit failed: {sub.stderr[-2000:]}")
            batch_id = sub.stdout.strip().splitlines()[-1]
            refused = {}
            for text in sub.stderr.splitlines():
                m = re.match(r"refused: .*?: line (\d+)(?: \([^)]*\))?: (.*)", text)
                if m:
                    refused[int(m.group(1))] = m.group(2)
            status = client.batch_status(batch_id)
            out = workdir / "results.jsonl"
            col = _cli("collect", batch_id, "-o", str(out), "--redis-url", url, "--timeout", "300")
            if col.returncode != 0:
                raise RuntimeError(f"rqllm collect failed: {col.stderr[-2000:]}")
            results = {json.loads(x)["custom_id"]: json.loads(x) for x in out.read_text().splitlines() if x.strip()}
            good_ids = ["good-1", *(f"after-{cid}" for _, cid, _ in WORKER_CASES), "good-last"]
            done_good = sum(1 for c in good_ids if c in results and results[c]["error"] is None)
            ours = dict(client.results(batch_id))

            for name, _ in SUBMISSION_CASES:
                n = line_of[name]
                went_on = status.requests == n_good and done_good == len(good_ids)
                rows.append(Row(name, "submission" if n in refused else "NOT REFUSED", refused.get(n, ""), went_on,
                                f"line {n} refused by `rqllm submit` in {submit_s:.1f} s; the file's other "
                                f"{status.requests} lines submitted, all {done_good} good ones done"))

            for name, cid, _ in WORKER_CASES:
                failed = ours.get(cid)
                line = results.get(cid, {})
                err = (line.get("error") or {}).get("message", "")
                later = [r for c, r in ours.items() if r is not None and r.status == "done" and failed is not None
                         and r.worker == failed.worker and r.started_at and r.started_at >= failed.ended_at]
                rows.append(Row(name, "worker" if failed is not None and failed.status == "failed" else "NOT FAILED",
                                f"{(line.get('error') or {}).get('code', '')}: {err}", bool(later),
                                f"failed output line; worker {failed.worker if failed else '?'} then ran "
                                f"{len(later)} later job(s) of the batch"))

            for job_id, name in (("bypass-os-system", "job naming os.system written into Redis"),
                                 ("bypass-bad-payload", "job payload that skips submission and fails the schema")):
                r = client.result(job_id)
                first_good = ours.get("good-1")
                went_on = r is not None and first_good is not None and first_good.status == "done" and \
                    first_good.started_at >= r.ended_at
                rows.append(Row(name, "worker" if r is not None and r.status == "failed" else "NOT FAILED",
                                f"{r.error.code}: {r.error.message}" if r is not None and r.error else "", went_on,
                                "recorded failed; the same worker then ran the batch's jobs"))

            from concurrent.futures import ThreadPoolExecutor

            def start_worker(path: Path) -> tuple[subprocess.CompletedProcess, float]:
                t0 = time.monotonic()
                p = _cli("worker", "--model", str(path), "--redis-url", url, "--kv-budget", KV_BUDGET, timeout=120)
                return p, time.monotonic() - t0

            cases = _gguf_cases(model, workdir)
            with ThreadPoolExecutor(4) as pool:  # mostly interpreter start-up: overlap them
                runs = list(pool.map(start_worker, [path for _, path in cases]))
            for (name, path), (p, took) in zip(cases, runs):
                last = [x for x in p.stderr.strip().splitlines() if x.strip()]
                msg = last[-1] if last else ""
                msg = msg.replace(str(path), path.name)
                refused_cleanly = p.returncode == 1 and "Traceback" not in p.stderr
                rows.append(Row(name, "worker start-up" if refused_cleanly else f"exit {p.returncode}", msg,
                                w.alive(), f"`rqllm worker` exited {p.returncode} in {took:.1f} s, before loading; "
                                           f"the running worker {'is still up' if w.alive() else 'DIED'}"))
            # the running worker is still taking jobs after all that
            jid = client.submit({"model": M, "prompt": "One more.", "params": {"max_tokens": 2}})
            deadline = time.monotonic() + 120
            while client.result(jid) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            final = client.result(jid)
            if final is None or final.status != "done":
                for row in rows:
                    if row.where == "worker start-up":
                        row.went_on = False
        finally:
            _stop(w)
    return rows


def _stop(w) -> None:
    from pipeline.embedded import stop_workers

    stop_workers([w])


def _cell(text: str, width: int = 220) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


def markdown(rows: list[Row]) -> str:
    out = ["| input | where caught | error text | worker went on (checked) |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {_cell(r.name)} | {r.where} | {_cell(r.error)} | {'yes' if r.went_on else 'NO'}: "
                   f"{_cell(r.how, 120)} |")
    return "\n".join(out)


@click.command(help=__doc__)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def main(as_json: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="rqllm-bad-input-") as tmp:
        rows = run(Path(tmp))
    print(json.dumps([asdict(r) for r in rows], indent=1) if as_json else markdown(rows))
    sys.exit(0 if all(r.went_on and not r.where.startswith(("NOT", "exit")) for r in rows) else 1)


if __name__ == "__main__":
    main()
