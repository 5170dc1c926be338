"""Log-probabilities (issue 20): what the engine returns equals the target's log-softmax after the
sampling transform (to 1e-5 in fp32), whatever the drafter, recomputed here independently from
transformers' forward over the emitted sequence and specrt.ops.reference's transform.

Definition (specrt.sampling.controls): the log of the distribution each token was drawn from (controls,
temperature, top-k, min-p, top-p: -inf for removed tokens); for a greedy request the log-softmax
of the controlled logits at temperature 1. Prompt log-probabilities are the model's own
log-softmax, also when the prompt's prefix is cached (shared blocks are recomputed, not rewritten).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import EOS, LLMCache, pair_for_tests  # noqa: E402

from specrt import SamplingParams  # noqa: E402
from specrt.ops import reference  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31]]
TOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(pair):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(pair[0]), dtype=torch.float32).eval()


llm = LLMCache()


def _controlled(x: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """Step 1-2 of the transform (specrt.sampling.controls) on one position's logits, from its history."""
    x = x.clone()
    seq = prompt + out
    touched = set(out) | set((p.logit_bias or {})) | (set(prompt) if p.repetition_penalty != 1.0 else set())
    for v in touched:
        x[v] = reference.penalized_logit(x[v], (p.logit_bias or {}).get(v, 0.0), p.repetition_penalty,
                                         v in prompt and p.repetition_penalty != 1.0, out.count(v),
                                         p.frequency_penalty, p.presence_penalty)
    for w in p.bad_words_ids or []:
        if len(w) == 1 or seq[len(seq) - len(w) + 1:] == w[:-1]:
            x[w[-1]] = float("-inf")
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x = x.masked_fill(~keep, float("-inf"))
    if len(out) < p.min_tokens:
        x[EOS] = float("-inf")
    return x


def expected_logprobs(hf, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """[len(out), V]: each generated position's log-distribution, recomputed independently."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    rows = []
    for t in range(len(out)):
        x = _controlled(logits[len(prompt) + t - 1], prompt, out[:t], p)
        if p.greedy:
            rows.append(torch.log_softmax(x, -1))
        else:
            probs = reference.probs_from_logits(x[None], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                                                torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]
            rows.append(probs.log())
    return torch.stack(rows)


def _close(a: float, b: float) -> bool:
    return (math.isinf(a) and a == b) or abs(a - b) <= TOL


def check_output(hf, prompt, o, p: SamplingParams) -> None:
    assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
    want = expected_logprobs(hf, prompt, o.token_ids, p)
    for t, rec in enumerate(o.logprobs):
        assert rec.token_id == o.token_ids[t]
        assert _close(rec.logprob, float(want[t, rec.token_id])), (t, rec.logprob, float(want[t, rec.token_id]))
        assert math.isfinite(rec.logprob)                         # the token was possible
        assert len(rec.top) == p.logprobs
        values = [v for _, v in rec.top]
        assert values == sorted(values, reverse=True)
        ref = want[t].topk(p.logprobs)
        for (tok, v), rv in zip(rec.top, ref.values.tolist()):
            assert _close(v, rv) and _close(v, float(want[t, tok])), (t, tok, v, rv)


CASES = {
    "sampled": SamplingParams(temperature=0.8, top_k=20, min_p=0.02, max_tokens=12, ignore_eos=True, logprobs=5,
                              repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                              logit_bias={7: 2.0, 40: -1.0}, bad_words_ids=[[14], [12, 13]]),
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3,
                             repetition_penalty=1.5, allowed_token_ids=list(range(3, 80)), min_tokens=4),
    "plain": SamplingParams(temperature=1.0, max_tokens=12, logprobs=0),
}


@pytest.mark.parametrize("acceptance", ["rejection", "coupled"])
@pytest.mark.parametrize("draft", ["none", "model", "ngram", "self:1"])
def test_logprobs_are_the_targets_log_softmax_after_the_transform(pair, hf, draft, acceptance):
    if draft == "none" and acceptance == "coupled":
        pytest.skip("no drafter: nothing to accept")
    eng = llm(pair, draft, max_draft_length=4, acceptance=acceptance)
    for name, p in CASES.items():
        params = [SamplingParams(**{**p.__dict__, "seed": 100 + i}) for i in range(len(PROMPTS))]
        for prompt, o, q in zip(PROMPTS, eng.generate(PROMPTS, params), params):
            check_output(hf, prompt, o, q)
    assert o.prompt_logprobs is None


def test_logprobs_stream_with_the_tokens(pair):
    p = SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True, seed=3, logprobs=2)
    seen = 0
    for o in llm(pair, "model", max_draft_length=4).generate_stream([PROMPTS[0]], p):
        assert len(o.logprobs) == len(o.token_ids) >= seen
        assert [r.token_id for r in o.logprobs[seen:]] == o.new_token_ids
        seen = len(o.token_ids)
    assert seen == 10
    assert llm(pair, "model", max_draft_length=4).generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0].logprobs \
        is None


def _check_prompt(hf, prompt, o, n):
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
    for i, rec in enumerate(o.prompt_logprobs[1:]):
        assert rec.token_id == prompt[i + 1]
        assert _close(rec.logprob, float(want[i, prompt[i + 1]]))
        assert [t for t, _ in rec.top] == want[i].topk(n).indices.tolist()
        assert all(_close(v, float(want[i, t])) for t, v in rec.top)


@pytest.mark.parametrize("draft", ["none", "model", "self:1"])
def test_prompt_logprobs_also_over_a_cached_prefix(pair, hf, draft):
    """The second request's 48-token prefix is in the cache (prefix sharing): it is recomputed for its
    logits without rewriting the shared blocks, so every request still decodes as it would alone."""
    eng = llm(pair, draft, max_draft_length=3)
    prompt = [3 + (i * 7) % 90 for i in range(52)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = llm(pair, "none", prefix_sharing=False).generate([prompt, prompt[:50] + [9]], greedy)
    first = eng.generate([prompt], greedy)[0]
    scored = eng.generate([prompt], SamplingParams(**{**greedy.__dict__, "prompt_logprobs": 2}))[0]
    third = eng.generate([prompt[:50] + [9]], SamplingParams(**{**greedy.__dict__, "prompt_logprobs": 0}))[0]
    assert first.token_ids == scored.token_ids == alone[0].token_ids
    assert third.token_ids == alone[1].token_ids
    _check_prompt(hf, prompt, scored, 2)
    _check_prompt(hf, prompt[:50] + [9], third, 0)
    one = eng.generate([[7]], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert one.prompt_logprobs == [None]
