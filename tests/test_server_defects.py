"""Issue 14, server side: each defect the hostile review found, as a test that failed before its fix.

Loopback only (an in-process uvicorn on 127.0.0.1, or a real `specrt serve` subprocess for
SIGTERM); every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from _engine_utils import make_pair  # noqa: E402
from _server_utils import LiveServer, free_port, serve_pair, sse  # noqa: E402
from _env import CHILD_CWD, child_env  # noqa: E402  (tests/ on sys.path)

from specrt.config import SamplingParams  # noqa: E402
from specrt.server import create_app  # noqa: E402

BIG_BODY = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("defects_pair"))


@pytest.fixture(scope="module")
def srv(pair):
    s = serve_pair(pair, 3, warmup=False, max_body_bytes=BIG_BODY)
    yield s
    s.close()


def _post(srv, path="/v1/completions", **body):
    return srv.client.post(path, json=body)


def _error(r, status=400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _ids(srv, **body) -> list[int]:
    r = _post(srv, **body, specrt={"return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


# ----------------------------------------------------------------------------- defect 1 (boundary)
@pytest.mark.parametrize("field,value", [
    ("top_k", 2 ** 31), ("top_k", 10 ** 20), ("top_k", -2), ("seed", 2 ** 63), ("seed", -(2 ** 63) - 1),
    ("max_tokens", 2 ** 31), ("min_tokens", 2 ** 31), ("temperature", 1e300), ("temperature", float("nan")),
    ("temperature", float("inf")), ("top_p", float("nan")), ("top_p", 1.5), ("stop", ["x" * 5000]),
    ("stop", ["a"] * 17), ("ignore_eos", 1)])
def test_sampling_params_reject_values_the_kernels_cannot_hold(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_edges_that_are_valid():
    assert SamplingParams(top_k=2 ** 31 - 1).top_k == 2 ** 31 - 1
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-(2 ** 63)).seed == -(2 ** 63)
    assert SamplingParams(max_tokens=2 ** 31 - 1, min_tokens=2 ** 31 - 1).max_tokens == 2 ** 31 - 1


def test_poisoned_top_k_is_a_400_and_hurts_nobody(srv):
    body = {"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    before = _ids(srv, **body)
    for v in (2 ** 31, 10 ** 20, 2 ** 63, -2):
        err = _error(_post(srv, **body, top_k=v))
        assert err["param"] == "top_k" and "top_k" in err["message"], err
    for field, v in (("seed", 2 ** 64), ("max_tokens", 2 ** 40), ("min_tokens", 2 ** 40), ("temperature", 1e300),
                     ("top_p", 2.0)):
        err = _error(_post(srv, **{**body, field: v}))
        assert err["param"] == field, err
    # top_k at the top of int32 keeps the whole vocabulary: the same tokens as top_k disabled
    assert _ids(srv, **body, top_k=2 ** 31 - 1) == _ids(srv, **body, top_k=0) == before
    assert "specrt_engine_step_failures_total 0" in srv.client.get("/metrics").text


# ----------------------------------------------------------------------------- defect 2
def test_huge_prompts_do_not_stall_health_or_other_streams(srv):
    """Four 2 MB prompts (rejected: far beyond the context) while /health is polled and a normal
    stream runs: both keep answering promptly, and the huge prompts are never tokenized."""
    from specrt.server import prompts as tok_mod

    calls: list[str] = []
    real_encode = tok_mod.encode_text

    def recording_encode(tokenizer, text, add_special_tokens=True):
        calls.append(threading.current_thread().name)
        return real_encode(tokenizer, text, add_special_tokens)

    tok_mod.encode_text = recording_encode
    huge = "w5 w6 w7 " * (2 * 1024 * 1024 // 9)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                async def huge_one(i):
                    if i % 2:
                        return await client.post("/v1/chat/completions",
                                                 json={"messages": [{"role": "user", "content": huge}]})
                    return await client.post("/v1/completions", json={"prompt": huge, "max_tokens": 2})

                async def health_latencies():
                    lat = []
                    for _ in range(30):
                        t0 = time.perf_counter()
                        r = await client.get("/health")
                        assert r.status_code == 200
                        lat.append(time.perf_counter() - t0)
                        await asyncio.sleep(0.02)
                    return lat

                async def stream_gaps():
                    gaps, last = [], time.perf_counter()
                    body = {"prompt": "w9 w8", "max_tokens": 48, "ignore_eos": True, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line:
                                now = time.perf_counter()
                                gaps.append(now - last)
                                last = now
                    return gaps

                stream = asyncio.ensure_future(stream_gaps())
                health = asyncio.ensure_future(health_latencies())
                rejected = await asyncio.gather(*(huge_one(i) for i in range(4)))
                return rejected, await health, await stream

        rejected, lat, gaps = asyncio.run(run())
    finally:
        tok_mod.encode_text = real_encode
    for r in rejected:
        err = _error(r)
        assert err["code"] == "context_length_exceeded" and err["param"] in ("prompt", "messages"), err
    assert max(lat) < 2.0, f"/health took {max(lat):.2f} s while huge prompts were being rejected"
    assert max(gaps) < 2.0, f"a normal stream stalled {max(gaps):.2f} s"
    # the huge prompts were refused by their size, never tokenized; normal prompts are tokenized
    # off the event loop and off the step thread
    assert calls and all(name.startswith("specrt-tokenize") for name in calls), calls
    assert len(calls) <= 2, calls


def test_tokenizing_here_equals_the_engine_tokenizer(srv):
    from specrt.server.prompts import encode_text

    tok = srv.state.engine.tokenizer
    for text in ("w5 w6 w7", "  w3\nw90 w4 ", "w5 unknown w6 é", "w1" * 50):
        assert encode_text(tok, text) == tok.encode(text)
        assert encode_text(tok, text, False) == tok.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- defect 6
def test_lone_surrogates_and_giant_integers_are_400(srv):
    bodies = [
        ('{"prompt": "w5 \\ud800 w6", "max_tokens": 2}', "prompt"),
        ('{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
        ('{"prompt": "w5", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
        ('{"prompt": "w5", "max_tokens": ' + "9" * 5000 + "}", None),
        ('{"prompt": "w5", "top_k": ' + "1" * 5000 + "}", None),
        ('{"prompt": [5, ' + "7" * 5000 + "]}", None),
        ('{"prompt": "w5", "max_tokens": ' + "9" * 4000 + "}", "max_tokens"),
        ('{"prompt": "w5", "temperature": 1e999}', "temperature"),
        ('{"prompt": "w5", "temperature": NaN}', "temperature"),
    ]
    for raw, param in bodies:
        r = srv.client.post("/v1/completions", content=raw.encode(), headers={"content-type": "application/json"})
        err = _error(r)
        if param is not None:
            assert err["param"].split("[")[0] == param, (raw[:60], err)
    chat = '{"messages": [{"role": "user", "content": "w5 \\ud800"}], "max_tokens": 2}'
    r = srv.client.post("/v1/chat/completions", content=chat.encode(), headers={"content-type": "application/json"})
    assert _error(r)["param"].startswith("messages[0]")
    assert _post(srv, prompt="w5 w6", max_tokens=2).status_code == 200


# ----------------------------------------------------------------------------- defect 7
def _raw_request(port: int, path: str, announced: int, sent: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {announced}\r\n\r\n").encode()
    s.sendall(head + sent)
    return s


def _read_until_closed(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
    except (socket.timeout, ConnectionResetError):
        return data + b"<still open>"


def test_stalled_uploads_time_out_with_one_log_line_each(pair, caplog):
    tdir, _ = pair
    app = create_app(target=str(tdir), device="cpu", warmup=False, model_name="tiny", body_timeout_s=1.0)
    live = LiveServer(app)
    try:
        with caplog.at_level(logging.INFO):
            socks = [_raw_request(live.port, "/v1/completions", 1000, b'{"prompt": "w5"') for _ in range(20)]
            quitter = _raw_request(live.port, "/v1/completions", 1000, b'{"prompt":')
            quitter.close()                       # gives up mid-body
            t0 = time.time()
            answers = [_read_until_closed(s, 10.0) for s in socks]
            elapsed = time.time() - t0
            for s in socks:
                s.close()
            assert live.client.get("/health").status_code == 200
            time.sleep(0.3)
        for a in answers:
            assert a.startswith(b"HTTP/1.1 408"), a[:200]
            assert b'"code":"request_timeout"' in a.replace(b" ", b""), a[-300:]
            assert not a.endswith(b"<still open>"), "the connection was left open"
        assert elapsed < 8.0
        records = [r for r in caplog.records if r.name.startswith(("specrt", "uvicorn"))]
        assert not [r for r in records if r.exc_info], "tracebacks were logged"
        timeouts = [r for r in records if "timed out" in r.getMessage()]
        assert len(timeouts) == 20, [r.getMessage() for r in records][:10]
        gone = [r for r in records if "disconnected" in r.getMessage()]
        assert len(gone) == 1, [r.getMessage() for r in records][:10]
        assert live.client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200
    finally:
        live.close()


def test_concurrent_request_cap_answers_503(pair):
    tdir, _ = pair
    app = create_app(target=str(tdir), device="cpu", warmup=False, model_name="tiny", body_timeout_s=3.0,
                     max_connections=4)
    live = LiveServer(app)
    try:
        socks = [_raw_request(live.port, "/v1/completions", 100, b"{") for _ in range(4)]
        deadline = time.time() + 10
        while live.state.active_requests < 4:      # all four are being read
            assert time.time() < deadline
            time.sleep(0.02)
        r = live.client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        err = _error(r, 503)
        assert err["code"] == "server_overloaded" and r.headers.get("retry-after")
        assert live.client.get("/health").status_code == 200     # health is never capped
        for s in socks:
            _read_until_closed(s, 10.0)
            s.close()
        assert live.client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200
    finally:
        live.close()


# ----------------------------------------------------------------------------- defect 8
def _stream_until_end(port: int, body: dict, started: threading.Event, out: list, i: int) -> None:
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                out[i] = ("ok", r.status_code, lines)
    except Exception as e:  # noqa: BLE001 - recorded and asserted on below
        out[i] = ("exc", repr(e), None)


def test_sigterm_drains_streams_with_a_final_event(pair, tmp_path):
    tdir, ddir = pair
    port = free_port()
    env = child_env()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", "--target-model", str(tdir),
                             "--draft-model", str(ddir), "--speculative-decoding", "--port", str(port),
                             "--no-warmup", "--max-batch-size", "1", "--drain-timeout", "0.5", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        n = 16          # at batch 1: however fast the machine, the last ones cannot finish in 0.5 s
        body = {"prompt": "w5 w6", "max_tokens": 500, "ignore_eos": True, "stream": True,
                "specrt": {"return_token_ids": True}}
        results: list = [None] * n
        started = threading.Event()
        threads = [threading.Thread(target=_stream_until_end, args=(port, body, started, results, i))
                   for i in range(n)]
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        t_term = time.time()
        time.sleep(0.2)
        try:       # after SIGTERM nobody new is admitted: the port is closed, or a 503
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "w5"}, timeout=5)
            assert r.status_code == 503, r.text
        except httpx.ConnectError:
            pass
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
        exited_after = time.time() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = (tmp_path / "serve.log").read_text()
    assert rc == 0, text[-3000:]
    assert exited_after < 15, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    finished = failed = 0
    for kind, status, lines in results:
        assert kind == "ok" and status == 200, (kind, status)
        events = sse(lines)            # asserts the final `data: [DONE]`
        last = events[-1]
        if "error" in last:
            assert last["error"]["code"] == "server_shutting_down", last
            failed += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 500
            finished += 1
    assert failed >= 1 and finished + failed == n, (finished, failed)


# ----------------------------------------------------------------------------- defect 10
def test_in_flight_gauge_is_exact_after_a_response(srv):
    srv.wait_idle()
    stale = 0
    for i in range(100):
        body = {"prompt": "w5 w6", "max_tokens": 2, "ignore_eos": True}
        if i % 2:
            with srv.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                sse(r.iter_lines())
        else:
            assert _post(srv, **body).status_code == 200
        stale += srv.client.get("/health").json()["in_flight"] != 0
    assert stale == 0, f"{stale} of 100 /health calls showed a finished request in flight"


def test_serve_without_extras_prints_an_install_hint():
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
            "from specrt.cli import main; sys.exit(main(['serve', '--target-model', 'builtin']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env(),
                       cwd=CHILD_CWD)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert 'pip install "specrt[serve]"' in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_chat_without_a_chat_template_says_so(pair, tmp_path):
    import shutil

    tdir, _ = pair
    plain = tmp_path / "no_template"
    shutil.copytree(tdir, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    live = LiveServer(create_app(target=str(plain), device="cpu", warmup=False, model_name="plain"))
    try:
        r = live.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
        err = _error(r)
        assert "no chat template" in err["message"] and "/v1/completions" in err["message"], err
        assert err["param"] is None and err["code"] == "no_chat_template"
        assert live.client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200
    finally:
        live.close()


# ----------------------------------------------------------------------------- issue 13: the schema
def test_openapi_shows_the_request_schemas(srv):
    doc = srv.client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "SpecrtOptions"} <= set(schemas)
    top_k = schemas["CompletionRequest"]["properties"]["top_k"]["anyOf"][0]
    assert top_k["maximum"] == 2 ** 31 - 1 and top_k["minimum"] == -1
    assert schemas["CompletionRequest"]["additionalProperties"] is False      # unknown fields are refused
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
