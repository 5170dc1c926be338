"""A SpecConfig that names the adaptive keys means what it says (issue 16, items 1 and 10):
the design's config dict runs the confidence policy with that threshold and window; keys that
cannot apply to the chosen policy are refused or logged, never silently ignored; the acceptance
window is honoured beyond 64; the adaptive threshold applies to the head policy too."""
from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import pair_for_tests  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.policy import ConfidencePolicy, HeadPolicy, make_policy, recent_acceptance  # noqa: E402
from specrt.step.scheduler import Request  # noqa: E402


def test_the_designs_config_dict_runs_the_adaptive_policy_it_describes():
    config = dict(min_draft_length=1, max_draft_length=8, confidence_threshold=0.6, acceptance_window=100,
                  adaptive_enabled=True)
    spec = SpecConfig(**config)
    pol = make_policy(spec)
    assert isinstance(pol, ConfidencePolicy) and spec.policy == "confidence"
    assert (spec.min_draft_length, spec.max_draft_length, spec.confidence_threshold, spec.acceptance_window) == \
        (1, 8, 0.6, 100)
    # the threshold adapts, from 0.6, to each request's acceptance over its last 100 drafted positions
    good, bad = _request([0] * 60 + [1] * 100), _request([1] * 60 + [0] * 100)
    pol.plan([good, bad], [8, 8])
    assert good.policy_state.threshold < 0.6 * 1.0 < bad.policy_state.threshold
    # a window of 100 (not 64): 100 recent outcomes decide, the 60 older ones do not
    assert recent_acceptance(good, 100) > 0.95 and recent_acceptance(bad, 100) < 0.05


def _request(history: list[int]) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(), seed=0)
    r.accept_history.extend(history)
    return r


@pytest.mark.parametrize("window", [100, 200])
def test_acceptance_window_is_honoured_beyond_64(window):
    pol = make_policy(SpecConfig(adaptive_enabled=True, acceptance_window=window))
    r = Request("r", [1, 2, 3], SamplingParams(), seed=0)
    for _ in range(window):              # window outcomes: the first half rejected, the second accepted
        pol.observe(r, 1, 0 if len(r.accept_history) < window // 2 else 1)
    assert len(r.accept_history) == window and r.accept_history.maxlen >= window
    rate = recent_acceptance(r, window, prior_weight=0.0)
    assert rate == pytest.approx(0.5)    # a 64-long history would say ~0.78 (36 of the last 64 accepted)
    pol.observe(r, 1, 1)
    assert len(r.accept_history) == window


def test_keys_that_cannot_apply_are_refused_or_logged(caplog):
    with pytest.raises(ValueError, match="adaptive_enabled=True needs a dynamic policy"):
        SpecConfig(policy="fixed", adaptive_enabled=True)
    with pytest.raises(ValueError, match="adaptive_enabled=False cannot apply to policy='budget'"):
        SpecConfig(policy="budget", adaptive_enabled=False)
    cases = [(dict(policy="fixed", confidence_threshold=0.5), "confidence_threshold=0.5"),
             (dict(policy="fixed", acceptance_window=10), "acceptance_window=10"),
             (dict(policy="fixed", min_draft_length=1), "min_draft_length=1"),
             (dict(policy="budget", confidence_threshold=0.5), "confidence_threshold=0.5"),
             (dict(policy="confidence", adaptive_enabled=False, acceptance_window=50), "acceptance_window=50"),
             (dict(policy="head", adaptive_enabled=False, acceptance_window=50), "acceptance_window=50")]
    for kw, named in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specrt.config"):
            SpecConfig(**kw)
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 1 and named in msgs[0] and "no effect" in msgs[0], (kw, msgs)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specrt.config"):   # every key applies: silence
        SpecConfig(policy="confidence", min_draft_length=1, confidence_threshold=0.5, acceptance_window=10)
        SpecConfig(policy="budget", acceptance_window=10)
        SpecConfig()
    assert not caplog.records


def test_defaults_per_policy_are_documented_values():
    assert (SpecConfig().policy, SpecConfig().max_draft_length) == ("fixed", 4)
    c = SpecConfig(adaptive_enabled=True)
    assert (c.policy, c.min_draft_length, c.max_draft_length, c.confidence_threshold, c.acceptance_window) == \
        ("confidence", 1, 8, 0.6, 100)
    h = SpecConfig(policy="head")
    assert (h.adaptive_enabled, h.confidence_threshold, h.max_draft_length) == (True, 0.6, 8)
    b = SpecConfig(policy="budget")
    assert (b.min_draft_length, b.max_draft_length, b.acceptance_window, b.confidence_threshold) == (0, 4, 100, None)
    f = SpecConfig(policy="fixed")
    assert (f.adaptive_enabled, f.confidence_threshold, f.acceptance_window) == (False, None, None)
    # a resolved config rebuilt field by field is the same config (no spurious warnings either)
    import dataclasses
    assert dataclasses.replace(c) == c and dataclasses.replace(f) == f


def test_head_policy_threshold_adapts():
    """Issue 16 item 10: adaptive on/off gave the head policy identical decisions."""
    on = HeadPolicy(SpecConfig(policy="head", confidence_threshold=0.5))
    off = HeadPolicy(SpecConfig(policy="head", confidence_threshold=0.5, adaptive_enabled=False))
    good, bad = _request([1] * 100), _request([0] * 100)

    def depth(pol, r, p=0.8):
        pol.plan([r], [8])
        return next((j for j in range(8) if pol.should_stop(r, j, p, p)), 8)
    assert depth(off, good) == depth(off, bad)                 # a fixed threshold: the history does not matter
    assert depth(on, good) > depth(off, good) > depth(on, bad)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory, accept_head=True)


def test_head_policy_k_histograms_differ_with_adaptive(pair):
    """End to end: the target as its own draft (acceptance ~1) with the head policy drafts deeper
    when the threshold adapts to that acceptance."""
    tdir, ddir = pair
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    hists = {}
    for adaptive in (True, False):
        ks = Counter()

        def wrap(drafter):
            inner = drafter.propose

            def propose(batch, ks_, *a, **kw):
                out = inner(batch, ks_, *a, **kw)
                ks.update(out.num_draft_tokens)
                return out
            drafter.propose = propose
            return drafter
        import shutil
        shutil.copytree(ddir / "accept_head", tdir / "accept_head", dirs_exist_ok=True)
        llm = specrt.LLM(target=str(tdir), draft=str(tdir), wrap_drafter=wrap, seed=0,
                         spec=SpecConfig(policy="head", adaptive_enabled=adaptive, confidence_threshold=0.3))
        llm.generate(prompts, params)
        hists[adaptive] = ks
    assert hists[True] != hists[False]
    mean = {a: sum(k * n for k, n in h.items()) / sum(h.values()) for a, h in hists.items()}
    assert mean[True] > mean[False]
