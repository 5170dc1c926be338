"""The sampling controls at the engine level (issue 20), on the tiny random target/draft pair (CPU).

For every control (min_p, repetition_penalty, presence + frequency penalties, logit_bias,
allowed_token_ids + bad_words_ids) and every drafter (model, n-gram, self:1) at K = 1 and 4:
- greedy: speculative output == autoregressive output with the same control, token for token;
- coupled acceptance: == autoregressive sampling with the same seed, token for token;
- rejection acceptance: the first 4 tokens are distributed as autoregressive sampling with the
  same control (two-sample chi-square per position and on the number of distinct tokens, the
  statistic penalties move most); a deliberately broken engine whose verified positions forget
  the drafts before them fails the same test (the test has power);
- greedy parity with transformers' generate (RepetitionPenaltyLogitsProcessor,
  NoBadWordsLogitsProcessor, MinPLogitsWarper) on the same weights;
- alignment: with the target as its own draft every draft is accepted, overlap pre-drafts
  included, which holds only if each draft row saw the target's controls and history;
- a banned sequence is cut exactly where greedy decoding would complete it within one step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import EOS, LLMCache, pair_for_tests, tokens  # noqa: E402
from _stats import P_FAIL, P_PASS  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402

DRAFTS = ["model", "ngram", "self:1"]
KS = [1, 4]
PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31], [40, 41, 42, 43, 44, 45, 46],
           [50] * 3 + [51] * 3]
# one control per entry; sampled with top_k 6 so that tokens repeat and penalties matter
CONTROLS = {
    "min_p": dict(min_p=0.2),
    "repetition": dict(repetition_penalty=2.0),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "logit_bias": dict(logit_bias={7: 3.0, 12: 2.0, 13: -100.0, 40: 1.5, 60: 4.0}),
    "allowed_bad_words": dict(allowed_token_ids=list(range(3, 70)),
                              bad_words_ids=[[14], [12, 13], [13, 12], [8, 9], [6, 7, 8]]),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory)


llm = LLMCache()


def _params(control: str, n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=16, ignore_eos=True, **CONTROLS[control], **kw) for _ in range(n)]


def _all_controls(**kw) -> tuple[list, list[SamplingParams]]:
    """Every prompt under every control (seeds differ per request when sampling)."""
    prompts, params = [], []
    for c in CONTROLS:
        for j, p in enumerate(PROMPTS):
            prompts.append(p)
            params.append(SamplingParams(max_tokens=16, ignore_eos=True, seed=len(params), **CONTROLS[c], **kw))
    return prompts, params


@pytest.fixture(scope="module")
def ar_greedy(pair):
    return tokens(llm(pair, "none").generate(*_all_controls(temperature=0.0)))


@pytest.fixture(scope="module")
def ar_sampled(pair):
    return tokens(llm(pair, "none").generate(*_all_controls(temperature=0.9, top_k=8)))


def test_controls_change_the_output(pair, ar_greedy):
    """Else the identity tests below would pass vacuously."""
    plain = tokens(llm(pair, "none").generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16,
                                                                      ignore_eos=True)))
    for i, c in enumerate(CONTROLS):
        if c == "min_p":    # greedy ignores min_p
            continue
        got = ar_greedy[i * len(PROMPTS):(i + 1) * len(PROMPTS)]
        assert got != plain, c


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_with_controls_equals_autoregressive(pair, ar_greedy, draft, k):
    eng = llm(pair, draft, max_draft_length=k)
    out = eng.generate(*_all_controls(temperature=0.0))
    assert tokens(out) == ar_greedy
    if draft != "ngram":
        assert sum(o.metrics["accepted_tokens"] for o in out) > 0


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("draft", DRAFTS)
def test_coupled_with_controls_equals_autoregressive_sampling(pair, ar_sampled, draft, k):
    eng = llm(pair, draft, max_draft_length=k, acceptance="coupled")
    assert tokens(eng.generate(*_all_controls(temperature=0.9, top_k=8))) == ar_sampled


def test_overlap_pre_drafts_with_controls(pair, ar_greedy, ar_sampled):
    """The model drafter's overlap pre-drafts follow the assumed history (drafts, guess, pre-drafts)."""
    eng = llm(pair, "model", max_draft_length=3, overlap=True, acceptance="coupled")
    assert tokens(eng.generate(*_all_controls(temperature=0.0))) == ar_greedy
    assert tokens(eng.generate(*_all_controls(temperature=0.9, top_k=8))) == ar_sampled


# --------------------------------------------------------------------------- #
# rejection sampling: distribution
# --------------------------------------------------------------------------- #
N = 500          # requests per control and engine
T = 4            # tokens per request


def _samples(eng, seed0: int, n: int = N, controls=tuple(CONTROLS)) -> dict[str, np.ndarray]:
    """{control: [n, T] tokens}, every control's n requests in one run (distinct seeds)."""
    prompts, params = [], []
    for c in controls:
        prompts += [PROMPTS[1]] * n
        params += [SamplingParams(temperature=1.0, top_k=6, max_tokens=T, ignore_eos=True,
                                  seed=seed0 + len(params) + j, **CONTROLS[c]) for j in range(n)]
    out = np.array(tokens(eng.generate(prompts, params)))
    return {c: out[i * n:(i + 1) * n] for i, c in enumerate(controls)}


def _two_sample_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two samples of categories share a distribution (categories with
    fewer than 10 draws in both samples together pooled into one cell)."""
    from scipy.stats import chi2_contingency

    cats = np.union1d(a, b)
    x = np.array([(a == c).sum() for c in cats])
    y = np.array([(b == c).sum() for c in cats])
    small = (x + y) < 10
    if small.any():
        x = np.append(x[~small], x[small].sum())
        y = np.append(y[~small], y[small].sum())
    keep = (x + y) > 0
    if keep.sum() < 2:
        return 1.0
    return float(chi2_contingency(np.stack([x[keep], y[keep]]))[1])


def _distribution_pvalues(ar: np.ndarray, sp: np.ndarray) -> dict[str, float]:
    stats = {f"token {t}": _two_sample_p(ar[:, t], sp[:, t]) for t in range(T)}
    distinct = lambda x: np.array([len(set(row)) for row in x.tolist()])   # noqa: E731
    stats["distinct tokens"] = _two_sample_p(distinct(ar), distinct(sp))
    return stats


@pytest.fixture(scope="module")
def ar_samples(pair):
    return _samples(llm(pair, "none", max_batch_size=256), seed0=10_000_000)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("draft", DRAFTS)
def test_rejection_sampling_with_controls_is_distributed_as_autoregressive(pair, ar_samples, draft, k):
    sp = _samples(llm(pair, draft, max_batch_size=256, max_draft_length=k), seed0=50_000_000)
    for c in CONTROLS:
        for what, p in _distribution_pvalues(ar_samples[c], sp[c]).items():
            assert p > P_PASS, f"control {c}, draft={draft}, K={k}, {what}: p={p:.2e}"


def _forget_drafts_in_verify(monkeypatch) -> None:
    """Break the engine: every verified row sees only the committed history, not the drafts before it."""
    import specrt.step.engine as engine_module
    from specrt.step import verify

    build = verify.build_verify_batch

    def forgetful(*args, **kwargs):
        vb = build(*args, **kwargs)
        vb.row_offset = [0] * len(vb.row_offset)
        return vb

    monkeypatch.setattr(verify, "build_verify_batch", forgetful)
    monkeypatch.setattr(engine_module, "build_verify_batch", forgetful)


def test_the_distribution_test_has_power(pair, monkeypatch):
    """A broken engine whose verified rows ignore the drafts before them (every row sees only the
    committed history) must fail the test above for the penalties; that is the bug the per-position
    history prevents. 4N requests: the first token comes from the prefill (no drafts), so only the
    T - 1 later ones can show the bug."""
    penalties = ("repetition", "presence_frequency")
    ar = _samples(llm(pair, "none", max_batch_size=256), seed0=10_000_000, n=4 * N, controls=penalties)
    _forget_drafts_in_verify(monkeypatch)
    tdir, ddir = pair
    eng = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_batch_size=256, max_draft_length=4,
                                                                          tree="chain"), seed=0)   # drafts every step
    sp = _samples(eng, seed0=50_000_000, n=4 * N, controls=penalties)
    for c in penalties:
        worst = min(_distribution_pvalues(ar[c], sp[c]).values())
        assert worst < P_FAIL, f"control {c}: the broken engine passed (p={worst:.2e})"


# --------------------------------------------------------------------------- #
# parity with transformers (greedy)
# --------------------------------------------------------------------------- #
HF_CONTROLS = {
    "repetition_penalty": (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    "bad_words_ids": (dict(bad_words_ids=[[14], [60], [12, 13], [5, 6, 7]]),
                      dict(bad_words_ids=[[14], [60], [12, 13], [5, 6, 7]])),
    "min_p": (dict(min_p=0.3), dict(min_p=0.3)),
    "all": (dict(repetition_penalty=1.3, bad_words_ids=[[14], [12, 13]], min_p=0.1),
            dict(repetition_penalty=1.3, bad_words_ids=[[14], [12, 13]], min_p=0.1)),
}


@pytest.mark.parametrize("control", sorted(HF_CONTROLS))
def test_greedy_matches_transformers_generate(pair, control):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    tdir, _ = pair
    ours, theirs = HF_CONTROLS[control]
    n = 16
    hf = LlamaForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, **ours)
    got_ar = tokens(llm(pair, "none").generate(PROMPTS, params))
    got_spec = tokens(llm(pair, "model", max_draft_length=4).generate(PROMPTS, params))
    for prompt, a, s in zip(PROMPTS, got_ar, got_spec):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=EOS, **theirs)
        want = out[0, len(prompt):].tolist()
        assert a == want and s == want, (control, prompt)


def test_bad_words_are_never_emitted(pair):
    words = CONTROLS["allowed_bad_words"]["bad_words_ids"]
    allowed = set(CONTROLS["allowed_bad_words"]["allowed_token_ids"])
    for draft in DRAFTS:
        out = tokens(llm(pair, draft, max_draft_length=4).generate(
            *_all_controls(temperature=1.0)))[-len(PROMPTS):]     # the last control's requests
        for prompt, toks in zip(PROMPTS, out):
            seq = prompt + toks
            assert set(toks) <= allowed
            for w in words:
                for i in range(len(prompt), len(seq)):
                    assert seq[i - len(w) + 1:i + 1] != w, (draft, w, toks)


def _banned_bigram_case(pair, eng):
    """Ban a bigram that plain greedy decoding emits inside one speculative step (the target as its own
    draft: every draft accepted, 5 tokens a step at K = 4): (autoregressive tokens, eng's, the word)."""
    prompt = PROMPTS[0]
    plain = llm(pair, "none").generate([prompt], SamplingParams(temperature=0.0, max_tokens=14,
                                                                ignore_eos=True))[0].token_ids
    i = next(i for i in range(1, len(plain) - 1) if i % 5 != 4 and plain[i:i + 2] not in
             [plain[j:j + 2] for j in range(i)])
    word = plain[i:i + 2]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, bad_words_ids=[word])
    ar = llm(pair, "none").generate([prompt], params)[0].token_ids
    assert ar[:i + 1] == plain[:i + 1] and ar[i + 1] != word[1]
    return prompt, ar, eng.generate([prompt], params)[0].token_ids, word


@pytest.mark.parametrize("draft", DRAFTS + ["target"])
def test_a_banned_sequence_is_cut_where_greedy_would_complete_it(pair, draft):
    """The second token changes exactly where greedy would complete the banned word, speculative ==
    autoregressive, and the word is never emitted."""
    tdir, _ = pair
    prompt, ar, spec, word = _banned_bigram_case(pair, llm(pair, str(tdir) if draft == "target" else draft,
                                                           max_draft_length=4))
    assert spec == ar
    seq = prompt + spec
    assert all(seq[i:i + 2] != word for i in range(len(prompt) - 1, len(seq) - 1))


def test_the_banned_sequence_test_has_power(pair, monkeypatch):
    """A verify whose rows ignore the drafts before them completes the word inside a step."""
    _forget_drafts_in_verify(monkeypatch)
    tdir, _ = pair
    eng = specrt.LLM(target=str(tdir), draft=str(tdir), spec=SpecConfig(max_draft_length=4, lookup=None), seed=0,
                     draft_quantize=None)
    _, ar, spec, word = _banned_bigram_case(pair, eng)
    assert spec != ar


@pytest.mark.parametrize("overlap", [False, True])
def test_the_draft_sees_the_same_controls_and_history(pair, ar_greedy, overlap):
    """The target as its own draft model, greedy: every draft is accepted only if each draft row got
    the target's controls from the same history (earlier drafts, and with overlap the guessed bonus
    and earlier pre-drafts) -- a misaligned row would propose another token."""
    tdir, _ = pair
    eng = llm(pair, str(tdir), max_draft_length=4, overlap=overlap)
    eng.engine.reset_metrics()
    out = eng.generate(*_all_controls(temperature=0.0))
    assert tokens(out) == ar_greedy
    drafted = sum(o.metrics["drafted_tokens"] for o in out)
    assert drafted > 0 and sum(o.metrics["accepted_tokens"] for o in out) == drafted
    if overlap:      # the pre-drafts were made, kept, and accepted
        assert eng.stats()["overlap_pre_drafts_used"] > 0
