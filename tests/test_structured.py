"""Structured output (issue 36): SamplingParams.structured, exact under speculation.

On a tiny random target/draft pair (tests/_engine_utils.make_pair) with a byte-level BPE
tokenizer llguidance reads (the pair's word-level one it cannot):
- the record: every accepted form, a bad schema / regex / grammar / choice -> ValueError naming
  ``structured``, ignore_eos / min_tokens refused, a clear ImportError naming the extra without
  llguidance; each (kind, spec) compiled once per engine (bounded LRU);
- greedy: speculative output == autoregressive output with the same grammar, token for token, for
  the model, n-gram and self:1 drafters at K = 1 and 4 (overlap pre-drafts too), and the output
  matches its grammar (a regex in full, a JSON schema by jsonschema, a choice); a grammar that
  cannot finish within max_tokens ends with finish_reason "length"; EOS comes only where the
  grammar may end;
- coupled acceptance == autoregressive sampling with the same seed, token for token;
- rejection acceptance: the output is distributed as autoregressive sampling with the same mask
  (two-sample chi-square on the whole output and per position), and a deliberately wrong sampler
  (draft tokens sampled from the masked draft distribution, but the rejection step told the
  unmasked one) fails the same test (the test has power);
- the draft rows are masked from the same history: with the target as its own draft every draft
  is accepted.
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
sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import make_pair, tokens  # noqa: E402
from _stats import P_FAIL, P_PASS  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.structured import GRAMMAR_CACHE_SIZE, GrammarCompiler, Structured  # noqa: E402

VOCAB = 96
# the tiny pair's tokenizer: byte-level BPE over JSON's characters, digits, letters a-z, a few merges
_CHARS = list('{}[]":,.-0123456789abcdefghijklmnopqrstuvwxyz') + ["Ġ", "Ċ"]
_MERGES = [("{", '"'), ('"', ":"), ("Ġ", '"'), ('"', ","), ('"', "}"), ("t", "r"), ("u", "e"), ("tr", "ue"),
           ("a", "b"), ("Ġ", "a"), ("Ġ", "b"), ("a", "a"), ("b", "a"), ("1", "2"), ("Ġ", "1"), ("Ġ", "t"),
           ("Ġt", "ue"), ("c", "d"), ("a", "c"), ("b", "c"), ("n", "a"), ("m", "e"), ("na", "me"), ("Ġ", "2"),
           ("0", "0"), ("f", "a"), ("l", "s"), ("ls", "e"), ("fa", "lse"), ("Ġ", "fa")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-e]{1,4}$"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 2}},
          "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
GRAMMARS = {
    "regex": Structured("regex", r"(ab|cd|e)[0-9]{1,3}(-[a-c]+)?"),
    "json_schema": Structured("json_schema", SCHEMA),
    "choice": Structured("choice", ["abc", "ab", "cde", "e12"]),
    "grammar": Structured("grammar", 'start: "[" item ("," item)* "]"\nitem: /[a-d]{1,3}/ | NUMBER\n'
                                     'NUMBER: /[0-9]{1,2}/'),
    "json_object": Structured("json_object"),
}
PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31], [40, 41, 42, 43]]
MAX_TOKENS = 48


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in _CHARS:
        vocab[c] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "<unk>"}))


def structured_pair(root: Path) -> tuple[Path, Path]:
    tdir, ddir = make_pair(root)
    for d in (tdir, ddir):
        _write_tokenizer(d)
    return tdir, ddir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    return structured_pair(tmp_path_factory.mktemp("structured_pair"))


_llms: dict = {}


def llm(pair, draft, **spec):
    key = (draft, tuple(sorted(spec.items())))
    if key not in _llms:
        tdir, ddir = pair
        if not spec.get("overlap") and "tree" not in spec:
            spec = {**spec, "tree": "fixed"}          # a tree engine: structured steps must still draft chains
        d = {"model": str(ddir), "none": None, "target": str(tdir)}.get(draft, draft)
        _llms[key] = specrt.LLM(target=str(tdir), draft=d, spec=SpecConfig(**spec), seed=0)
    return _llms[key]


def _requests(**kw) -> tuple[list, list[SamplingParams]]:
    prompts, params = [], []
    for g in GRAMMARS.values():
        for p in PROMPTS:
            prompts.append(p)
            params.append(SamplingParams(max_tokens=MAX_TOKENS, seed=len(params), structured=g, **kw))
    return prompts, params


def _check_matches(structured: Structured, text: str, finish_reason: str) -> None:
    if finish_reason != "stop":              # cut by max_tokens: only a prefix of the language
        return
    if structured.kind == "regex":
        assert re.fullmatch(structured.spec, text), text
    elif structured.kind == "choice":
        assert text in structured.spec, text
    elif structured.kind in ("json_schema", "json_object"):
        value = json.loads(text)
        assert isinstance(value, dict), text
        if structured.kind == "json_schema":
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(value, json.loads(structured.spec))
    else:
        assert re.fullmatch(r"\[([a-d]{1,3}|[0-9]{1,2})(,([a-d]{1,3}|[0-9]{1,2}))*\]", text), text


# ----------------------------------------------------------------------------- the record
def test_accepted_forms():
    assert SamplingParams(structured=SCHEMA).structured == Structured("json_schema", SCHEMA)
    assert SamplingParams(structured=json.dumps(SCHEMA)).structured == Structured("json_schema", SCHEMA)
    assert SamplingParams(structured="json_object").structured.kind == "json_object"
    assert SamplingParams(structured=["a", "b"]).structured == Structured("choice", ("a", "b"))
    assert SamplingParams(structured=Structured("regex", "a+")).structured.spec == "a+"
    assert SamplingParams().structured is None and not SamplingParams().has_logit_controls
    assert SamplingParams(structured="json_object").has_logit_controls      # -> chain steps, masked rows
    # property order is kept (it is the order the output writes them in)
    s = Structured("json_schema", {"properties": {"b": {}, "a": {}}, "type": "object"})
    assert list(json.loads(s.spec)["properties"]) == ["b", "a"]


@pytest.mark.parametrize("value, needle", [
    (lambda: Structured("regex", "(ab"), "unclosed group"),
    ({"type": "objectx"}, "json schema"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(ab"}}}, "json schema"),
    ("{not json", "JSON schema"),
    ("[a-z]+", "json_object"),
    (lambda: Structured("grammar", "start: foo"), "unknown name"),
    (lambda: Structured("choice", []), "choice"),
    (["a", ""], "choice"),
    (lambda: Structured("choices", "a"), "kind"),
    (42, "structured must be"),
])
def test_bad_specs_are_refused_naming_structured(value, needle):
    with pytest.raises(ValueError, match="structured") as e:
        SamplingParams(structured=value() if callable(value) else value)
    assert needle.lower() in str(e.value).lower()


@pytest.mark.parametrize("kw", [dict(ignore_eos=True), dict(min_tokens=2)])
def test_a_grammar_decides_where_the_output_ends(kw):
    with pytest.raises(ValueError, match="structured output ends where its grammar does"):
        SamplingParams(structured="json_object", **kw)


def test_missing_library_names_the_extra(monkeypatch):
    import specrt.structured as st

    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setattr(st, "_valid", type(st._valid)())
    with pytest.raises(ImportError, match=re.escape("pip install 'specrt[structured]'")):
        SamplingParams(structured=Structured("regex", "x+"))


def test_each_grammar_is_compiled_once(pair):
    eng = llm(pair, "none").engine
    g = GRAMMARS["json_schema"]
    assert eng.intake.compile_structured(g) is eng.intake.compile_structured(Structured("json_schema", SCHEMA))
    from specrt.models import load_tokenizer

    small = GrammarCompiler(load_tokenizer(pair[0]), VOCAB, [2], cache_size=2)
    a, b, c = (small.compile(Structured("regex", f"a{{{i}}}")) for i in (1, 2, 3))
    assert small.compile(Structured("regex", "a{3}")) is c                 # kept
    assert small.compile(Structured("regex", "a{1}")) is not a              # evicted (LRU of 2), compiled again
    assert GRAMMAR_CACHE_SIZE >= 64


# ----------------------------------------------------------------------------- greedy and coupled identity
@pytest.fixture(scope="module")
def ar_greedy(pair):
    return llm(pair, "none").generate(*_requests(temperature=0.0))


@pytest.fixture(scope="module")
def ar_sampled(pair):
    return tokens(llm(pair, "none").generate(*_requests(temperature=0.9, top_k=8)))


def test_outputs_match_their_grammar(ar_greedy):
    _, params = _requests(temperature=0.0)
    stopped = 0
    for out, p in zip(ar_greedy, params):
        _check_matches(p.structured, out.text, out.finish_reason)
        stopped += out.finish_reason == "stop"
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == 2                       # the grammar ended with EOS
            assert 2 not in out.token_ids[:-1]
    assert stopped >= len(PROMPTS) * 3                          # not vacuous: most grammars finish


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("draft", ["model", "ngram", "self:1"])
def test_greedy_with_a_grammar_equals_autoregressive(pair, ar_greedy, draft, k):
    out = llm(pair, draft, max_draft_length=k).generate(*_requests(temperature=0.0))
    assert tokens(out) == tokens(ar_greedy)
    assert [o.finish_reason for o in out] == [o.finish_reason for o in ar_greedy]
    if draft != "ngram":
        assert sum(o.metrics["accepted_tokens"] for o in out) > 0


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_coupled_with_a_grammar_equals_autoregressive_sampling(pair, ar_sampled, draft):
    eng = llm(pair, draft, max_draft_length=4, acceptance="coupled")
    assert tokens(eng.generate(*_requests(temperature=0.9, top_k=8))) == ar_sampled


def test_overlap_pre_drafts_with_a_grammar(pair, ar_greedy, ar_sampled):
    eng = llm(pair, "model", max_draft_length=3, overlap=True, acceptance="coupled")
    assert tokens(eng.generate(*_requests(temperature=0.0))) == tokens(ar_greedy)
    assert tokens(eng.generate(*_requests(temperature=0.9, top_k=8))) == ar_sampled


@pytest.mark.parametrize("overlap", [False, True])
def test_the_draft_rows_see_the_same_mask(pair, ar_greedy, monkeypatch, overlap):
    """Every row masked for the same request after the same tokens (committed output + drafts) gets
    the same mask, whether a draft step (overlap pre-drafts included) or the verification asked:
    the draft proposes only what the target may accept."""
    from specrt.sampling import transform as sampling

    real, seen = sampling._mask_grammars, {}

    def recording(logits, states, row_request, row_offset, draft_token_ids):
        probe = torch.zeros_like(logits)
        real(probe, states, row_request, row_offset, draft_token_ids)
        drafts = draft_token_ids.tolist()
        for r, s in enumerate(states):
            if s is None or s.grammar is None:
                continue
            history = tuple(drafts[row_request[r]][:row_offset[r]])
            if 2 in history:
                continue                                   # after an EOS draft: never read
            key = (id(s), s.grammar.committed, history)
            refused = torch.isinf(probe[r]).nonzero().flatten().tolist()
            seen.setdefault(key, []).append(refused)
        real(logits, states, row_request, row_offset, draft_token_ids)

    monkeypatch.setattr(sampling, "_mask_grammars", recording)
    eng = llm(pair, "model", max_draft_length=4, overlap=overlap)
    assert tokens(eng.generate(*_requests(temperature=0.0))) == tokens(ar_greedy)
    shared = [masks for masks in seen.values() if len(masks) > 1]
    assert len(shared) > 50                                  # draft and verify rows at the same positions
    for masks in shared:
        assert all(m == masks[0] for m in masks)


@pytest.mark.parametrize("draft", ["none", "model"])
def test_a_grammar_that_cannot_finish_ends_with_length(pair, draft):
    g = Structured("regex", "(ab){40}")
    out = llm(pair, draft, max_draft_length=4).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10,
                                                                               structured=g))
    for o in out:
        assert o.finish_reason == "length" and len(o.token_ids) == 10 and 2 not in o.token_ids
        assert re.fullmatch("(ab)*a?", o.text), o.text


# ----------------------------------------------------------------------------- rejection sampling: distribution
N = 600                  # requests per engine
SMALL = Structured("regex", "(a|b|ab|ba){1,3}")    # several tokenizations, lengths and EOS points


def _sampled(eng, seed0: int, n: int = N) -> np.ndarray:
    """[n, 5] output tokens (-1 padded after the end) of n seeded requests."""
    params = [SamplingParams(temperature=1.0, max_tokens=5, seed=seed0 + j, structured=SMALL) for j in range(n)]
    out = eng.generate([PROMPTS[1]] * n, params)
    assert all(o.finish_reason in ("stop", "length") for o in out)
    for o in out:
        _check_matches(SMALL, o.text, o.finish_reason)
    return np.array([o.token_ids + [-1] * (5 - len(o.token_ids)) for o in out])


def _two_sample_p(a, b) -> float:
    from scipy.stats import chi2_contingency

    cats = sorted(set(a) | set(b))
    x = np.array([a.count(c) for c in cats])
    y = np.array([b.count(c) for c in cats])
    small = (x + y) < 10
    if small.any():
        x, y = np.append(x[~small], x[small].sum()), np.append(y[~small], y[small].sum())
    keep = (x + y) > 0
    return 1.0 if keep.sum() < 2 else float(chi2_contingency(np.stack([x[keep], y[keep]]))[1])


def _pvalues(ar: np.ndarray, sp: np.ndarray) -> dict[str, float]:
    seq = lambda x: [tuple(r) for r in x.tolist()]     # noqa: E731 - the whole output
    res = {"output": _two_sample_p(seq(ar), seq(sp))}
    for t in range(3):
        res[f"token {t}"] = _two_sample_p(ar[:, t].tolist(), sp[:, t].tolist())
    return res


@pytest.fixture(scope="module")
def ar_samples(pair):
    return _sampled(llm(pair, "none", max_batch_size=256), seed0=10_000_000)


@pytest.mark.slow
@pytest.mark.parametrize("draft, k", [("model", 4), ("model", 1), ("ngram", 4)])
def test_rejection_sampling_with_a_grammar_is_distributed_as_autoregressive(pair, ar_samples, draft, k):
    sp = _sampled(llm(pair, draft, max_batch_size=256, max_draft_length=k), seed0=50_000_000)
    for what, p in _pvalues(ar_samples, sp).items():
        assert p > P_PASS, f"draft={draft}, K={k}, {what}: p={p:.2e}"


def _unmask_the_reported_draft_distribution(monkeypatch) -> None:
    """Break the drafter: its tokens are still sampled from the masked draft distribution, but the
    distribution it reports to the rejection step (draft_probs) is the unmasked one."""
    from specrt.drafters import model as drafter_module

    real_apply, real_sample = drafter_module.apply_controls, drafter_module.ModelDrafter._sample
    refused = {}

    def apply_but_report_unmasked(logits, *history):
        unmasked = logits.clone()
        real_apply(logits, *history)                                   # the grammar is this test's only control
        refused["rows"] = torch.isinf(logits) & ~torch.isinf(unmasked)
        logits.copy_(unmasked)                                         # -> q (and draft_probs) unmasked

    def sample_masked(self, q, reqs, positions):
        mask = refused.pop("rows", None)
        if mask is not None and mask.shape == q.shape:
            q = q.masked_fill(mask, 0.0)
            q = q / q.sum(-1, keepdim=True)                            # the tokens: from the masked q
        return real_sample(self, q, reqs, positions)

    monkeypatch.setattr(drafter_module, "apply_controls", apply_but_report_unmasked)
    monkeypatch.setattr(drafter_module.ModelDrafter, "_sample", sample_masked)


@pytest.mark.slow
def test_the_distribution_test_has_power(pair, ar_samples, monkeypatch):
    """A drafter whose reported draft distribution is not the one its tokens were drawn from (the
    grammar mask left out of draft_probs) gives a wrong output distribution; the test above must
    catch it. Its outputs still match the grammar (the target rows are masked)."""
    tdir, ddir = pair
    broken = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_batch_size=256, max_draft_length=4,
                                                                           tree="chain"), seed=0)
    _unmask_the_reported_draft_distribution(monkeypatch)
    sp = _sampled(broken, seed0=50_000_000)
    worst = min(_pvalues(ar_samples, sp).values())
    assert worst < P_FAIL, f"the broken sampler passed (p={worst:.2e})"


def test_mixed_batches_and_preemption(pair, ar_greedy):
    """Structured and free requests in one batch (only the structured rows are masked), and a KV
    cache so small that requests are preempted and recomputed: greedy output as autoregressive."""
    from specrt.models.kv_cache import kv_bytes_per_block
    from specrt.models import load_model

    prompts, params = _requests(temperature=0.0)
    free = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS) for _ in PROMPTS]
    want_free = tokens(llm(pair, "none").generate(PROMPTS, free))
    mixed = tokens(llm(pair, "model", max_draft_length=4).generate(prompts + PROMPTS, params + free))
    assert mixed == tokens(ar_greedy) + want_free
    tdir, ddir = pair
    cfgs = [load_model(tdir).config, load_model(ddir).config]
    tight = SpecConfig(max_draft_length=3, block_size=4, max_batch_size=64,
                       kv_cache_budget=40 * kv_bytes_per_block(cfgs, 4, torch.float32))
    eng = specrt.LLM(target=str(tdir), draft=str(ddir), spec=tight, seed=0)
    assert tokens(eng.generate(prompts, params)) == tokens(ar_greedy)
    assert eng.stats()["preemptions"] > 0


def test_forced_tokens_are_drafted_without_the_model(pair, monkeypatch):
    """Where the grammar forces the next tokens (here: all of them), they are the draft and no draft
    forward runs; the output stays the autoregressive one. Without them the draft model runs a
    forward per drafted token (under the mask it finds the same tokens: the test's power is in the
    forwards)."""
    import specrt.drafters.model as model_drafter

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=Structured("regex", "abcdeabcdeabcde12"))
    want = tokens(llm(pair, "none").generate([PROMPTS[0], PROMPTS[3]], params))

    def run() -> tuple[float, int]:
        eng = specrt.LLM(target=str(pair[0]), draft=str(pair[1]), seed=0,
                         spec=SpecConfig(max_draft_length=4, tree="chain", lookup=None))
        calls = []
        forward = eng.engine.drafter._forward
        monkeypatch.setattr(eng.engine.drafter, "_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
        assert tokens(eng.generate([PROMPTS[0], PROMPTS[3]], params)) == want
        return eng.stats()["total"]["tokens_per_target_forward"], len(calls)

    tau, forwards = run()
    monkeypatch.setattr(model_drafter, "forced_drafts", lambda batch, ks, skip: {})
    tau_model, forwards_model = run()
    assert tau >= 2.5 and tau >= tau_model - 0.01
    assert forwards <= 2 < 6 <= forwards_model
