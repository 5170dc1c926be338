"""Property-based fuzzing of the HTTP schema (issue 14): random JSON bodies -- random fields,
types, huge numbers, NaN/Infinity, unicode with lone surrogates, nesting -- against
/v1/completions and /v1/chat/completions on a loopback server with the tiny pair.

Properties: every answer is a 200 (a well-formed completion or a stream ending in [DONE]) or
a 4xx in the OpenAI error shape -- never a 5xx, a crash or a hang; and afterwards a normal
request returns the same tokens as before, nothing is in flight and every KV block is free.
Derandomized (the same examples on every run) and bounded (a context of 48 tokens).
"""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

from _engine_utils import make_pair  # noqa: E402
from _server_utils import serve_pair  # noqa: E402

FUZZ = settings(max_examples=160, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
REFERENCE = {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0.7, "seed": 3, "ignore_eos": True,
             "specrt": {"return_token_ids": True}}
FIELDS = ["model", "prompt", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
          "min_tokens", "ignore_eos", "seed", "stop", "n", "stream", "stream_options", "specrt", "logprobs",
          "presence_penalty", "best_of", "logit_bias", "response_format", "user", "echo", "suffix", "tools"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = serve_pair(make_pair(tmp_path_factory.mktemp("fuzz_pair")), 3, spec=dict(max_model_len=48), warmup=False,
                   max_body_bytes=256 * 1024)
    s.client.timeout = httpx.Timeout(30.0)
    before = _reference_ids(s)
    yield s
    # afterwards: the same tokens, nothing left in flight, every KV block free, no failed step
    assert _reference_ids(s) == before
    s.wait_idle()
    assert s.state.engine.num_free_blocks() == s.state.num_kv_blocks
    assert s.state.runner.failures == 0
    s.close()


def _reference_ids(srv) -> list[int]:
    r = srv.client.post("/v1/completions", json=REFERENCE)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


# ----------------------------------------------------------------------------- strategies
_text = st.text(st.characters(codec=None, categories=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["\ud800", "w5 \udfff w6", "\ud83d\ude00", "w7 \u00e9 \u4e2d", "\x00", "\u2028"])   # lone surrogates too
_words = st.lists(st.integers(3, 95).map(lambda i: f"w{i}"), min_size=1, max_size=6).map(" ".join)
_edge_ints = st.sampled_from([0, 1, -1, 2, 16, 2 ** 31 - 1, 2 ** 31, -(2 ** 31), 2 ** 63 - 1, 2 ** 63, -(2 ** 63) - 1,
                              2 ** 64, 10 ** 20, 10 ** 400, -(10 ** 400)])
_edge_floats = st.sampled_from([0.0, -0.0, 1e-45, 1e-40, 1e-8, 0.5, 1.0, 1.5, 2.0, 100.0, 100.5, 1e300, -1e300,
                                math.inf, -math.inf, math.nan, 1e-320])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), _edge_ints, st.floats(), _edge_floats, _text, _words)
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(_text | st.sampled_from(FIELDS), inner,
                                                                        max_size=4)), max_leaves=12)
_token_ids = st.lists(st.one_of(st.integers(0, 100), _edge_ints, st.booleans(), st.floats()), max_size=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]) | _json},
                                 optional={"content": _words | _text | st.lists(
                                     st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                            "text": _words | _json}), max_size=3) | _json,
                                     "name": _text | _json})
_VALUE = {
    "model": st.sampled_from(["tiny", "other"]) | _json,
    "prompt": _words | _text | _token_ids | st.lists(_words, max_size=2) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "temperature": _edge_floats | st.floats(0, 3) | _json,
    "top_p": _edge_floats | st.floats(0, 1) | _json,
    "top_k": _edge_ints | st.integers(-2, 200) | _json,
    "max_tokens": st.integers(-1, 8) | _edge_ints | _json,
    "max_completion_tokens": st.integers(-1, 8) | _edge_ints | _json,
    "min_tokens": st.integers(-1, 8) | _edge_ints | _json,
    "seed": _edge_ints | st.integers() | _json,
    "stop": _words | st.lists(_text | _words, max_size=18) | _json,
    "ignore_eos": st.booleans() | _json,
    "n": st.integers(0, 3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json}) | _json,
    "specrt": st.fixed_dictionaries({}, optional={"tag": st.sampled_from(["a", "b.c", "bad tag"]) | _json,
                                                  "return_token_ids": st.booleans() | _json}) | _json,
}


_VALID = {
    "model": st.just("tiny"), "prompt": _words | _text | st.lists(st.integers(0, 95), min_size=1, max_size=8),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": _words | _text}), min_size=1, max_size=3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 100) | _edge_ints,
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 1),
    "seed": st.integers(-(2 ** 63), 2 ** 63 - 1), "stop": _words | st.lists(_words | _text, max_size=3),
    "ignore_eos": st.booleans(), "n": st.just(1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "specrt": st.fixed_dictionaries({}, optional={"tag": st.sampled_from(["a", "b.c"]),
                                                  "return_token_ids": st.booleans()}),
}


def _valid_body(required: str):
    """A body of valid-looking values (some still out of range): these reach the engine."""
    other = "messages" if required == "prompt" else "prompt"
    optional = {k: v for k, v in _VALID.items() if k not in (required, other)}
    return st.fixed_dictionaries({required: _VALID[required]}, optional=optional)


def _body(required: str):
    """A mostly well-formed body: the required field and a random subset of the others, each
    either of its own type or anything at all; sometimes an unknown field."""
    optional = {k: v for k, v in _VALUE.items() if k != required} | {"frobnicate": _json, "logprobs": _json,
                                                                      "presence_penalty": _json}
    return st.fixed_dictionaries({required: _VALUE[required]}, optional=optional)


# ----------------------------------------------------------------------------- the properties
def _check_answer(srv, path: str, content: bytes) -> None:
    headers = {"content-type": "application/json"}
    with srv.client.stream("POST", path, content=content, headers=headers) as r:
        status = r.status_code
        if status == 200 and r.headers["content-type"].startswith("text/event-stream"):
            events = [line for line in r.iter_lines() if line]
            assert events and events[-1] == "data: [DONE]", events[-3:]
            for line in events[:-1]:
                payload = json.loads(line[len("data: "):])
                assert "choices" in payload and "error" not in payload, payload
            return
        body = json.loads(r.read())
    assert status < 500, (status, body, content[:300])
    if status == 200:
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 0
        assert ("text" in choice) != ("message" in choice)
    else:
        assert 400 <= status < 500 and set(body) == {"error"}, (status, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


_long_number = st.tuples(st.sampled_from(["max_tokens", "top_k", "seed", "temperature"]), st.integers(4000, 6000)).map(
    lambda f: ('{"prompt": "w5", "%s": %s}' % (f[0], "7" * f[1])).encode())     # past Python's int-parsing limit


def _dump(body) -> bytes:
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@FUZZ
@given(body=_valid_body("prompt") | _body("prompt") | _json)
@example(body={"prompt": "w5", "top_k": 2 ** 31, "temperature": 1.0, "max_tokens": 2})      # the cases
@example(body={"prompt": "w5 \ud800", "max_tokens": 2})
def test_fuzz_completions(srv, body):
    _check_answer(srv, "/v1/completions", _dump(body))


@FUZZ
@given(body=_valid_body("messages") | _body("messages") | _json)
@example(body={"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2})
def test_fuzz_chat_completions(srv, body):
    _check_answer(srv, "/v1/chat/completions", _dump(body))


@settings(FUZZ, max_examples=60)
@given(raw=st.binary(max_size=64) | _json.map(_dump).map(lambda b: b[: len(b) // 2]) | _long_number,
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_raw_bytes(srv, raw, path):
    _check_answer(srv, path, raw)
