"""The OpenAI-compatible server, end to end over loopback HTTP with the tiny pair.

The app runs in-process under uvicorn on a free 127.0.0.1 port (a background thread), so
streaming, client disconnects and cancellations go through a real socket.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from _engine_utils import make_pair  # noqa: E402
from _server_utils import LiveServer, serve_pair, sse as _sse, stream_token_ids  # noqa: E402

from specrt.config import SamplingParams, SpecConfig  # noqa: E402
from specrt import LLM  # noqa: E402
from specrt.server import build_parser, create_app, main  # noqa: E402

K = 4
MAX_BATCH = 16
MAX_BODY = 64 * 1024
PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16", "w40", "w90 w3 w3 w3 w9",
           " ".join(f"w{3 + i % 90}" for i in range(40)), "w20 w21", "w60 w61 w62 w63", "w33 w44 w55 w66 w77"]
REF_TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("server_pair"))


@pytest.fixture(scope="module")
def srv(pair):
    s = serve_pair(pair, K, MAX_BATCH, max_body_bytes=MAX_BODY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(pair):
    """Greedy single-request outputs (token ids) of every prompt, from a separate engine."""
    tdir, ddir = pair
    llm = LLM(target=str(tdir), draft=str(ddir), device="cpu", spec=SpecConfig(max_draft_length=K, max_batch_size=1))
    params = SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, ignore_eos=True)
    return {p: llm.generate([p], params)[0].token_ids for p in PROMPTS}


def _completion(srv, **body):
    r = srv.client.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


# ----------------------------------------------------------------------------- basic endpoints
def test_completion_usage_and_spec_stats(srv, reference):
    prompt = PROMPTS[1]
    out = _completion(srv, prompt=prompt, max_tokens=REF_TOKENS, temperature=0, ignore_eos=True,
                      specrt={"return_token_ids": True})
    assert out["object"] == "text_completion" and out["model"] == "tiny" and out["id"].startswith("cmpl-")
    choice = out["choices"][0]
    assert choice["token_ids"] == reference[prompt]
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": REF_TOKENS, "total_tokens": 7 + REF_TOKENS}
    st = out["specrt"]
    assert st["speculative"] is True and st["draft"] == "model+suffix" and st["tag"] == "default"
    assert st["emitted_tokens"] == REF_TOKENS and st["steps"] >= 1
    assert st["drafted_tokens"] >= st["accepted_tokens"] >= 0
    assert 0.0 <= st["draft_hit_rate"] <= 1.0 and st["tokens_per_target_forward"] >= 1.0
    # token-id prompts give the same output as the text prompt
    ids = srv.state.engine.tokenizer.encode(prompt)
    out2 = _completion(srv, prompt=ids, max_tokens=REF_TOKENS, temperature=0, ignore_eos=True,
                       specrt={"return_token_ids": True})
    assert out2["choices"][0]["token_ids"] == reference[prompt]
    assert out2["choices"][0]["text"] == choice["text"]


def test_streaming_equals_non_streaming(srv, reference):
    for prompt in PROMPTS[:3]:
        body = {"prompt": prompt, "max_tokens": REF_TOKENS, "temperature": 0, "ignore_eos": True,
                "specrt": {"return_token_ids": True}}
        full = _completion(srv, **body)
        with srv.client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse(r.iter_lines())
        usage = events[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == REF_TOKENS
        chunks = events[:-1]
        text = "".join(e["choices"][0]["text"] for e in chunks)
        ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
        assert text == full["choices"][0]["text"]
        assert ids == reference[prompt] == full["choices"][0]["token_ids"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
        assert chunks[-1]["specrt"]["emitted_tokens"] == REF_TOKENS


def test_chat_streaming_and_stop(srv):
    msgs = [{"role": "system", "content": "w3"}, {"role": "user", "content": [{"type": "text", "text": "w5 w6"}]}]
    r = srv.client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True})
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["object"] == "chat.completion"
    content = full["choices"][0]["message"]["content"]
    assert full["choices"][0]["message"]["role"] == "assistant" and content
    assert full["usage"]["prompt_tokens"] == 3       # the template "w3 w5 w6 " -> 3 tokens
    with srv.client.stream("POST", "/v1/chat/completions",
                           json={"messages": msgs, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                 "stream": True}) as r:
        events = _sse(r.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == content
    # a stop string cut mid-stream: the streamed text equals the non-streamed text (held back, never retracted)
    words = content.split()
    stop = " ".join(words[2:4])
    body = {"messages": msgs, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    cut = srv.client.post("/v1/chat/completions", json=body).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == content[:content.index(stop)]
    with srv.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = _sse(r.iter_lines())
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == content[:content.index(stop)]


def test_openai_client(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    c = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=0, seed=3,
                                  extra_body={"specrt": {"tag": "oa"}, "ignore_eos": True})
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    assert c.model_extra["specrt"]["tag"] == "oa"
    msgs = [{"role": "user", "content": "w9 w8 w7"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="w5", max_tokens=4, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="w5", max_tokens=4)


def test_models_health_metrics(srv):
    m = srv.client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny"
    assert m["data"][0]["specrt"]["speculative"] is True and m["data"][0]["max_model_len"] == 512
    h = srv.client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    _completion(srv, prompt="w7 w8", max_tokens=6, specrt={"tag": "alpha"})
    r = srv.client.post("/v1/completions", json={"prompt": "w7 w8", "max_tokens": 6},
                        headers={"X-Specrt-Tag": "beta"})
    assert r.status_code == 200 and r.json()["specrt"]["tag"] == "beta"
    r = srv.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    for needle in ('specrt_spec_steps_total{tag="alpha",length_bucket="0-256"}',
                   'specrt_draft_tokens_total{tag="beta",length_bucket="0-256"}', "specrt_kv_blocks_free ",
                   'specrt_http_requests_total{path="/v1/completions",status="200"}'):
        assert needle in text, needle
    # every sample line parses as `name{labels} value`
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert name.startswith("specrt_")
    bad = srv.client.post("/v1/completions", json={"prompt": "w5", "specrt": {"tag": "no spaces!"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "specrt.tag"


def test_plain_autoregressive_server_matches(pair, srv, reference):
    """Without a draft the server decodes autoregressively; greedy outputs equal the speculative ones."""
    tdir, _ = pair
    app = create_app(target=str(tdir), draft=None, device="cpu", warmup=False,
                     spec=SpecConfig(max_batch_size=4))
    plain = LiveServer(app)
    try:
        for prompt in PROMPTS[:2]:
            r = plain.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": REF_TOKENS, "temperature": 0,
                                                           "ignore_eos": True, "specrt": {"return_token_ids": True}})
            out = r.json()
            assert out["choices"][0]["token_ids"] == reference[prompt]
            assert out["specrt"]["speculative"] is False and out["specrt"]["drafted_tokens"] == 0
    finally:
        plain.close()


# ----------------------------------------------------------------------------- bad input
def test_bad_requests_get_clear_errors_and_server_keeps_serving(srv):
    long_ids = [5] * 600
    cases = [
        (b"{not json", 400, "malformed JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "JSON object"),
        (b"\xff\xfe{}", 400, "UTF-8"),
        (b"[" * 100000 + b"]" * 100000, 413, "exceeds"),
        (json.dumps({"prompt": "w5", "max_tokens": "10"}).encode(), 400, "'max_tokens' must be an integer"),
        (json.dumps({"prompt": "w5", "temperature": True}).encode(), 400, "'temperature' must be a number"),
        (json.dumps({"prompt": "w5", "stream": "yes"}).encode(), 400, "'stream' must be a boolean"),
        (json.dumps({"prompt": 12}).encode(), 400, "'prompt' must be"),
        (json.dumps({"prompt": ["w5", "w6"]}).encode(), 400, "one prompt"),
        (json.dumps({"prompt": [5, 1000]}).encode(), 400, "out of range"),
        (json.dumps({"max_tokens": 3}).encode(), 400, "'prompt' is required"),
        (json.dumps({"prompt": "w5", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "w5", "top_k": -3}).encode(), 400, "top_k"),
        (json.dumps({"prompt": "w5", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "w5", "max_tokens": 4, "min_tokens": 9}).encode(), 400, "min_tokens"),
        (json.dumps({"prompt": "w5", "stop": [3]}).encode(), 400, "stop"),
        (json.dumps({"prompt": "w5", "seed": 2 ** 70}).encode(), 400, "seed"),
        (json.dumps({"prompt": "w5", "n": 2}).encode(), 400, "'n' must be 1"),
        (json.dumps({"prompt": "w5", "best_of": 3}).encode(), 400, "not supported"),
        (json.dumps({"prompt": "w5", "suffix": "w9"}).encode(), 400, "'suffix' is not supported"),
        (json.dumps({"prompt": "w5", "presence_penalty": 2.5}).encode(), 400, "'presence_penalty' must be a number"),
        (json.dumps({"prompt": "w5", "frobnicate": 1}).encode(), 400, "unknown field 'frobnicate'"),
        (json.dumps({"prompt": "w5", "specrt": {"tag": 5}}).encode(), 400, "tag"),
        (json.dumps({"prompt": long_ids}).encode(), 400, "context"),
        (json.dumps({"prompt": " ".join(["w9"] * 600)}).encode(), 400, "context"),
    ]
    for body, status, needle in cases:
        r = srv.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert needle in err["message"], (needle, err)
        assert set(err) == {"message", "type", "param", "code"}
    # chat-specific
    for body, needle in [({"messages": "hi"}, "'messages' must be"), ({"messages": []}, "'messages' must be"),
                         ({"messages": [{"role": "wizard", "content": "w5"}]}, "role"),
                         ({"messages": [{"role": "user", "content": 5}]}, "content"),
                         ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text")]:
        r = srv.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    # oversized body, streamed without a Content-Length (chunked)
    big = json.dumps({"prompt": "w5 " * (MAX_BODY // 2)}).encode()

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = srv.client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # unknown model, unknown route, wrong method: OpenAI-style JSON too
    assert srv.client.post("/v1/completions", json={"model": "nope", "prompt": "w5"}).status_code == 404
    r = srv.client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert srv.client.get("/v1/completions").status_code == 405
    # still serving
    assert srv.client.get("/health").status_code == 200
    assert _completion(srv, prompt="w5 w6", max_tokens=4)["usage"]["completion_tokens"] <= 4
    srv.wait_idle()
    eng = srv.state.engine
    assert eng.num_free_blocks() == eng.kv.manager.num_blocks


# ----------------------------------------------------------------------------- concurrency
def test_64_concurrent_streams_with_disconnects(srv, reference):
    """64 streaming requests at once; ~1/3 are dropped (socket closed mid-stream, task cancelled,
    or cancelled before the first byte). Every other request gets exactly its greedy
    single-request output, the server stays up and afterwards every KV block is free."""
    rng = random.Random(1234)
    plans = []
    for i in range(64):
        prompt = PROMPTS[i % len(PROMPTS)]
        max_tokens = rng.randint(6, REF_TOKENS)
        action = rng.choice(["complete", "complete", "drop_after", "cancel", "cancel_early"])
        plans.append((i, prompt, max_tokens, action, rng.randint(1, 4), rng.uniform(0.0, 0.3)))
    eng = srv.state.engine
    aborted_before = eng.metrics.snapshot()["finished_requests"].get("abort", 0)

    async def one(client, i, prompt, max_tokens, action, after_chunks):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "specrt": {"return_token_ids": True, "tag": "conc"}}
        got = await stream_token_ids(client, body, after_chunks if action == "drop_after" else None, f"request {i}")
        assert not isinstance(got, tuple), f"request {i} was refused: {got}"
        return got

    async def run_all():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
            tasks = {}
            for i, prompt, max_tokens, action, after, delay in plans:
                tasks[i] = asyncio.ensure_future(one(client, i, prompt, max_tokens, action, after))

            async def canceller(i, delay, early):
                await asyncio.sleep(0.0 if early else delay)
                tasks[i].cancel()

            cancellers = [asyncio.ensure_future(canceller(i, d, a == "cancel_early"))
                          for i, _, _, a, _, d in plans if a in ("cancel", "cancel_early")]
            await asyncio.gather(*cancellers)
            results = await asyncio.gather(*tasks.values(), return_exceptions=True)
            return dict(zip(tasks, results))

    t0 = time.time()
    results = asyncio.run(run_all())
    elapsed = time.time() - t0
    completed = 0
    for i, prompt, max_tokens, action, _, _ in plans:
        res = results[i]
        if action == "complete":
            assert not isinstance(res, BaseException), (i, repr(res))
            assert res == reference[prompt][:max_tokens], (i, prompt, max_tokens)
            completed += 1
        elif isinstance(res, list):       # a cancellation that came too late: still must be correct
            assert res == reference[prompt][:max_tokens]
        elif isinstance(res, BaseException):
            assert isinstance(res, asyncio.CancelledError), (i, repr(res))
    assert completed >= 20
    srv.wait_idle()
    assert eng.num_free_blocks() == eng.kv.manager.num_blocks
    assert eng.metrics.snapshot()["finished_requests"].get("abort", 0) > aborted_before
    assert srv.client.get("/health").status_code == 200
    assert _completion(srv, prompt=PROMPTS[0], max_tokens=5, temperature=0, ignore_eos=True,
                       specrt={"return_token_ids": True})["choices"][0]["token_ids"] == reference[PROMPTS[0]][:5]
    assert elapsed < 90


def test_non_streaming_disconnect_aborts(srv):
    """A non-streaming client that gives up (socket closed) gets its request aborted."""
    eng = srv.state.engine
    aborted = eng.metrics.snapshot()["finished_requests"].get("abort", 0)
    real_step = eng.step

    def slow_step():          # >= 5 ms a step: 480 tokens cannot finish before the client's 0.3 s timeout
        time.sleep(0.005)
        return real_step()

    eng.step = slow_step
    try:
        with pytest.raises(httpx.TimeoutException):
            srv.client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 480, "ignore_eos": True},
                            timeout=0.3)
        srv.wait_idle()
    finally:
        del eng.step
    assert eng.metrics.snapshot()["finished_requests"].get("abort", 0) == aborted + 1
    assert eng.num_free_blocks() == eng.kv.manager.num_blocks


def test_step_loop_runs_on_its_own_thread_and_ignores_stalled_clients(srv):
    """engine.step() only ever runs on the runner's thread; a client that stops reading its
    stream does not hold up another request."""
    eng = srv.state.engine
    real_step, threads = eng.step, set()

    def recording_step():
        threads.add(threading.current_thread().name)
        return real_step()

    eng.step = recording_step
    try:
        stalled = httpx.Client(base_url=srv.url, timeout=60)
        with stalled.stream("POST", "/v1/completions", json={"prompt": "w5", "max_tokens": 480, "ignore_eos": True,
                                                             "stream": True}) as r:
            assert r.status_code == 200            # headers only; the body is never read
            t0 = time.time()
            out = _completion(srv, prompt="w6 w7", max_tokens=8, ignore_eos=True)
            assert out["usage"]["completion_tokens"] == 8 and time.time() - t0 < 30
        stalled.close()
        srv.wait_idle()
    finally:
        del eng.step
    assert threads == {"specrt-engine-step"}
    assert eng.num_free_blocks() == eng.kv.manager.num_blocks


def test_engine_failure_is_contained(pair):
    tdir, ddir = pair
    app = create_app(target=str(tdir), draft=str(ddir), device="cpu", warmup=False, spec=SpecConfig(max_draft_length=2))
    live = LiveServer(app)
    eng = live.state.engine
    real_step, calls = eng.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_step()

    eng.step = flaky_step
    try:
        r = live.client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        r = live.client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        live.wait_idle()
        assert eng.num_free_blocks() == eng.kv.manager.num_blocks
        assert "specrt_engine_step_failures_total 1" in live.client.get("/metrics").text
    finally:
        live.close()


# ----------------------------------------------------------------------------- security, CLI
def test_api_key(pair):
    tdir, _ = pair
    app = create_app(target=str(tdir), device="cpu", warmup=False, api_key="s3cret-key", model_name="tiny")
    live = LiveServer(app)
    try:
        c = live.client
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                        {"Authorization": "Bearer s3cret-key-and-more"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
                r = c.request(method, path, headers=headers, json={"prompt": "w5", "max_tokens": 2})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200
        ok = {"Authorization": "Bearer s3cret-key"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/v1/completions", headers=ok, json={"prompt": "w5", "max_tokens": 2}).status_code == 200
        assert c.get("/v1/models", headers={"X-API-Key": "s3cret-key"}).status_code == 200
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret-key", max_retries=0)
        assert client.completions.create(model="tiny", prompt="w5", max_tokens=2).usage.completion_tokens <= 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        live.close()


def test_cli_binds_loopback_by_default_and_tensor_parallel(pair, monkeypatch, capsys):
    tdir, ddir = pair
    assert build_parser().parse_args(["--target-model", "x"]).host == "127.0.0.1"
    import uvicorn

    seen = {}

    def fake_run(app, **kw):
        seen.update(kw, app=app)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    rc = main(["--target-model", str(tdir), "--draft-model", str(ddir), "--speculative-decoding",
               "--max-draft-length", "3", "--no-warmup", "--port", "0", "--max-batch-size", "4",
               "--draft-policy", "confidence", "--no-adaptive", "--acceptance", "coupled"])
    assert rc == 0 and seen["host"] == "127.0.0.1"
    state = seen["app"].state.specrt
    try:
        spec = state.engine.spec
        assert (spec.max_draft_length, spec.max_batch_size, spec.policy, spec.adaptive_enabled, spec.acceptance) == \
            (3, 4, "confidence", False, "coupled")
        assert state.engine.speculative
    finally:
        state.runner.stop()
    # --tensor-parallel-size 2: the server spawns its worker itself and serves the same greedy tokens
    from fastapi.testclient import TestClient

    body = {"prompt": "w7 w8 w9", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answers = []

    def serve_one(app, **kw):
        r = TestClient(app).post("/v1/completions", json=body)
        answers.append(r.json()["choices"][0]["text"])
        app.state.specrt.runner.stop()

    monkeypatch.setattr(uvicorn, "run", serve_one)
    for tp in ("1", "2"):
        rc = main(["--target-model", str(tdir), "--draft-model", str(ddir), "--speculative-decoding",
                   "--no-warmup", "--port", "0", "--tensor-parallel-size", tp])
        assert rc == 0
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0]
    capsys.readouterr()
    rc = main(["--target-model", str(tdir), "--tensor-parallel-size", "3"])   # 4 heads do not split 3 ways
    assert rc == 2 and "must divide" in capsys.readouterr().err
    rc = main(["--target-model", str(tdir), "--speculative-decoding"])   # no draft for a non-builtin target
    assert rc == 2 and "--draft-model" in capsys.readouterr().err
