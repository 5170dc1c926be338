"""Issue 39, defect 1: idle connections locked everyone out.

600 TCP connections that sent nothing, or only part of their request headers, made every
request a 503 (/health and /metrics included: uvicorn's limit_concurrency counted them), and
none was ever closed. A real `specrt serve` subprocess (the connection guards live in the
uvicorn protocol it runs with), loopback only, every wait bounded.
"""
from __future__ import annotations

import selectors
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from _env import CHILD_CWD, child_env  # noqa: E402  (tests/ on sys.path)
from _server_utils import free_port  # noqa: E402

HEADER_TIMEOUT = 2.0
MAX_CONNECTIONS = 100              # open connections: at most 164; per client: 64 (the defaults' rule)
PER_CLIENT = 64
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile_conn")
    port = free_port()
    log = open(tmp / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", "--target-model", "builtin", "--no-warmup",
                             "--port", str(port), "--threads", "1", "--max-connections", str(MAX_CONNECTIONS),
                             "--header-timeout", str(HEADER_TIMEOUT), "--keep-alive-timeout", "1",
                             "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=CHILD_CWD)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield port, url, tmp / "serve.log"
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _connect(port: int, source: str, payload: bytes = b"") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    if payload:
        s.sendall(payload)
    return s


def _wait_closed(socks: list[socket.socket], timeout: float) -> tuple[dict, list]:
    """Read every socket until the server closes it or `timeout` passes: ({sock: bytes}, still open)."""
    sel = selectors.DefaultSelector()
    got = {}
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    open_ = set(socks)
    deadline = time.time() + timeout
    while open_ and time.time() < deadline:
        for key, _ in sel.select(timeout=max(0.0, min(0.2, deadline - time.time()))):
            s = key.fileobj
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, BlockingIOError) as e:
                chunk = b"" if isinstance(e, ConnectionResetError) else None
            if chunk is None:
                continue
            got[s] += chunk
            if not chunk:
                sel.unregister(s)
                open_.discard(s)
    sel.close()
    return got, list(open_)


def _closing(socks):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def test_500_idle_connections_do_not_lock_out_health_metrics_or_completions(server):
    port, url, _ = server
    socks = []
    try:
        # 10 clients x 40 (global cap) + one client x 100 (its own cap); half send a partial request head
        for i in range(500):
            source = f"127.0.0.{10 + i % 10}" if i < 400 else "127.0.0.30"
            socks.append(_connect(port, source, PARTIAL_HEAD if i % 2 else b""))
        time.sleep(0.5)                     # the server has accepted them all
        with httpx.Client(base_url=url, timeout=5) as client:
            t0 = time.time()
            r = client.get("/health")
            assert r.status_code == 200, r.text
            assert client.get("/metrics").status_code == 200
            r = client.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
            assert time.time() - t0 < 5.0
    finally:
        _closing(socks)


def test_idle_and_partial_header_connections_are_closed_after_the_header_timeout(server):
    port, url, _ = server
    silent = [_connect(port, "127.0.0.40") for _ in range(10)]
    partial = [_connect(port, "127.0.0.41", PARTIAL_HEAD) for _ in range(10)]
    dribble = _connect(port, "127.0.0.42", b"G")
    try:
        t0 = time.time()
        for ch in b"ET /health HTTP/1.1\r\n":      # one byte at a time: still one header timeout in all
            dribble.sendall(bytes([ch]))
            time.sleep(0.05)
        got, still_open = _wait_closed(silent + partial + [dribble], HEADER_TIMEOUT + 3.0)
        elapsed = time.time() - t0
        assert not still_open, f"{len(still_open)} of 21 connections still open after {elapsed:.1f} s"
        assert elapsed < HEADER_TIMEOUT + 3.0
        for s in partial + [dribble]:
            assert got[s].startswith(b"HTTP/1.1 408"), got[s][:200]
        for s in silent:
            assert got[s] == b"", got[s][:200]
        # a keep-alive connection that starts a second request head and stalls is closed too
        ka = _connect(port, "127.0.0.43", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        ka.sendall(b"GET /health HTTP/1.1\r\n")
        got, still_open = _wait_closed([ka], HEADER_TIMEOUT + 3.0)
        assert not still_open and got[ka].startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got[ka], got[ka][-300:]
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/health").status_code == 200
    finally:
        _closing(silent + partial + [dribble])


def test_a_client_over_its_connection_limit_is_refused_others_are_served(server):
    port, url, _ = server
    busy = []
    try:
        # requests whose bodies are still coming: busy, not idle, so none can be closed to make room
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{")
        busy = [_connect(port, "127.0.0.50", head) for _ in range(PER_CLIENT)]
        time.sleep(0.5)
        extra = _connect(port, "127.0.0.50")
        got, still_open = _wait_closed([extra], 5.0)
        assert not still_open and got[extra].startswith(b"HTTP/1.1 503"), got[extra][:300]
        assert b"too_many_connections" in got[extra]
        with httpx.Client(base_url=url, timeout=5, transport=httpx.HTTPTransport(local_address="127.0.0.51")) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        _closing(busy)
