"""deploy/kubernetes/, checked without a cluster (none runs here).

The Kubernetes objects are validated against the API's own JSON schemas, strict (unknown fields refused),
by kubernetes-validate, which ships them (offline), for the oldest and newest versions it knows. KEDA's
objects are custom resources it has no schema for: their fields are checked here against what the
workers actually use (queue names, the secret, the Deployment). And what can drift silently: the worker
command is a real `rqllm worker` command line, its probes test the file the worker's --ready-file option
reads from the environment, the grace period outlasts a job's timeout, the CPU limit gives as many engine
threads as CPUs, and model + KV cache fit the memory limit.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate is in the test extras: pip install -e '.[test]'")
from kubernetes_validate.utils import SchemaNotFoundError, all_versions, latest_version  # noqa: E402

from jobs.defaults import PRIORITIES
from jobs.schemas import queue_name  # noqa: E402
from tests.test_compose import check_rqllm_argv  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
README = ROOT / "README.md"


def documents() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    # every manifest in the folder is in the kustomization
    assert {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} == set(kustomization["resources"])
    return docs


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


def expand(value: str, env: dict[str, dict]) -> str:
    """Kubernetes's $(VAR) expansion in commands and env values (plain values only)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)].get("value", f"<{m.group(1)}>"), value)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return documents()


@pytest.fixture(scope="module")
def worker(docs) -> dict:
    return one(docs, "Deployment", "rqllm-worker")


@pytest.fixture(scope="module")
def container(worker) -> dict:
    containers = worker["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("version", sorted({min(all_versions()), latest_version()}))
def test_kubernetes_objects_validate_against_the_api_schemas(docs, version):
    validated = 0
    for d in docs:
        if d["apiVersion"].startswith("keda.sh/"):
            with pytest.raises(SchemaNotFoundError):  # a custom resource: checked in the tests below
                kubernetes_validate.validate(d, version, strict=True)
            continue
        kubernetes_validate.validate(d, version, strict=True)  # raises ValidationError naming the field
        validated += 1
    assert validated >= 3  # Redis Service and StatefulSet, the worker Deployment


def test_worker_command_and_readiness(container, worker):
    from pipeline.cli_worker import worker_command

    env = container_env(container)
    argv = [expand(a, env) for a in container["command"] + container.get("args", [])]
    assert argv[:2] == ["rqllm", "worker"]
    ctx = check_rqllm_argv(argv)
    assert ctx.params["model"] == env["RQLLM_MODEL"]["value"]
    # the probes test the file the worker writes when ready: the one its --ready-file option reads from env
    option = next(p for p in worker_command.params if p.name == "ready_file")
    ready_file = env[option.envvar]["value"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"] == ["test", "-f", ready_file], probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a first start repacks the weights"
    # the metrics port: the option's environment variables, the container port, the scrape annotation
    port_option = next(p for p in worker_command.params if p.name == "metrics_port")
    addr_option = next(p for p in worker_command.params if p.name == "metrics_addr")
    port = int(env[port_option.envvar]["value"])
    assert env[addr_option.envvar]["value"] == "0.0.0.0"  # reachable from Prometheus, not only the pod
    assert {"name": "metrics", "containerPort": port} in container["ports"]
    assert worker["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)


def test_the_model_is_pulled_where_the_worker_reads_it(worker, container):
    pod = worker["spec"]["template"]["spec"]
    init = next(c for c in pod["initContainers"] if c["name"] == "models")
    env = container_env(init)
    argv = [expand(a, env) for a in init["command"]]
    assert argv[:3] == ["rqllm", "models", "pull"] and argv[3] == container_env(container)["RQLLM_MODEL"]["value"]
    check_rqllm_argv(argv)
    cache = env["RQLLM_CACHE"]["value"]
    assert container_env(container)["RQLLM_CACHE"]["value"] == cache
    mounts = {m["name"] for m in init["volumeMounts"] if m["mountPath"] == cache}
    assert mounts and mounts == {m["name"] for m in container["volumeMounts"] if m["mountPath"] == cache}


def test_grace_period_outlasts_a_job(worker):
    from jobs.defaults import JOB_TIMEOUT

    # SIGTERM: the worker finishes its job, then exits; Kubernetes kills it after the grace period
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= JOB_TIMEOUT


def test_cpu_limit_and_engine_threads_agree(container, tmp_path):
    """Requests equal limits (whole CPUs), no thread override, and the engine's own choice inside that
    cgroup (engine.cpus reading cpu.max as Kubernetes writes it, on a 64-core node) is that many threads."""
    from engine.cpus import choose_threads, usable_cpus

    resources = container["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
    cpus = float(resources["limits"]["cpu"].removesuffix("m")) / (1000 if resources["limits"]["cpu"].endswith("m") else 1)
    assert cpus == int(cpus) >= 1, "whole CPUs: a fraction leaves a thread waiting out the quota"
    env = {k: v.get("value", "") for k, v in container_env(container).items()}
    assert "--threads" not in container["command"] and not env.get("RQLLM_THREADS")
    (tmp_path / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000\n")
    (tmp_path / "cgroup").write_text("0::/\n")
    detected = usable_cpus(affinity=lambda: range(64), proc_cgroup=tmp_path / "cgroup", cgroup_root=tmp_path)
    assert choose_threads(environ=env, cpus=detected).threads == int(cpus)


def test_model_and_kv_cache_fit_the_memory_limit(container):
    from engine.registry import resolve
    from pipeline.memory_guard import plan

    env = {k: v.get("value", "") for k, v in container_env(container).items()}
    try:
        resolve(env["RQLLM_MODEL"], auto_pull=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"model {env['RQLLM_MODEL']} not cached here: {e}")
    limit = container["resources"]["limits"]["memory"]
    units = {"Mi": 2**20, "Gi": 2**30}
    limit_bytes = int(limit[:-2]) * units[limit[-2:]]
    needed = plan(env["RQLLM_MODEL"], env["RQLLM_KV_BUDGET"], None).needed_bytes
    assert needed < limit_bytes, f"{needed / 2**20:.0f} MiB needed, limit {limit}"


def test_redis_url_and_secret(docs, container):
    service = one(docs, "Service", "redis")
    redis = one(docs, "StatefulSet", "redis")
    env = container_env(container)
    url = expand(env["REDIS_URL"]["value"], {**env, "REDIS_PASSWORD": {"value": "PW"}})
    port = service["spec"]["ports"][0]["port"]
    assert url == f"redis://:PW@{service['metadata']['name']}:{port}/0"
    secret = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    redis_env = container_env(redis["spec"]["template"]["spec"]["containers"][0])
    assert redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret
    assert "--requirepass" in " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])


def test_keda_scales_the_worker_on_its_model_queues(docs, worker, container):
    scaled = one(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] >= 1  # serve refuses models no live worker holds
    assert scaled["spec"]["maxReplicaCount"] > scaled["spec"]["minReplicaCount"]
    model = container_env(container)["RQLLM_MODEL"]["value"]
    triggers = scaled["spec"]["triggers"]
    # rq keeps a queue named N in the Redis list rq:queue:N
    assert [t["metadata"]["listName"] for t in triggers] == ["rq:queue:" + queue_name(model, p) for p in PRIORITIES]
    service = one(docs, "Service", "redis")
    secret = container_env(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    for t in triggers:
        assert t["type"] == "redis"
        assert t["metadata"]["address"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
        assert int(t["metadata"]["listLength"]) >= 1
        auth = one(docs, "TriggerAuthentication", t["authenticationRef"]["name"])
        assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", **secret}]


def test_readme_says_what_was_and_was_not_run():
    readme = README.read_text()
    start = readme.index("## Kubernetes")
    end = readme.find("\n## ", start + 3)
    section = readme[start:end if end > 0 else None]
    assert "kubernetes-validate" in section and "deploy/kubernetes" in section
    assert "not been run" in section or "has not run" in section
