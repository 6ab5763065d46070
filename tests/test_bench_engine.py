"""bench/bench_engine.py's peers: llama-bench's JSON is parsed into (pp, tg) tok/s, and a whole run
against two fake llama-bench binaries prints one table with ours, llama, the better ik setting per
figure and the ratios.  The fakes are tiny scripts that print llama-bench's JSON and record their
arguments."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench import bench_engine, shapes


def _test(n_prompt: int, n_gen: int, ts: float) -> dict:
    return {"model_type": "qwen2 1.5B Q4_K - Medium", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0,
            "avg_ns": 1, "avg_ts": ts, "stddev_ts": 0.0, "samples_ts": [ts]}


def test_parse_llama_bench_json_takes_prompt_and_generation_tests():
    text = "some log line\n" + json.dumps([_test(256, 0, 123.5), _test(0, 32, 9.25)])
    assert bench_engine.parse_llama_bench_json(text) == (123.5, 9.25)
    with pytest.raises(bench_engine.PeerError):
        bench_engine.parse_llama_bench_json(json.dumps([_test(256, 0, 1.0)]))  # no generation test
    with pytest.raises(bench_engine.PeerError):
        bench_engine.parse_llama_bench_json("error: failed to load model")


# llama-bench's usage lines (`llama-bench --help`) for the flags the bench needs, as llama.cpp and
# ik_llama.cpp print them; a real binary's own help is read instead when $RQLLM_LLAMA_BENCH or
# $RQLLM_IK_BENCH names one.
LLAMA_BENCH_USAGE = """
  -m, --model <filename>                            (default: models/7B/ggml-model-q4_0.gguf)
  -p, --n-prompt <n>                                (default: 512)
  -n, --n-gen <n>                                   (default: 128)
  -t, --threads <n>                                 (default: 2)
  -ngl, --n-gpu-layers <n>                          (default: -1)
  -r, --repetitions <n>                             number of times to repeat each test (default: 5)
  -o, --output <csv|json|jsonl|md|sql>              output format printed to stdout (default: md)
"""
IK_BENCH_USAGE = LLAMA_BENCH_USAGE + """
  -rtr, --run-time-repack <0|1>       (default: 0)
"""


def _usage(env_var: str, excerpt: str) -> str:
    exe = os.environ.get(env_var)
    if not exe:
        return excerpt
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("env_var, excerpt, extra, wanted", [
    ("RQLLM_LLAMA_BENCH", LLAMA_BENCH_USAGE, (), {}),
    ("RQLLM_IK_BENCH", IK_BENCH_USAGE, ("-rtr", "1"), {"--run-time-repack": "1"}),
])
def test_llama_bench_command_asks_llama_bench_for_what_the_bench_reads(env_var, excerpt, extra, wanted):
    """Each flag, read through llama-bench's own usage, means what the bench relies on: the model and
    sizes asked for, one repetition per process (the bench interleaves its repetitions), JSON on stdout
    (parse_llama_bench_json), no GPU layers (a CPU comparison)."""
    long_names = dict(re.findall(r"^\s+(-[\w-]+), (--[\w-]+)", _usage(env_var, excerpt), re.M))
    cmd = bench_engine.llama_bench_command("/x/llama-bench", Path("/m.gguf"), 2, 256, 32, extra)
    assert cmd[0] == "/x/llama-bench" and len(cmd) % 2 == 1
    unknown = [f for f in cmd[1::2] if f not in long_names]
    assert unknown == [], f"llama-bench has no flag {unknown}"
    meant = {long_names[flag]: value for flag, value in zip(cmd[1::2], cmd[2::2])}
    assert meant == {"--model": "/m.gguf", "--n-prompt": "256", "--n-gen": "32", "--threads": "2",
                     "--repetitions": "1", "--output": "json", "--n-gpu-layers": "0", **wanted}


FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
get = lambda flag: args[args.index(flag) + 1]
pp, tg = {pp}, {tg}
if "-rtr" in args:
    pp, tg = {rtr_pp}, {rtr_tg}
print(json.dumps([
    {{"n_prompt": int(get("-p")), "n_gen": 0, "avg_ts": pp}},
    {{"n_prompt": 0, "n_gen": int(get("-n")), "avg_ts": tg}},
]))
"""


def _fake(path: Path, log: Path, pp: float, tg: float, rtr_pp: float, rtr_tg: float) -> Path:
    path.write_text(FAKE.format(python=sys.executable, log=str(log), pp=pp, tg=tg, rtr_pp=rtr_pp, rtr_tg=rtr_tg))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_run_against_fake_binaries_prints_one_table(tmp_path, smollm2_path):
    model = shapes.SHAPES["8b-shape"].generate(tmp_path / "tiny.gguf", tiny=True, tokenizer_src=smollm2_path)
    log_l, log_ik = tmp_path / "llama.log", tmp_path / "ik.log"
    llama = _fake(tmp_path / "llama-bench", log_l, 100.0, 10.0, 0, 0)
    # ik: -rtr 1 is better for prefill, plain is better for decode
    ik = _fake(tmp_path / "ik-bench", log_ik, 200.0, 20.0, 400.0, 5.0)
    result = CliRunner().invoke(bench_engine.main, [
        "--model", str(model), "--threads", "1", "--reps", "2", "--prefill", "16", "--decode", "4",
        "--llama-bench", str(llama), "--ik-bench", str(ik)])
    assert result.exit_code == 0, result.output
    out = result.output
    # two repetitions, interleaved: llama twice, ik twice without and twice with -rtr 1
    assert log_l.read_text().count("-p 16 -n 4 -t 1 -r 1 -o json -ngl 0") == 2
    ik_runs = log_ik.read_text().splitlines()
    assert len(ik_runs) == 4 and sum("-rtr 1" in r for r in ik_runs) == 2
    header = next(line for line in out.splitlines() if line.startswith("model"))
    for col in ("kernel", "ours pp", "ours tg", "llama pp", "llama tg", "ik pp", "ik tg", "ik set",
                "/llama pp", "/llama tg", "/ik pp", "/ik tg"):
        assert col in header, col
    row = next(line for line in out.splitlines() if line.startswith(str(model)[:14]))
    cells = row.split()
    assert "pp16/tg4" in cells
    # the path, and "+r16" when the weights ran on the repacked cache
    assert cells[cells.index("pp16/tg4") + 1].split("+")[0] == bench_engine.kernel_path()
    assert ["100.0", "10.0", "400.0", "20.0", "rtr/plain"] == cells[cells.index("pp16/tg4") + 4:][:5]
    ours_pp, ours_tg = float(cells[cells.index("pp16/tg4") + 2]), float(cells[cells.index("pp16/tg4") + 3])
    ratios = [float(c.rstrip("x")) for c in cells[-4:]]
    assert ratios == pytest.approx([ours_pp / 100, ours_tg / 10, ours_pp / 400, ours_tg / 20], rel=0.02, abs=0.006)
    assert re.search(r"spread of the runs", out)
    # the paired ratios: ik against the setting each figure came from (rtr for pp, plain for tg)
    paired = out.splitlines()[out.splitlines().index(next(x for x in out.splitlines() if x.startswith("paired:"))) + 1]
    got = [float(c.rstrip("x")) for c in paired.split() if c.endswith("x")]
    assert got == pytest.approx([ours_pp / 100, ours_tg / 10, ours_pp / 400, ours_tg / 20], rel=0.02, abs=0.006)


def test_paired_ratio_is_the_median_of_each_reps_ratio():
    ours = [(100.0, 10.0), (50.0, 5.0), (90.0, 9.0)]
    peer = [(50.0, 20.0), (50.0, 2.5), (30.0, 9.0)]   # per rep: 2, 1, 3 and 0.5, 2, 1
    assert bench_engine.paired_ratio(ours, peer, 0) == 2.0
    assert bench_engine.paired_ratio(ours, peer, 1) == 1.0
    # the ratio of medians would say 90 / 50 = 1.8 and 9 / 9 = 1.0: pairing follows each rep's state
    assert bench_engine.paired_ratio(ours, [], 0) != bench_engine.paired_ratio(ours, [], 0)   # nan: no runs
    assert bench_engine.paired_ratio(ours[:2], [(float("nan"), 1.0), (25.0, 1.0)], 0) == 2.0


def test_a_failing_peer_is_reported_and_the_table_still_prints(tmp_path, smollm2_path):
    model = shapes.SHAPES["8b-shape"].generate(tmp_path / "tiny.gguf", tiny=True, tokenizer_src=smollm2_path)
    bad = tmp_path / "llama-bench"
    bad.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    bad.chmod(0o755)
    result = CliRunner().invoke(bench_engine.main, [
        "--model", str(model), "--threads", "1", "--reps", "1", "--prefill", "16", "--decode", "4",
        "--llama-bench", str(bad)])
    assert result.exit_code == 0, result.output
    assert "failed to load model" in result.output
    row = next(line for line in result.output.splitlines() if line.startswith(str(model)[:14]))
    assert row.split()[-4:] == ["-", "-", "-", "-"]  # llama pp/tg and both ratios are missing


def test_an_unavailable_kernel_is_refused(tmp_path, smollm2_path, monkeypatch):
    monkeypatch.setattr(bench_engine, "kernel_path", lambda: "avx2")
    monkeypatch.setenv("RQLLM_KERNEL", "")  # restored after the test: main() sets it
    result = CliRunner().invoke(bench_engine.main, ["--kernel", "avx512", "--model", "x", "--no-peer"])
    assert result.exit_code == 2 and "RQLLM_KERNEL=avx512" in result.output


def test_fresh_pages_reload_ours_and_drop_each_engines_files_before_its_runs(tmp_path, smollm2_path, monkeypatch):
    model = shapes.SHAPES["8b-shape"].generate(tmp_path / "tiny.gguf", tiny=True, tokenizer_src=smollm2_path)
    llama = _fake(tmp_path / "llama-bench", tmp_path / "llama.log", 100.0, 10.0, 0, 0)
    dropped, loads = [], []
    real_read, real_load = bench_engine.read_afresh, bench_engine.Model.load
    monkeypatch.setattr(bench_engine, "read_afresh", lambda p: (dropped.append(Path(p)), real_read(p)))
    monkeypatch.setattr(bench_engine.Model, "load", lambda *a, **k: (loads.append(a[0]), real_load(*a, **k))[1])
    args = ["--model", str(model), "--threads", "1", "--reps", "3", "--prefill", "16", "--decode", "2",
            "--llama-bench", str(llama)]
    result = CliRunner().invoke(bench_engine.main, args)
    assert result.exit_code == 0, result.output
    assert "read afresh before every run" in result.output
    assert len(loads) == 4   # ours loaded once to learn its files, then again for each rep
    # before each of ours' reps: its files (the GGUF and, when repacked, its cache); before each
    # llama-bench run: the GGUF
    assert dropped.count(Path(model)) == 3 + 3
    dropped.clear(), loads.clear()
    result = CliRunner().invoke(bench_engine.main, args + ["--keep-pages"])
    assert result.exit_code == 0, result.output
    assert dropped == [] and len(loads) == 1 and "kept in the page cache" in result.output


def test_read_afresh_leaves_the_file_as_it_was(tmp_path):
    f = tmp_path / "w.bin"
    data = bytes(range(256)) * 40000   # more than one read buffer
    f.write_bytes(data)
    bench_engine.read_afresh(f)   # page-cache advice and a read: the file is unchanged
    assert f.read_bytes() == data


def test_ours_decodes_from_an_empty_context_as_llama_bench_does():
    """llama-bench's generation test clears the cache and decodes from position 0; ours must too, or it
    would be timed over the prompt's positions of attention as well. The positions ours is asked for are
    recorded (a stand-in with the Model's forward signature: what is checked is the benchmark's protocol,
    not the engine)."""
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def forward(self, tokens: list[int], pos: int):
            self.calls.append((len(tokens), pos))
            return [0.0, 1.0, 0.0]

    model = Recorder()
    pp, tg = bench_engine.bench_ours(model, list(range(7)), 4)
    assert model.calls == [(7, 0), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert pp > 0 and tg > 0
