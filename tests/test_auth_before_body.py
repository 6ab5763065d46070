"""Authentication before the body, and the per-key limit on requests in flight.

A real `rqllm serve` process (the production command: uvicorn on a loopback port, tests/api_server.py)
on a real Redis, spoken to over raw sockets so that the test decides when each byte of a body is sent:
the headers of a 190 MB upload with a wrong key, then a first kilobyte of its body, then nothing. The
401 must arrive while the rest has not been sent (so the server cannot have read, parsed or spooled it),
on every endpoint that takes a body; with the right key the same request is left waiting for its body.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import pytest
from redis import Redis

from pipeline.api.config import MAX_REQUESTS_IN_FLIGHT_ENV
from tests.api_server import ServeProcess
from tests.redis_server import redis_server  # noqa: F401  (session fixture)

K1, K2 = "body-key-one-0123456789", "body-key-two-0123456789"
WRONG = "not-a-key-of-this-server"
BIG = 190_000_000  # the upload of the issue
IN_FLIGHT = 2
BOUNDARY = "rqllmtestboundary"


@pytest.fixture(scope="module")
def server(redis_server: str, tmp_path_factory) -> Iterator[ServeProcess]:  # noqa: F811
    Redis.from_url(redis_server).flushdb()
    base = tmp_path_factory.mktemp("auth-before-body")
    before = os.environ.get(MAX_REQUESTS_IN_FLIGHT_ENV)
    os.environ[MAX_REQUESTS_IN_FLIGHT_ENV] = str(IN_FLIGHT)  # ServeProcess passes the environment on
    try:
        proc = ServeProcess(base / "data", redis_url=redis_server, keys=[K1, K2],
                            extra=["--max-file-bytes", str(BIG + 1)]).start()
    finally:
        if before is None:
            os.environ.pop(MAX_REQUESTS_IN_FLIGHT_ENV, None)
        else:
            os.environ[MAX_REQUESTS_IN_FLIGHT_ENV] = before
    try:
        proc.wait_ready(K1)
        yield proc
    finally:
        proc.stop()


def start_request(port: int, method: str, path: str, key: str, *, length: int, content_type: str,
                  first: bytes = b"") -> socket.socket:
    """Send a request's headers (declaring `length` bytes of body) and the first bytes of its body."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n").encode()
    s.sendall(head + first)
    return s


def read_response(s: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the response on `s`; socket.timeout when none comes in time."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def multipart_start() -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + b"x" * 1024


UPLOAD = ("POST", "/v1/files", f"multipart/form-data; boundary={BOUNDARY}", multipart_start(), BIG)
JSON_BODIES = [  # bodies under the server's body limit (8 MB): refused for the key, not the size
    ("POST", "/v1/batches", "application/json", b'{"input_file_id": "file-' + b"0" * 1000, 4_000_000),
    ("POST", "/v1/chat/completions", "application/json", b'{"messages": [' + b" " * 1000, 4_000_000)]


@pytest.mark.parametrize("method,path,content_type,first,length", [UPLOAD, *JSON_BODIES],
                         ids=["upload", "batches", "chat"])
def test_a_wrong_key_gets_its_401_before_the_body_is_sent(server: ServeProcess, method, path, content_type, first,
                                                          length):
    s = start_request(server.port, method, path, WRONG, length=length, content_type=content_type, first=first)
    try:
        t0 = time.monotonic()
        try:
            status, headers, body = read_response(s, timeout=15)
        except socket.timeout:
            pytest.fail(f"no answer to a wrong key while the body ({len(first)} of {length:,} bytes sent) waits: "
                        "the server is reading the body before it checks the key")
        assert status == 401, body
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}
        assert headers.get("connection") == "close"
        assert time.monotonic() - t0 < 10
        # and the connection is closed: the rest of the body will never be read
        s.settimeout(10)
        try:
            assert s.recv(65536) == b""
        except ConnectionResetError:
            pass
    finally:
        s.close()


def test_with_the_right_key_the_same_request_waits_for_its_body(server: ServeProcess):
    """The control: what makes the 401 above early is the key, not the request's shape."""
    method, path, content_type, first, length = UPLOAD
    s = start_request(server.port, method, path, K1, length=length, content_type=content_type, first=first)
    try:
        with pytest.raises(socket.timeout):
            read_response(s, timeout=2)
    finally:
        s.close()


def test_no_key_at_all_is_refused_before_the_body_too(server: ServeProcess):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        s.sendall(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: {BIG}\r\n"
                  f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n".encode())
        status, headers, body = read_response(s, timeout=15)
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert "didn't provide an API key" in json.loads(body)["error"]["message"]
    finally:
        s.close()


def get(server: ServeProcess, path: str, key: str) -> tuple[int, dict[str, str], bytes]:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
        return read_response(s, timeout=15)
    finally:
        s.close()


def test_requests_in_flight_are_limited_per_key(server: ServeProcess):
    """Two uploads of K1 wait for their bodies: a third request of K1 gets 429 at once (OpenAI's error
    shape), K2 is served, and K1 is served again once one of its requests has ended."""
    method, path, content_type, first, _ = UPLOAD
    held = [start_request(server.port, method, path, K1, length=10_000, content_type=content_type, first=first)
            for _ in range(IN_FLIGHT)]
    try:
        deadline = time.monotonic() + 15
        while True:  # the server registers both once it has their headers
            status, headers, body = get(server, "/v1/files", K1)
            if status == 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 429, body
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert f"{IN_FLIGHT} requests in flight" in error["message"] and headers.get("retry-after") == "1"
        assert get(server, "/v1/files", K2)[0] == 200  # the other key is not held back
        held.pop().close()  # one upload ends (its client left)
        deadline = time.monotonic() + 15
        while get(server, "/v1/files", K1)[0] != 200:
            assert time.monotonic() < deadline, "the ended request still counts as in flight"
            time.sleep(0.05)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 15
    while get(server, "/v1/files", K1)[0] != 200:  # nothing leaks: the count goes back to zero
        assert time.monotonic() < deadline
        time.sleep(0.05)
