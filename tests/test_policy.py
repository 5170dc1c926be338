"""Draft-length policies on synthetic costs (no model): the budget policy's decisions, the cost
model's fits. Output-neutrality of every policy is proven in test_engine.py; this file proves
that the budget policy drafts when (and only when) the measured costs say it pays."""
from __future__ import annotations

import numpy as np
import pytest

from specrt.config import SamplingParams, SpecConfig
from specrt.policy import BudgetPolicy, CostModel
from specrt.policy.cost_model import nonneg_fit as _nonneg_fit
from specrt.policy.tuning import BudgetTuning
from specrt.step.scheduler import Request


def make_requests(n: int, rate: float = 0.9, prompt: int = 100, max_tokens: int = 256, history: int = 32):
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", list(range(prompt)), SamplingParams(max_tokens=max_tokens), seed=i)
        r.target_cached = r.draft_cached = prompt - 1     # decoding: the prompt is prefilled
        ones = int(round(rate * history))
        r.accept_history.extend([1] * ones + [0] * (history - ones))
        reqs.append(r)
    return reqs


def costs(verify=(3e-3, 5e-5, 0.0, 0.0), draft=(3e-4, 0.0, 0.0), plain_samples: int = 8) -> CostModel:
    """A CostModel fitted to exact samples of the given coefficients.
    verify: (intercept, per token, per context token, drafted jump[, per request]); draft: (per forward,
    per token fed, per context token attended)."""
    c = CostModel()
    v0, v1, v2, v3, v4 = (tuple(verify) + (0.0,))[:5]
    rng = np.random.default_rng(0)
    for i in range(64):
        drafted = i >= plain_samples
        requests = int(rng.integers(1, 9))
        tokens = requests + (int(rng.integers(1, 5 * requests)) if drafted else 0)
        ctx = int(rng.integers(100, 4000))
        if not drafted and i > 0:
            c._prev_drafted = False    # a run of plain steps: every one steady
        c.add_verify(tokens, ctx, v0 + v1 * tokens + v2 * ctx + v3 * drafted + v4 * requests, drafted=drafted,
                     requests=requests)
        depth, fed, att = int(rng.integers(1, 6)), int(rng.integers(1, 200)), int(rng.integers(100, 9000))
        c.add_draft(depth, fed, att, draft[0] * depth + draft[1] * fed + draft[2] * att)
    c.refit()
    return c


def policy(**kw) -> BudgetPolicy:
    return BudgetPolicy(SpecConfig(policy="budget", max_draft_length=kw.pop("k", 4), **kw))


def test_cost_model_recovers_the_coefficients():
    c = costs(verify=(3e-3, 5e-5, 1e-6, 1e-3, 2e-4), draft=(1e-3, 3e-5, 2e-7))
    assert np.allclose(c.verify_coef, [3e-3, 5e-5, 1e-6, 1e-3, 2e-4], rtol=1e-6, atol=1e-12)
    assert np.allclose(c.draft_coef, [1e-3, 3e-5, 2e-7], rtol=1e-6, atol=1e-12)
    assert c.verify_time(10, 1000, drafted=True, requests=2) == pytest.approx(3e-3 + 5e-4 + 1e-3 + 1e-3 + 4e-4)
    assert c.draft_time(2, 50, 400) == pytest.approx(2e-3 + 1.5e-3 + 8e-5)


def test_nonneg_fit_drops_columns_that_explain_nothing():
    rng = np.random.default_rng(1)
    a = rng.integers(1, 9, 200).astype(float)
    x = np.column_stack([a, 2 * a, rng.random(200)])       # column 1 is column 0 again
    y = 0.5 * a + 1e-9 * rng.random(200)
    coef = _nonneg_fit(x, y, always=[0], optional=[1, 2])
    assert coef[0] == pytest.approx(0.5, rel=1e-6) and coef[1] == 0 and coef[2] < 1e-6
    # a negative slope is never fitted: costs do not fall with more work
    y = 1.0 - 0.01 * x[:, 2]
    coef = _nonneg_fit(np.column_stack([np.ones(200), x[:, 2]]), y, always=[0], optional=[1])
    assert coef[1] == 0 and coef[0] > 0


def test_cheap_draft_and_good_acceptance_drafts_deep():
    c = costs(verify=(5e-3, 2e-5, 0, 0), draft=(2e-4, 0, 0))     # a draft forward is 4% of a verify
    ks = policy(k=6).plan(make_requests(2, rate=0.9), [6, 6], c)
    assert ks == [6, 6]


def test_draft_as_expensive_as_the_target_is_switched_off():
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(3e-3, 0, 0))
    for n in (1, 4, 32):
        assert policy().plan(make_requests(n, rate=0.8), [4] * n, c) == [0] * n


def test_big_batches_turn_speculation_off_when_verify_tokens_cost():
    """A verify whose cost grows with its tokens (compute-bound large batch) makes drafting
    lose even with a cheap draft; a small batch on the same costs still drafts."""
    c = costs(verify=(2e-3, 4e-4, 0, 0), draft=(3e-4, 0, 0))
    assert policy().plan(make_requests(32, rate=0.6), [4] * 32, c) == [0] * 32
    assert max(policy().plan(make_requests(1, rate=0.6), [4], c)) > 0


def test_drafted_step_jump_is_priced():
    """Drafting pays on the marginal costs, but a drafted step costs a fixed jump over a plain
    one (measured from plain steps): with a large enough jump speculation is off."""
    reqs = make_requests(1, rate=0.7)
    assert policy().plan(reqs, [4], costs(verify=(3e-3, 5e-5, 0, 0), draft=(6e-4, 0, 0)))[0] > 0
    assert policy().plan(reqs, [4], costs(verify=(3e-3, 5e-5, 0, 3e-3), draft=(6e-4, 0, 0))) == [0]


def test_catch_up_is_priced_against_the_tokens_left():
    """A draft that must first consume a long prompt pays only if enough tokens are left to
    amortise it; with no lag the same request drafts either way."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(6e-4, 4e-5, 0))
    many, few = make_requests(1, rate=0.8, max_tokens=2000), make_requests(1, rate=0.8, max_tokens=8)
    assert policy().plan(few, [4], c, catchup=[0])[0] > 0
    assert policy().plan(few, [4], c, catchup=[1500]) == [0]
    assert policy().plan(many, [4], c, catchup=[1500])[0] > 0


def test_exploration_only_when_optimism_could_pay():
    """A request kept at K=0 drafts one token every explore_every steps if a better acceptance
    than measured would pay; a drafter that cannot pay even at acceptance 0.97 is never run when
    it would cost a catch-up, and looked at once per explore_max steps when it would not."""
    pol = policy()
    reqs = make_requests(1, rate=0.5)
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(2.0e-3, 0, 0))  # pays above ~0.66 acceptance, not at 0.5
    ks = [pol.plan(reqs, [4], c)[0] for _ in range(3 * pol.tune.explore_every + 3)]
    explored = [i for i, k in enumerate(ks) if k]
    assert explored and all(ks[i] == 1 for i in explored)
    assert len(explored) == 3
    hopeless = costs(verify=(3e-3, 5e-5, 0, 0), draft=(6e-3, 4e-5, 0))
    pol, reqs = policy(), make_requests(1, rate=0.3)
    assert not any(pol.plan(reqs, [4], hopeless, catchup=[100])[0] for _ in range(600))
    # without catch-up to pay, one look every explore_max steps even so (the prices may be wrong)
    pol, reqs = policy(), make_requests(1, rate=0.3)
    looks = sum(pol.plan(reqs, [4], hopeless, catchup=[0])[0] for _ in range(600))
    assert looks == 600 // (pol.tune.explore_max + 1)


def test_looks_that_cost_a_catch_up_back_off():
    """A look whose draft must first consume the context (lag > 0) is dear: while looks keep
    finding that drafting does not pay, their interval doubles every two looks (up to x16);
    lag-free looks keep the plain interval."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(2.0e-3, 0, 0))  # pays above ~0.66 acceptance, not at 0.5
    counts = {}
    for lag in (0, 100):
        pol, reqs = policy(), make_requests(1, rate=0.5, max_tokens=100000)
        counts[lag] = sum(pol.plan(reqs, [4], c, catchup=[lag])[0] > 0 for _ in range(600))
    assert counts[0] == 600 // (BudgetTuning.explore_every + 1)
    assert 6 <= counts[100] <= 10      # 16, 16, 32, 32, 64, 64, 128, 128 steps apart


def test_plain_runs_keep_plain_steps_measured():
    """While every step drafts, the policy forces a short plain run now and then (soon at first)
    so the cost of a plain step stays measured."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(2e-4, 0, 0), plain_samples=0)
    pol, reqs = policy(), make_requests(2, rate=0.9)
    plain = []
    for i in range(40):
        ks = pol.plan(reqs, [4, 4], c)
        plain.append(not any(ks))
        c.add_verify(2 + sum(ks), 300, 3e-3, drafted=any(ks), requests=2)
    first = plain.index(True)
    assert first <= 8 and plain[first:first + pol.tune.plain_run] == [True] * pol.tune.plain_run
    assert c.num_plain >= 1 and sum(plain) < 15


def test_off_fast_path_decides_like_a_full_plan():
    """While speculation is off the plan is a lookup; it must give what a full plan gives."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(3e-3, 0, 0))
    pol, reqs = policy(), make_requests(4, rate=0.5)
    for _ in range(10):
        assert pol.plan(reqs, [4] * 4, c) == policy().plan(reqs, [4] * 4, c) == [0] * 4
    # a changed batch invalidates it
    assert pol.plan(make_requests(4, rate=1.0), [4] * 4, costs(verify=(3e-3, 5e-5, 0, 0), draft=(1e-4, 0, 0)))[0] > 0


def test_off_verdict_survives_churn_only_while_it_holds():
    """Requests come and go (continuous batching), n-gram caps and match classes flicker: while
    speculation is off the policy re-checks only newcomers and changed requests (bounds for the
    rest), and must still decide exactly like a full plan from scratch at every step, drafting as
    soon as a newcomer makes it pay."""
    rng = np.random.default_rng(3)
    fast = slow = 0
    for trial in range(12):
        c = costs(verify=(3e-3, 5e-5, float(rng.uniform(0, 2e-6)), float(rng.uniform(0, 2e-3))),
                  draft=(float(rng.uniform(4e-4, 2.5e-3)), float(rng.uniform(0, 2e-5)), 0))
        pol = policy()
        pol.tune.explore_every = pol.tune.explore_max = 10 ** 9     # exploration aside: the plan alone
        classes = {1: [200.0, 30.0], 4: [200.0, 190.0]}   # pooled acceptance by match length
        pol.evidence.class_counts = {k: list(v) for k, v in classes.items()}
        calls = {"fast": 0}
        still = pol._still_off

        def spy(*a, _still=still, **kw):
            out = _still(*a, **kw)
            calls["fast"] += out is not None
            return out
        pol._still_off = spy
        live, made = [], 0
        for step in range(60):
            if not live or rng.random() < 0.3:            # a request leaves, others arrive
                if live and rng.random() < 0.7:
                    live.pop(int(rng.integers(len(live))))
                for _ in range(int(rng.integers(1, 3))):
                    r = make_requests(1, rate=float(rng.choice([0.1, 0.3, 0.5, 0.95])),
                                      max_tokens=int(rng.integers(20, 400)))[0]
                    r.request_id = f"t{trial}-{made}"
                    made += 1
                    live.append(r)
            live = live[-12:]
            caps = [int(rng.choice([0, 2, 4])) for _ in live]
            lag = [int(rng.choice([0, 0, 150])) for _ in live]
            for r, cap in zip(live, caps):
                r.evidence_class = int(rng.choice([1, 4])) if cap else 0
            got = pol.plan(live, caps, c, catchup=lag)
            fresh = policy()
            # exploration aside here too (the requests' idle counters are shared with pol's plans)
            fresh.tune.explore_every = fresh.tune.explore_max = 10 ** 9
            fresh.evidence.class_counts = {k: list(v) for k, v in classes.items()}
            want = fresh.plan(live, caps, c, catchup=lag)
            assert got == want, (trial, step)
        fast += calls["fast"]
        slow += 60 - calls["fast"]
    assert fast > 100 and slow > 20     # both paths were exercised
    # the batch shrinks under a request that was priced at the big batch's throughput: alone it
    # pays (a verified token is cheap against a whole step), and its old verdict must not hold
    c = costs(verify=(2e-3, 4e-4, 0, 0), draft=(3e-4, 0, 0))
    pol, reqs = policy(), make_requests(32, rate=0.6)
    assert pol.plan(reqs, [4] * 32, c) == [0] * 32 and pol.plan(reqs, [4] * 32, c) == [0] * 32
    assert max(pol.plan(reqs[:1], [4], c)) > 0


def _serve(pol, batch_at, caps_at, c, steps: int):
    """The engine's loop: each step either sleeps (BudgetPolicy.dormant) or plans. Returns the
    steps that planned and each step's K."""
    planned, ks = [], []
    for step in range(steps):
        reqs = batch_at(step)
        if pol.dormant(len(reqs)):
            ks.append([0] * len(reqs))
        else:
            planned.append(step)
            ks.append(pol.plan(reqs, caps_at(step, reqs), c))
    return planned, ks


def test_acceptance_by_evidence_class():
    """The n-gram drafter reports how long a suffix matched; outcomes are pooled per match length
    and a request's expected acceptance leans on its current class: after 4-token matches were
    accepted 90% of the time and 1-token matches 15%, a fresh request with a 4-token match drafts
    deeper than one with a 1-token match (without the classes both would look the same)."""
    c = costs(verify=(3e-3, 2e-4, 0, 0), draft=(1e-6, 0, 0))
    pol = policy()
    feed = make_requests(2, rate=0.5)
    rng = np.random.default_rng(0)
    for _ in range(200):
        for r, cls, acc in ((feed[0], 4, 4 if rng.random() < 0.9 ** 4 else 1), (feed[1], 1, 0)):
            r.evidence_class = cls
            pol.observe(r, 4, acc)
    strong, weak = make_requests(2, rate=0.5, history=0)
    strong.evidence_class, weak.evidence_class = 4, 1
    ks = pol.plan([strong, weak], [4, 4], c)
    assert ks[0] > ks[1], ks
    weak.evidence_class = 4      # the same request, now after a long match
    assert pol.plan([strong, weak], [4, 4], c)[1] == ks[0]


def test_a_free_drafter_needs_a_smaller_margin():
    """A predicted gain of 6-8% pays for a drafter whose measured cost is negligible (n-gram: the
    verify side, measured every step, is all there is to misjudge) but not for a draft model
    whose forwards cost 3% of a step (its fitted costs carry the 10% margin)."""
    verify = (3e-3, 1.2e-3, 0, 0)
    got = {}
    for name, draft in (("free", (1e-7, 0, 0)), ("model", (1e-4, 0, 0))):
        pol = policy()
        ks = pol.plan(make_requests(1, rate=0.3), [4], costs(verify=verify, draft=draft))
        drafted, plain = pol.last_prediction
        assert 1.05 < drafted / plain < 1.09, (name, drafted / plain)
        got[name] = ks[0]
    assert got["free"] > 0 and got["model"] == 0


def test_a_vetoing_correction_is_re_measured():
    """Drafted steps delivered badly for a while (a slow stretch of a shared host): the measured
    correction vetoes plans the costs say pay. Every recheck_every steps one such plan runs and
    is tracked, so when drafted steps deliver again drafting is back within a recheck, not after
    the evidence fades; while they keep delivering badly, one drafted step per recheck_every.
    A plan that needs a catch-up is never run as a re-check."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(1e-3, 0, 0))
    for good_after in (None, 200):
        pol, reqs = policy(), make_requests(2, rate=0.8)
        pol.tune.explore_every = pol.tune.explore_max = 10 ** 9
        drafted = []
        for step in range(400):
            ks = pol.plan(reqs, [4, 4], c)
            drafted.append(any(ks))
            if pol.tracked:
                kind, tokens, secs, _ = pol.tracked
                bad = kind and (good_after is None or step < good_after)
                pol.step_done(emitted=tokens * (0.4 if bad else 1.0), seconds=secs)
        late = drafted[100:200]
        assert 100 // pol.tune.recheck_every - 1 <= sum(late) <= 100 // pol.tune.recheck_every + 1, sum(late)
        if good_after is None:
            assert sum(drafted[200:]) <= 200 // pol.tune.recheck_every + 1
        else:
            back = drafted[good_after:].index(True)
            assert back <= pol.tune.recheck_every and sum(drafted[good_after + back + 60:]) >= 100
    # the same veto with a lagging draft: exactly the steps a policy without re-checks drafts
    # (the pessimism fading back to the margin now and then)
    runs = []
    for every in (BudgetTuning.recheck_every, 10 ** 9):
        pol, reqs = policy(), make_requests(2, rate=0.8)
        pol.tune.explore_every = pol.tune.explore_max = 10 ** 9
        pol.tune.recheck_every = every
        runs.append([])
        for step in range(300):
            ks = pol.plan(reqs, [4, 4], c, catchup=[0, 0] if step < 20 else [50, 50])
            runs[-1].append(any(ks))
            if pol.tracked:
                kind, tokens, secs, _ = pol.tracked
                pol.step_done(emitted=tokens * (0.4 if kind else 1.0), seconds=secs)
    assert runs[0] == runs[1] and sum(runs[0][100:]) <= 200 // BudgetTuning.recheck_every


def test_an_off_policy_sleeps_but_not_through_news():
    """While speculation stays off, planning is skipped for longer and longer stretches (up to
    dormant_max steps); a batch down by a quarter wakes it at once (verification got cheaper),
    and a newcomer whose drafts pay is drafting within dormant_max + 1 steps of arriving."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(2.0e-3, 0, 0))   # pays above ~0.66 acceptance
    pol = policy()
    pol.tune.explore_every = pol.tune.explore_max = 10 ** 9
    reqs = make_requests(8, rate=0.3, max_tokens=100000)
    planned, ks = _serve(pol, lambda s: reqs, lambda s, r: [4] * len(r), c, 400)
    assert not any(map(any, ks))
    gaps = np.diff(planned)
    assert gaps.max() == pol.tune.dormant_max + 1 and len(planned) < 400 / 8
    # asleep: one request less of eight is no news, two less is
    assert pol._sleep > 0 and pol.dormant(7)
    assert not pol.dormant(6) and pol._sleep == 0
    # newcomers that make drafting pay, arriving at every phase of a sleep
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(5e-4, 0, 0))
    reqs = make_requests(4, rate=0.2, max_tokens=100000)
    good = make_requests(2, rate=0.95, max_tokens=100000)
    for i, g in enumerate(good):
        g.request_id = f"good{i}"
    assert policy().plan(reqs, [4] * 4, c) == [0] * 4 and min(policy().plan(reqs + good, [4] * 6, c)[4:]) > 0
    for arrive in range(400, 400 + pol.tune.dormant_max + 2):
        pol = policy()
        pol.tune.explore_every = pol.tune.explore_max = 10 ** 9
        planned, ks = _serve(pol, lambda s: reqs + (good if s >= arrive else []), lambda s, r: [4] * len(r), c,
                             arrive + pol.tune.dormant_max + 2)
        assert np.diff([p for p in planned if p < arrive]).max() == pol.tune.dormant_max + 1   # it was asleep
        first = next(s for s, k in enumerate(ks) if any(k))
        assert arrive <= first <= arrive + pol.tune.dormant_max and min(ks[first][4:]) > 0, arrive


def test_sleeping_keeps_exploration_in_steps():
    """Steps slept count as idle steps: a request that is only explored (drafting does not pay
    at its measured acceptance) is looked at about as often in steps as without sleeping."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(2.0e-3, 0, 0))
    reqs = make_requests(1, rate=0.5, max_tokens=100000)
    pol = policy()
    planned, ks = _serve(pol, lambda s: reqs, lambda s, r: [4], c, 1200)
    looks = [s for s, k in enumerate(ks) if k[0]]
    assert len(planned) < 1200 / 3
    # without sleeping: one look per explore_every + 1 steps; a look may wait for the next check
    assert 1200 // (pol.tune.explore_every + 1 + pol.tune.dormant_max) <= len(looks) <= 1200 // (pol.tune.explore_every + 1)


def _closed_form_tables(rates, ks, per_token, fixed_total, left, fill):
    """The prices in closed form (numpy): gains[b, k] = fill_b * sum_{i<=k} prod_{j<=i} r_b,j
    (rates [B, K+1] per position, column 0 unused); cost[b, k] = fill_b * k * per_token[b] + (k > 0)
    * the catch-up fixed_total[b] spread over the request's remaining steps at that k."""
    powers = np.cumprod(np.where(ks[None, :] > 0, rates[:, :len(ks)], 1.0), 1)
    gains = (np.cumsum(powers, 1) - 1.0) * fill[:, None]
    steps_left = np.maximum(left[:, None] / (1.0 + gains), 1.0)
    cost = (ks[None, :] * (per_token * fill)[:, None]
            + np.where(ks[None, :] > 0, fixed_total[:, None] / steps_left, 0.0))
    return gains, cost


def test_newcomer_row_matches_the_full_plan_tables():
    """The planner's per-request prices (what both the full plan and the off state's newcomer
    check use) equal the closed form: surplus over the threshold at each depth, and the cost
    reached."""
    from specrt.policy import planner, recent_acceptance

    pol, rng = policy(), np.random.default_rng(0)
    seen = make_requests(1)[0]
    for a in (0, 1, 4, 4, 3, 0, 2, 4):          # outcomes shape the per-position profile
        pol.observe(seen, 4, a)
    prof = pol.depth_profile()
    assert not np.allclose(prof[1:], 1.0)
    for _ in range(200):
        r = make_requests(1, rate=float(rng.random()), max_tokens=int(rng.integers(5, 300)))[0]
        r.policy_state.fill = float(rng.random())
        cap, lag, lam, depths = int(rng.integers(0, 5)), int(rng.integers(0, 300)), float(rng.random() * 2000), 5
        per_token, d_tok = float(rng.random() * 1e-3), float(rng.random() * 1e-4)
        row = planner.surplus_row(pol.price_request(r, cap, lag, 0.7, per_token, d_tok), cap, lam, depths)
        surplus, reach = row.surplus, row.reach
        ks = np.arange(depths)
        rate = recent_acceptance(r, pol.spec.acceptance_window, 0.7, pol.tune.prior_weight)
        g, c = _closed_form_tables(np.minimum(rate * prof[None, :depths], 0.99), ks, np.array([per_token]),
                                   np.array([d_tok * lag]), np.array([float(r.params.max_tokens - r.num_generated)]),
                                   np.array([r.policy_state.fill]))
        within = ks <= cap
        want = np.maximum.accumulate(np.maximum(np.where(within, g[0] - lam * c[0], 0.0), 0.0))
        assert np.allclose(surplus, want, rtol=1e-9, atol=1e-12)
        assert np.allclose(reach, np.maximum.accumulate(np.where(within, c[0], 0.0)), rtol=1e-9, atol=1e-15)


def test_plan_finds_the_best_allocation():
    """The plan's throughput search against brute force: over every K per request within
    [min_draft_length, cap], the best predicted tokens / step time from the plan's own price
    rows, with the step's fixed costs (a draft forward per depth, the drafted-step jump).
    Random costs, rates, caps, catch-ups and floors."""
    import itertools

    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(150):
        n = int(rng.integers(1, 6))
        K = int(rng.integers(1, 5))
        c = costs(verify=(3e-3, float(rng.uniform(0, 4e-4)), float(rng.uniform(0, 2e-6)), float(rng.uniform(0, 3e-3)),
                          float(rng.uniform(0, 1e-3))),
                  draft=(float(rng.uniform(1e-5, 2e-3)), float(rng.uniform(0, 4e-5)), float(rng.uniform(0, 1e-7))))
        floor_len = int(rng.integers(0, 2))
        reqs = []
        for i in range(n):
            r = make_requests(1, rate=float(rng.uniform(0.05, 0.98)), prompt=int(rng.integers(20, 400)),
                              max_tokens=int(rng.integers(8, 300)))[0]
            r.request_id = f"b{i}"
            reqs.append(r)
        caps = [int(rng.integers(0, K + 1)) for _ in range(n)]
        lag = [int(rng.choice([0, 0, 120])) for _ in range(n)]
        pol = policy(k=K, min_draft_length=floor_len)
        pol.tune.explore_every = pol.tune.explore_max = 10 ** 9
        rows = []
        price = pol.price_request

        def spy(*a, **kw):
            rows.append(price(*a, **kw))
            return rows[-1]
        pol.price_request = spy
        pol.plan(reqs, caps, c, catchup=lag)
        if not rows or pol.last_prediction is None:
            continue
        ctx = float(sum(r.context_len for r in reqs))
        t_ar = c.verify_time(n, ctx, drafted=False, requests=n)
        jump = max(c.verify_time(n, ctx, drafted=True, requests=n) - t_ar, 0.0)
        d_fwd = c.draft_coefs(n, ctx)[0]
        floor = [min(floor_len, cap) for cap in caps]
        best = 0.0
        for choice in itertools.product(*[range(f, cap + 1) for f, cap in zip(floor, caps)]):
            depth = max(choice)
            g = n + sum(rows[b].gains[k] for b, k in enumerate(choice))
            t = t_ar + sum(rows[b].costs[k] for b, k in enumerate(choice)) + d_fwd * depth + (jump if depth else 0.0)
            best = max(best, g / max(t, 1e-12))
        assert pol.last_prediction[0] == pytest.approx(best, rel=1e-9), trial
        checked += 1
    assert checked > 100


def test_min_draft_length_and_caps_are_respected():
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(3e-3, 0, 0))        # off on its own
    pol = policy(min_draft_length=2)
    reqs = make_requests(3, rate=0.5)
    assert pol.plan(reqs, [4, 1, 0], c) == [2, 1, 0]
    c = costs(verify=(5e-3, 2e-5, 0, 0), draft=(2e-4, 0, 0))
    assert policy(k=6).plan(make_requests(3, rate=0.95), [6, 2, 0], c) == [6, 2, 0]


def test_realized_throughput_overrules_an_optimistic_model():
    """The fit says drafting gains ~44%, but drafted steps deliver 40% of the predicted tokens:
    after some steps the policy stops drafting; a later return to form brings drafting back."""
    c = costs(verify=(3e-3, 5e-5, 0, 0), draft=(1e-3, 0, 0))
    pol, reqs = policy(), make_requests(2, rate=0.8)
    assert max(pol.plan(reqs, [4, 4], c)) > 0
    assert pol.last_prediction[0] / pol.last_prediction[1] == pytest.approx(1.44, abs=0.05)
    planned, explored = [], 0
    for _ in range(128):
        ks = pol.plan(reqs, [4, 4], c)
        if pol.tracked is None:                  # an exploration step (K=1, not the plan's choice)
            explored += 1
            continue
        kind, tokens, secs, _ = pol.tracked
        pol.step_done(emitted=tokens * (0.4 if kind else 1.0), seconds=secs)
        planned.append(any(ks))
    # off, but for a rare re-check once the faded evidence brings the corrected prediction back
    # to the margin (each re-check renews the evidence)
    assert planned[0] and sum(planned[-64:]) <= 2 and explored <= 128 // pol.tune.explore_every
    assert pol.correction(1, 2) < 0.8 and pol.correction(0, 2) == pytest.approx(1.0)
    assert pol.correction(1, 32) == 1.0          # another batch-size bucket: no evidence there
    # the pessimism decays while only plain steps are seen
    for _ in range(1500):
        pol.plan(reqs, [4, 4], c)
        if pol.tracked:
            pol.step_done(emitted=pol.tracked[1], seconds=pol.tracked[2])
    assert max(pol.plan(reqs, [4, 4], c)) > 0
