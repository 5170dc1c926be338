"""Structured output over the OpenAI-compatible server (issue 36), loopback HTTP.

OpenAI's ``response_format`` ({"type": "json_object"}, {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}) on both endpoints, and vLLM's guided_json / guided_regex /
guided_choice / guided_grammar: the server returns what the Python API returns for the same
SamplingParams(structured=...), streaming too; an invalid schema, regex or grammar, two of them
at once, or one combined with ignore_eos is a 400 naming the field; {"type": "text"} stays free
text. The tiny pair with the byte-level tokenizer of tests/test_structured.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("llguidance")
sys.path.insert(0, str(Path(__file__).parent))

from _server_utils import api_of, post_ok, serve_pair, sse  # noqa: E402
from test_structured import SCHEMA, structured_pair  # noqa: E402

from specrt.config import SamplingParams  # noqa: E402
from specrt.structured import Structured  # noqa: E402

K = 3
PROMPT_IDS = [5, 6, 7, 8, 5, 6]
MSGS = [{"role": "user", "content": "give me json"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir, ddir = structured_pair(tmp_path_factory.mktemp("structured_server_pair"))
    for d in (tdir, ddir):       # a chat template for /v1/chat/completions
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tdir, ddir


@pytest.fixture(scope="module")
def srv(pair):
    s = serve_pair(pair, K, warmup=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(pair):
    return api_of(pair, K)


_post = post_ok


FIELDS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}},
     Structured("json_schema", SCHEMA)),
    ({"response_format": {"type": "json_object"}}, Structured("json_object")),
    ({"guided_json": SCHEMA}, Structured("json_schema", SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, Structured("json_schema", SCHEMA)),
    ({"guided_regex": "(ab|cd)[0-9]{2}"}, Structured("regex", "(ab|cd)[0-9]{2}")),
    ({"guided_choice": ["abc", "cde"]}, Structured("choice", ["abc", "cde"])),
    ({"guided_grammar": 'start: "[" /[a-d]{1,3}/ "]"'}, Structured("grammar", 'start: "[" /[a-d]{1,3}/ "]"')),
]


@pytest.mark.parametrize("body, structured", FIELDS, ids=[next(iter(b)) + str(i) for i, (b, _) in enumerate(FIELDS)])
def test_completions_mean_what_the_python_api_means(srv, api, body, structured):
    got = _post(srv, "/v1/completions", prompt=PROMPT_IDS, max_tokens=48, temperature=0.0,
                specrt={"return_token_ids": True}, **body)["choices"][0]
    want = api.generate([PROMPT_IDS], SamplingParams(temperature=0.0, max_tokens=48, structured=structured))[0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert got["finish_reason"] == want.finish_reason
    if structured.kind in ("json_schema", "json_object") and want.finish_reason == "stop":
        json.loads(got["text"])


def test_chat_and_streaming_with_a_json_schema(srv, api):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    whole = _post(srv, "/v1/chat/completions", messages=MSGS, max_tokens=48, temperature=0.0, response_format=fmt)
    text = whole["choices"][0]["message"]["content"]
    with srv.client.stream("POST", "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 48,
                                                                "temperature": 0.0, "stream": True,
                                                                "response_format": fmt}) as r:
        assert r.status_code == 200
        events = sse(r.iter_lines())
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert streamed == text
    if whole["choices"][0]["finish_reason"] == "stop":
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)


def test_text_format_stays_free_text(srv, api):
    got = _post(srv, "/v1/completions", prompt=PROMPT_IDS, max_tokens=8, temperature=0.0,
                response_format={"type": "text"}, specrt={"return_token_ids": True})["choices"][0]
    want = api.generate([PROMPT_IDS], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert got["token_ids"] == want.token_ids


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format"),
    ({"guided_json": {"type": "string", "pattern": "(ab"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "abc"}, "guided_choice"),
    ({"guided_grammar": "start: foo"}, "guided_grammar"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a+", "ignore_eos": True}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "response_format"),
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("body, field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_invalid_structured_fields_get_a_400_naming_the_field(srv, chat, body, field):
    base = {"messages": MSGS} if chat else {"prompt": PROMPT_IDS}
    r = srv.client.post("/v1/chat/completions" if chat else "/v1/completions",
                        json={"model": "tiny", "max_tokens": 4, **base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert field.split(".")[0] in err["message"], err


def test_without_llguidance_a_structured_request_is_a_400_naming_the_extra(srv, monkeypatch):
    import specrt.structured as st

    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setattr(st, "_valid", type(st._valid)())
    r = srv.client.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 4, "guided_regex": "x+y"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and "pip install 'specrt[structured]'" in err["message"], err


def test_structured_close_is_a_request_field(srv, api):
    """'structured_close' reaches SamplingParams per request: false is the grammar's mask alone, as in
    the Python API (at 36 tokens the budget rule changes this prompt's output); a non-bool is a 400."""
    outs = {}
    for close in (True, False):
        body = {} if close else {"structured_close": False}
        got = _post(srv, "/v1/completions", prompt=PROMPT_IDS, max_tokens=36, temperature=0.0, guided_json=SCHEMA,
                    specrt={"return_token_ids": True}, **body)["choices"][0]
        want = api.generate([PROMPT_IDS], SamplingParams(temperature=0.0, max_tokens=36, structured_close=close,
                                                         structured=Structured("json_schema", SCHEMA)))[0]
        assert got["token_ids"] == want.token_ids
        outs[close] = got["token_ids"]
    assert outs[True] != outs[False]
    r = srv.client.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 4, "guided_json": SCHEMA,
                                                 "structured_close": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_close", r.text
