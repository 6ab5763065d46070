"""What a new user reads first: `--help` of `models` and `worker` names every model the
registry knows and the default one, and the README's first `generate` example, run as written, answers
its question with the model it names (before: SmolLM2, whose answer looped through a list in French)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engine.defaults import DEFAULT_MODEL
from engine.registry import KNOWN_MODELS
from tests.model_available import needs_model

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "PYTHONPATH": str(ROOT)}
    return subprocess.run(CLI + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [["models", "--help"], ["worker", "--help"]], ids=lambda c: c[0])
def test_help_names_every_known_model_and_the_default(command):
    p = _run(*command)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())  # click wraps long lines
    missing = [name for name in KNOWN_MODELS if name not in text]
    assert missing == [], f"`rqllm {' '.join(command)}` does not name {missing}"
    assert f"default model, for jobs and commands that name none: {DEFAULT_MODEL}" in text or \
        f"default for jobs that name none: {DEFAULT_MODEL}" in text


def _readme_generate_example() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Generate directly", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    first = next(line for line in block.splitlines() if line.startswith("rqllm generate "))
    return shlex.split(first.split("#", 1)[0])[1:]  # without `rqllm` and the comment


def test_the_readme_generate_example_uses_the_default_model():
    assert _readme_generate_example()[1] == DEFAULT_MODEL


@needs_model(DEFAULT_MODEL)
def test_the_readme_generate_example_answers_its_question():
    args = _readme_generate_example()
    assert "France" in args[2]
    p = _run(*args, timeout=300)
    assert p.returncode == 0, p.stderr
    answer = p.stdout.strip()
    assert "Paris" in answer, answer
    assert "finish: stop" in p.stderr  # it ends by itself, not at --max-tokens
    words = re.findall(r"\w+", answer.lower())
    assert len(words) < 40 and max(words.count(w) for w in set(words)) <= 3, answer  # no loop
