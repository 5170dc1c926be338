"""Overlap (pre-drafting the next round while this one verifies) under every policy and with
``self:N`` (issue 16, item 4): outputs stay exact (greedy and coupled equal autoregressive
decoding; under rejection sampling the tokens do not depend on overlap, because the next step
takes the very decision it would take without a pre-draft), pre-drafts are really used, and
where overlap cannot apply the engine says so once in the log and in stats()."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import LLMCache, pair_for_tests, tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.drafters.predraft import PreDraft  # noqa: E402
from specrt.policy import ConfidencePolicy, HeadPolicy  # noqa: E402
from specrt.step.scheduler import Request  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31], [40, 41, 42, 43, 44, 45, 46],
           [50] * 3 + [51] * 3, [60, 61, 62, 60, 61, 62, 60], [70]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=100 + i)
           for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory, accept_head=True)


llm = LLMCache()


@pytest.fixture(scope="module")
def ar(pair):
    eng = llm(pair, "none")
    return tokens(eng.generate(PROMPTS, GREEDY)), tokens(eng.generate(PROMPTS, SAMPLED))


CASES = [("model", "confidence"), ("model", "head"), ("model", "budget"), ("self:1", "fixed"),
         ("self:2", "confidence"), ("target", "confidence"), ("target", "budget")]


@pytest.mark.parametrize("draft,policy", CASES)
def test_overlap_is_exact_under_every_policy(pair, ar, draft, policy):
    ar_greedy, ar_sampled = ar
    eng = llm(pair, draft, policy=policy, max_draft_length=4, overlap=True)
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar_greedy
    coupled = llm(pair, draft, policy=policy, max_draft_length=4, overlap=True, acceptance="coupled")
    assert tokens(coupled.generate(PROMPTS, SAMPLED)) == ar_sampled
    assert eng.stats()["overlap"]["active"]


@pytest.mark.parametrize("draft,policy", [("model", "confidence"), ("model", "head"), ("self:1", "confidence"),
                                          ("target", "confidence")])
def test_rejection_tokens_do_not_depend_on_overlap(pair, draft, policy):
    """Under rejection sampling the tokens depend on the draft lengths chosen: a pre-draft must
    leave every decision as it would be without it (replayed stop rules, truncation, drops)."""
    off = llm(pair, draft, policy=policy, max_draft_length=4)
    on = llm(pair, draft, policy=policy, max_draft_length=4, overlap=True)
    for e in (off, on):
        e.engine.reset_metrics()
    assert tokens(on.generate(PROMPTS, SAMPLED)) == tokens(off.generate(PROMPTS, SAMPLED))
    h_off, h_on = off.stats()["total"], on.stats()["total"]
    assert h_on["drafted_tokens"] == h_off["drafted_tokens"]      # the same K decisions, step by step


@pytest.mark.parametrize("draft,policy,k", [("target", "confidence", 4), ("target", "budget", 4),
                                            ("self:2", "fixed", 1), ("self:2", "confidence", 4)])
def test_pre_drafts_are_used(pair, ar, draft, policy, k):
    """With the target as its own draft every draft and every bonus guess is right, so most rounds
    run on the pre-draft made while the previous round verified, under every policy; self:2 (two
    of the target's three layers) gets enough rounds right to use some. (The budget policy plans
    from measured timings: min_draft_length keeps it drafting whatever they say, and its K may
    change from step to step, so only some pre-drafts are sure to be used.)"""
    extra = {"min_draft_length": 2} if policy == "budget" else {}
    eng = llm(pair, draft, policy=policy, max_draft_length=k, overlap=True, **extra)
    eng.engine.reset_metrics()
    eng.generate(PROMPTS, GREEDY)
    snap = eng.stats()
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar[0]
    assert snap["overlap_pre_drafts"] > 0
    if draft == "target" and policy != "budget":
        assert snap["overlap_pre_drafts_used"] >= 0.5 * snap["overlap_pre_drafts"]
    else:
        assert snap["overlap_pre_drafts_used"] > 0


def test_overlap_that_cannot_apply_says_so_once(pair, caplog):
    with caplog.at_level(logging.WARNING, logger="specrt.engine"):
        eng = llm(pair, "ngram", max_draft_length=3, overlap=True)
    said = [r for r in caplog.records if "overlap=True has no effect" in r.getMessage()]
    assert len(said) == 1 and "ngram" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specrt.engine"):
        eng.generate(PROMPTS[:2], GREEDY)
    assert not [r for r in caplog.records if "overlap" in r.getMessage()]
    st = eng.stats()["overlap"]
    assert st["requested"] and not st["active"] and "ngram" in st["note"]
    assert eng.stats()["overlap_pre_drafts"] == 0
    assert llm(pair, "model", max_draft_length=3).stats()["overlap"] == {"requested": False, "active": False,
                                                                         "note": ""}


def _request(history: list[int]) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(), seed=0)
    r.accept_history.extend(history)
    return r


@pytest.mark.parametrize("cls", [ConfidencePolicy, HeadPolicy])
def test_the_pre_draft_stop_rule_predicts_the_next_steps_rule(cls):
    """stop_rule_ahead answers as should_stop will once the pre-draft's premise (all drafted tokens
    accepted) is observed; replayed_length replays it on the recorded values and truncates or
    drops without touching the policy's state."""
    pol = cls(SpecConfig(policy=cls.name, min_draft_length=1, max_draft_length=6))
    conf = [0.9, 0.8, 0.45, 0.3, 0.2, 0.1]
    for hist in ([1, 0] * 10, [0] * 20, [1] * 20):
        r = _request(hist)
        rule = pol.stop_rule_ahead(r, drafted=3)
        predicted = next((j for j, c in enumerate(conf) if rule(j, c, c)), 6)
        pol.observe(r, 3, 3)                       # the premise holds
        pol.plan([r], [6])
        fresh = next((j for j, c in enumerate(conf) if pol.should_stop(r, j, c, c)), 6)
        assert predicted == fresh
        pol.plan([r], [6])
        state = (r.policy_state.p_all, r.policy_state.threshold)
        pre = PreDraft(torch.tensor(0), torch.zeros(6), None, predicted, 0, 0.0, r.context_len,
                       conf[:predicted + 1], conf[:predicted + 1])
        assert pol.replayed_length(r, 6, pre) == predicted
        assert pol.replayed_length(r, min(predicted, 1), pre) == min(predicted, 1)     # a smaller K: a prefix
        assert (r.policy_state.p_all, r.policy_state.threshold) == state                # no state touched
    # the decision differs (the pre-draft stopped where the next step would not): dropped
    r = _request([1] * 20)
    pol.plan([r], [6])
    pre = PreDraft(torch.tensor(0), torch.zeros(1), None, 1, 0, 0.0, r.context_len, [0.99, 0.99], [0.99, 0.99])
    assert pol.replayed_length(r, 6, pre) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("draft,policy", [("model", "fixed"), ("model", "confidence"), ("self:2", "fixed"),
                                          ("target", "budget")])
def test_overlap_on_cuda_streams_is_exact(pair, draft, policy):
    """On CUDA the pre-draft runs on the draft stream while the verification runs: the output must
    not depend on it (greedy equals autoregressive; coupled sampling too)."""
    tdir, ddir = pair
    d = {"model": str(ddir), "target": str(tdir)}.get(draft, draft)
    outs = {}
    for overlap in (False, True):
        for acceptance, params in (("rejection", GREEDY), ("coupled", SAMPLED)):
            llm = specrt.LLM(target=str(tdir), draft=d, device="cuda", seed=0,
                             spec=SpecConfig(policy=policy, max_draft_length=4, overlap=overlap, acceptance=acceptance))
            outs[overlap, acceptance] = tokens(llm.generate(PROMPTS, params))
        if overlap:
            assert llm.stats()["overlap"]["active"]
    ar = specrt.LLM(target=str(tdir), draft=None, device="cuda", seed=0)
    assert outs[True, "rejection"] == outs[False, "rejection"] == tokens(ar.generate(PROMPTS, GREEDY))
    assert outs[True, "coupled"] == outs[False, "coupled"] == tokens(ar.generate(PROMPTS, SAMPLED))
