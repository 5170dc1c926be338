"""The sampling controls and logprobs over the OpenAI-compatible server (issue 20), loopback HTTP.

Each new field (min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias,
allowed_token_ids, bad_words, logprobs, top_logprobs, echo; suffix stays unsupported) is accepted
with its OpenAI / vLLM meaning -- the server returns what the Python API returns for the same
SamplingParams -- and refused with a 400 naming it when invalid. Logprobs come in OpenAI's shapes
(completions and chat, streaming and not) and through the ``openai`` client's own objects.
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from _engine_utils import make_pair  # noqa: E402
from _server_utils import api_of, post_ok, serve_pair, sse  # noqa: E402

from specrt.config import SamplingParams  # noqa: E402

K = 3
PROMPT = "w5 w6 w7 w8 w5 w6"
PROMPT_IDS = [5, 6, 7, 8, 5, 6]       # the test tokenizer: "wN" is token N, no BOS
MSGS = [{"role": "user", "content": "w9 w8 w7"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("controls_server_pair"))


@pytest.fixture(scope="module")
def srv(pair):
    s = serve_pair(pair, K, warmup=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(pair):
    """The Python API over the same pair and settings (the server's answers must match it)."""
    return api_of(pair, K)


_post = post_ok


def _completion(srv, **body):
    return _post(srv, "/v1/completions", prompt=PROMPT, **body)


def _chat(srv, **body):
    return _post(srv, "/v1/chat/completions", messages=MSGS, **body)


# ----------------------------------------------------------------------------- controls
CONTROL_BODIES = [
    ({"min_p": 0.3}, dict(min_p=0.3)),
    ({"repetition_penalty": 1.7}, dict(repetition_penalty=1.7)),
    ({"presence_penalty": 1.2, "frequency_penalty": 0.8}, dict(presence_penalty=1.2, frequency_penalty=0.8)),
    ({"logit_bias": {"7": 3.0, "30": -100}}, dict(logit_bias={7: 3.0, 30: -100.0})),
    ({"allowed_token_ids": [9, 10, 11, 12, 40]}, dict(allowed_token_ids=[9, 10, 11, 12, 40])),
    ({"bad_words": ["w7", "w9 w10"]}, dict(bad_words_ids=[[7], [9, 10]])),
]


@pytest.mark.parametrize("body, params", CONTROL_BODIES, ids=[str(sorted(b)) for b, _ in CONTROL_BODIES])
def test_each_control_means_what_the_python_api_means(srv, api, body, params):
    for temperature in (0.0, 0.8):
        common = dict(max_tokens=12, temperature=temperature, seed=11)
        got = _completion(srv, **common, **body, ignore_eos=True, specrt={"return_token_ids": True})
        want = api.generate([PROMPT_IDS], SamplingParams(ignore_eos=True, **common, **params))[0]
        assert got["choices"][0]["token_ids"] == want.token_ids, (body, temperature)
        assert got["choices"][0]["text"] == want.text
        chat = _chat(srv, **common, **body, ignore_eos=True)
        assert chat["choices"][0]["message"]["content"]


def test_controls_steer_the_output(srv):
    ids = lambda r: r["choices"][0]["token_ids"]   # noqa: E731
    body = dict(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, specrt={"return_token_ids": True})
    assert set(ids(_completion(srv, **body, logit_bias={"7": 100}))) == {7}
    assert set(ids(_completion(srv, **body, allowed_token_ids=[9, 12]))) <= {9, 12}
    out = ids(_completion(srv, **body, logit_bias={"7": 100, "8": 99}, bad_words=["w7"]))
    assert 7 not in out and set(out) == {8}


BAD = [
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 101}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"96": 1}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"allowed_token_ids": [5000]}, "allowed_token_ids"),
    ({"allowed_token_ids": "w5"}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "w5"}, "bad_words"), ({"bad_words": [5]}, "bad_words"),
    ({"allowed_token_ids": [7], "bad_words": ["w7"]}, "bad_words"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"echo": "yes"}, "echo"), ({"suffix": "w9"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),
]
BAD_CHAT = [
    ({"logprobs": 3}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"echo": True}, "echo"), ({"min_p": 2}, "min_p"), ({"logit_bias": {"x": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("chat, body, field", [(False, b, f) for b, f in BAD] + [(True, b, f) for b, f in BAD_CHAT])
def test_invalid_values_get_a_400_naming_the_field(srv, chat, body, field):
    path, base = ("/v1/chat/completions", {"messages": MSGS}) if chat else ("/v1/completions", {"prompt": PROMPT})
    r = srv.client.post(path, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["param"] == field, err


# ----------------------------------------------------------------------------- logprobs
def test_completion_logprobs_shape_and_values(srv, api):
    body = dict(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True, logprobs=3)
    lp = _completion(srv, **body)["choices"][0]["logprobs"]
    want = api.generate([PROMPT_IDS], SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True,
                                                     logprobs=3))[0]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [f"w{t}" if t > 2 else ["<unk>", "<s>", "</s>"][t] for t in want.token_ids]
    assert all(abs(a - b.logprob) < 1e-6 for a, b in zip(lp["token_logprobs"], want.logprobs))
    for top, rec, tok in zip(lp["top_logprobs"], want.logprobs, lp["tokens"]):
        assert 3 <= len(top) <= 4 and tok in top                      # the sampled token is always there
        assert all(abs(top[f"w{t}"] - v) < 1e-6 for t, v in rec.top if t > 2)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)] == [len(t) for t in lp["tokens"][:-1]]
    assert _completion(srv, max_tokens=2)["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape(srv):
    lp = _chat(srv, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and lp["choices"][0]["logprobs"]["refusal"] is None
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]     # greedy: the most likely one
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
    none = _chat(srv, max_tokens=3, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in none)
    assert _chat(srv, max_tokens=2)["choices"][0]["logprobs"] is None


def _stream(srv, path, body):
    with srv.client.stream("POST", path, json={"model": "tiny", **body, "stream": True}) as r:
        assert r.status_code == 200
        return sse(r.iter_lines())


def test_streamed_logprobs_equal_the_whole_response(srv):
    body = dict(prompt=PROMPT, max_tokens=10, temperature=0.8, seed=9, ignore_eos=True, logprobs=2)
    whole = _completion(srv, **{k: v for k, v in body.items() if k != "prompt"})["choices"][0]["logprobs"]
    parts = [e["choices"][0]["logprobs"] for e in _stream(srv, "/v1/completions", body) if e["choices"]]
    merged = {k: [x for p in parts if p for x in p[k]] for k in whole}
    assert merged == whole
    chat = dict(messages=MSGS, max_tokens=8, temperature=0.8, seed=9, ignore_eos=True, logprobs=True, top_logprobs=1)
    whole = _post(srv, "/v1/chat/completions", **chat)["choices"][0]["logprobs"]["content"]
    events = _stream(srv, "/v1/chat/completions", chat)
    assert [x for e in events if e["choices"] and e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"]["content"]] == whole


def test_echo_scores_the_prompt(srv, api):
    want = api.generate([PROMPT_IDS], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    scored = _completion(srv, max_tokens=0, echo=True, logprobs=2)
    choice = scored["choices"][0]
    assert choice["text"] == PROMPT and scored["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == PROMPT.split() and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(abs(a - b.logprob) < 1e-6 for a, b in zip(lp["token_logprobs"][1:], want[1:]))
    assert lp["text_offset"][:2] == [0, 2]
    full = _completion(srv, max_tokens=4, temperature=0, ignore_eos=True, echo=True, logprobs=0)["choices"][0]
    assert full["text"].startswith(PROMPT) and len(full["logprobs"]["tokens"]) == len(PROMPT_IDS) + 4
    assert _completion(srv, max_tokens=2, echo=True)["choices"][0]["text"].startswith(PROMPT)
    events = _stream(srv, "/v1/completions", dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1))
    streamed = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in streamed) == PROMPT
    assert [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]] == PROMPT.split()


def test_openai_client_returns_logprobs_in_its_objects(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.5, seed=1, logprobs=2,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"30": -100},
                                  extra_body={"ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.1})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    e = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert e.choices[0].text == PROMPT and e.choices[0].logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].token == content[0].token and content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                            stream=True, extra_body={"ignore_eos": True})
    tokens = [t.token for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert tokens == [x.token for x in content]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, presence_penalty=5)
    assert "presence_penalty" in str(err.value)


def test_minus_infinity_is_reported_as_openais_floor(srv):
    """A top alternative that top-k removed has probability 0: -9999.0, not -Infinity (invalid JSON)."""
    lp = _completion(srv, max_tokens=3, temperature=1.0, top_k=1, seed=2, ignore_eos=True,
                     logprobs=3)["choices"][0]["logprobs"]
    for top in lp["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        assert values[0] == 0.0 and values[1:] == [-9999.0] * (len(values) - 1)
        assert all(math.isfinite(v) for v in values)
