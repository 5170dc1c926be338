"""Token trees through the engine (specrt.drafters.tree, verify, commit) on the tiny test pair.

Properties proven here:
- the tree helpers: depths, the attention kernel's ancestor masks (a chain is plain causal), the
  candidate selection keeps every chosen node's ancestors;
- greedy: tree speculation == autoregressive output, for the model, feature and self:N drafters,
  batch 1-8, several node budgets and branchings, and tree steps really branch and accept more
  tokens per target forward than the chain of the same depth;
- coupled acceptance over trees == autoregressive sampling with the same seed;
- rejection over trees: the distribution of the first two generated tokens equals the target's
  (chi-square against the exact tables);
- requests with logit controls or log-probabilities draft chains, and still match;
- bad tree settings are refused naming the field.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import VOCAB, LLMCache, exact_tables, pair_for_tests, tokens  # noqa: E402

from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.drafters.tree import (MAX_TREE_NODES, TreeShape, _Candidates, ancestor_mask, chain_parents,  # noqa: E402
                                  node_depths)

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31], [40, 41, 42, 43, 44, 45, 46],
           [50] * 3 + [51] * 3, [60, 61, 62, 60, 61, 62, 60], [70]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory)


llm = LLMCache()


@pytest.fixture(scope="module")
def ar_greedy(pair):
    return tokens(llm(pair, "none").generate(PROMPTS, GREEDY))


# ------------------------------------------------------------------ helpers

def test_depths_and_masks():
    assert node_depths([-1, -1, 0, 0, 1, 2]) == [1, 1, 2, 2, 2, 3]
    assert ancestor_mask(chain_parents(7)) == [-1] * 7
    m = [x & (2 ** 64 - 1) for x in ancestor_mask([-1, -1, 0, 0, 1, 2])]
    # node 4 (parent 1): itself, node 1 three slots back, and everything before the tree (5+ back)
    assert m[4] & 0b11111 == 0b01001 and m[4] >> 5 == 2 ** 59 - 1
    # node 5 (parent 2, grandparent 0): itself, node 2 (3 back), node 0 (5 back)
    assert m[5] & 0b111111 == 0b101001
    with pytest.raises(ValueError, match="parent"):
        node_depths([-1, 1])
    with pytest.raises(ValueError, match="at most"):
        ancestor_mask(chain_parents(MAX_TREE_NODES + 1))


def test_selection_keeps_ancestors():
    rng = np.random.default_rng(0)
    for _ in range(50):
        c = _Candidates()
        c.add(-1, 1, 0.0, [1, 2, 3], list(np.log(rng.dirichlet(np.ones(3)))))
        for parent in range(12):
            c.add(parent, c.depths[parent] + 1, c.scores[parent], [4, 5], list(np.log(rng.dirichlet(np.ones(2)))))
        for budget in (1, 4, 9):
            toks, parents, _ = c.select(budget)
            assert len(toks) == budget
            node_depths(parents)         # every parent precedes its node: the selection is a tree


def test_tree_shape_is_checked():
    with pytest.raises(ValueError, match="branching"):
        TreeShape(4, branching=0)
    for field, value in (("tree", "bushy"), ("max_tree_nodes", 0), ("max_tree_nodes", 64), ("tree_branching", 0)):
        with pytest.raises(ValueError, match=field):
            SpecConfig(**{field: value})
    with pytest.raises(ValueError, match="tree"):
        SpecConfig(tree="dynamic", policy="confidence")


# ------------------------------------------------------------------ engine

@pytest.mark.parametrize("draft", ["model", "self:1"])
@pytest.mark.parametrize("nodes,branching", [(12, 4), (6, 2), (20, 3)])
def test_tree_greedy_equals_autoregressive(pair, ar_greedy, draft, nodes, branching):
    eng = llm(pair, draft, tree="fixed", max_tree_nodes=nodes, tree_branching=branching, max_draft_length=5)
    for batch in (1, 3, 8):
        got = tokens(eng.generate(PROMPTS[:batch], GREEDY))
        assert got == ar_greedy[:batch], f"draft={draft} nodes={nodes} batch={batch}"


def _per_forward(eng, prompts) -> float:
    """Tokens emitted per target forward over ``prompts`` (one request at a time)."""
    emitted = forwards = 0
    for p in prompts:
        eng.engine.reset_metrics()
        out = eng.generate([p], GREEDY)[0]
        forwards += eng.stats()["total"]["steps"]
        emitted += len(out.token_ids)
    return emitted / forwards


def test_trees_branch_and_accept_more_than_the_chain(pair):
    tree = llm(pair, "model", tree="fixed", max_tree_nodes=16, tree_branching=4, max_draft_length=4)
    chain = llm(pair, "model", tree="chain", max_draft_length=4)
    assert tree.engine.tree is not None and chain.engine.tree is None
    t, c = _per_forward(tree, PROMPTS), _per_forward(chain, PROMPTS)
    assert t > c, f"tree {t:.2f} tokens per forward, chain {c:.2f}"


def test_coupled_trees_equal_autoregressive_sampling(pair):
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=20, ignore_eos=True, seed=100 + i)
              for i in range(len(PROMPTS))]
    ar = tokens(llm(pair, "none", acceptance="coupled").generate(PROMPTS, params))
    for draft in ("model", "self:1"):
        eng = llm(pair, draft, acceptance="coupled", tree="fixed", max_tree_nodes=10, max_draft_length=4)
        assert tokens(eng.generate(PROMPTS, params)) == ar, draft


def test_controls_and_logprobs_draft_chains_and_match(pair):
    eng = llm(pair, "model", tree="dynamic", max_tree_nodes=10, max_draft_length=4)
    ar = llm(pair, "none")
    for params in (SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
                   SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)):
        assert tokens(eng.generate(PROMPTS[:4], params)) == tokens(ar.generate(PROMPTS[:4], params))


@pytest.mark.slow
def test_rejection_over_trees_is_exact(pair):
    """T=1, top-k 8 sampling over trees: the two tokens after the first (the prefill's, plain) come
    from a tree step of depth 2 and follow the target's exact tables given the first."""
    from _stats import P_PASS, chisquare_conditional, chisquare_gof

    tdir, _ = pair
    prompt = [5, 6, 7, 8]
    eng = llm(pair, "model", tree="fixed", max_tree_nodes=10, tree_branching=3, max_draft_length=3)
    n = 6000
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True, seed=7000 + i)
              for i in range(n)]
    outs = []
    for i in range(0, n, 500):
        outs += [o.token_ids for o in eng.generate([prompt] * 500, params[i:i + 500])]
    assert eng.stats()["total"]["accepted_tokens"] > 0          # the trees were really verified
    x0s, sizes = np.unique([o[0] for o in outs], return_counts=True)
    tested = 0
    for x0 in x0s[sizes >= 1000]:
        first, second = exact_tables(tdir, prompt + [int(x0)])
        joint = np.zeros((VOCAB, VOCAB))
        for o in outs:
            if o[0] == x0:
                joint[o[1], o[2]] += 1
        assert chisquare_gof(joint.sum(1), first)[1] > P_PASS, x0
        assert chisquare_conditional(joint, second)[1] > P_PASS, x0
        tested += 1
    assert tested >= 1


def test_lookup_branches_and_preemption_keep_greedy(pair, ar_greedy):
    """Prompt lookup in front of the draft (its matches drafted as chains inside a tree step), and a
    KV cache so small that tree steps preempt requests: the output is still autoregressive."""
    import specrt
    from specrt.models.kv_cache import kv_bytes_per_block
    from specrt.models import load_model

    tdir, ddir = pair
    eng = specrt.LLM(target=str(tdir), draft=f"{ddir}+ngram:1", seed=0,
                     spec=SpecConfig(tree="fixed", max_tree_nodes=8, max_draft_length=4))
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar_greedy
    cfg = load_model(tdir).config
    spec = SpecConfig(tree="fixed", max_tree_nodes=12, max_draft_length=4, block_size=4,
                      kv_cache_budget=30 * kv_bytes_per_block([cfg, cfg], 4, torch.float32))
    small = specrt.LLM(target=str(tdir), draft=str(ddir), seed=0, spec=spec)
    assert tokens(small.generate(PROMPTS, GREEDY)) == ar_greedy
    assert small.stats()["preemptions"] > 0
    assert small.engine.num_free_blocks() == small.engine.kv.num_blocks


def test_node_count_follows_the_row_cost():
    """select keeps the nodes whose expected acceptance repays their verify rows: all of them when
    rows are free, fewer as rows cost more, none when even the best is not worth one row."""
    c = _Candidates()
    c.add(-1, 1, 0.0, [1, 2, 3, 4], list(np.log([0.6, 0.2, 0.1, 0.05])))
    c.add(0, 2, c.scores[0], [5, 6], list(np.log([0.7, 0.2])))
    sizes = [len(c.select(6, TreeShape(4, row_costs=(rc,) * 6))[0]) for rc in (0.0, 0.05, 0.2, 0.5, 2.0)]
    assert len(c.select(6)[0]) == 6 and sizes == sorted(sizes, reverse=True) and sizes[-1] == 0
    # rows that get dearer (a compute-bound verify) stop the tree earlier than their first price says
    assert len(c.select(6, TreeShape(4, row_costs=(0.05, 0.05, 2.0, 2.0, 2.0, 2.0)))[0]) == 2
    toks, parents, expected = c.select(2)
    assert toks == [1, 5] and parents == [-1, 0] and expected == pytest.approx(0.6 + 0.42)


def test_verify_curve_interpolates():
    from specrt.policy.tree import VerifyCurve

    v = VerifyCurve()
    assert v.at(3) is None
    v.add(1, 1.0)
    v.add(5, 3.0)
    assert v.at(1) == 1.0 and v.at(3) == pytest.approx(2.0) and v.at(9) == pytest.approx(5.0)
    v.add(9, 3.0)                        # a flat stretch: rows there cost nothing more
    assert v.at(7) == pytest.approx(3.0) and v.at(12) == pytest.approx(3.0)


def _observe(p, ratio: float, n: int = 1) -> None:
    for _ in range(n):                   # a tree step at ``ratio`` times the plain speed
        p.observe(1.0, 1, 1, step_s=0.1 / ratio, verify_s=0.05, rows=3, plain_s=0.1, batch_size=1,
                  drafted=True, fed_context=False)


def test_planner_switches_off_and_tries_again():
    from specrt.policy import CostModel
    from specrt.policy.tree import OFF_BELOW, OFF_STEPS, PROBE_EVERY, TRIAL_STEPS, TreePlanner

    p = TreePlanner()
    assert p.plan(None, 1, 1, 10, 4, 8).draft
    _observe(p, 0.5, 80)                 # trees at half the plain speed: drafting goes off
    assert p.speedup < OFF_BELOW and not p.on
    drafts = [p.plan(None, 1, 1, 10, 4, 8).draft for _ in range(OFF_STEPS + TRIAL_STEPS)]
    assert not any(drafts[:OFF_STEPS - 1]) and all(drafts[OFF_STEPS:])   # off, then a trial
    _observe(p, 1.5, TRIAL_STEPS)        # the trial pays: back on
    assert p.on and p.calibration == pytest.approx(1.0)
    plain = sum(not p.plan(CostModel(), 1, 1, 10, 4, 8).draft for _ in range(2 * PROBE_EVERY))
    assert plain >= 2                    # plain probes keep the autoregressive time measured
    fixed = TreePlanner(adaptive=False)
    fixed.switch(1).on = False
    assert all(fixed.plan(None, 1, 1, 10, 4, 8).draft for _ in range(100))


def test_the_first_node_rule_does_not_stop_drafting_for_good():
    """A step whose first node cannot repay its row stays plain without a draft forward; the gain it
    is judged by is measured on drafted steps only, so after OFF_STEPS such steps a trial drafts
    and measures it again (before: one bad stretch stopped drafting for the engine's lifetime)."""
    from specrt.policy.tree import OFF_STEPS, TRIAL_STEPS, TreePlanner

    p = TreePlanner()
    p._costs = lambda *a: ([0.3] * 8, 0.1)       # a row and a level: 0.4 of a step
    p.gain = 0.05                                 # a stretch where almost nothing was accepted
    drafts = [p.plan(None, 1, 1, 10, 4, 8).draft for _ in range(OFF_STEPS + TRIAL_STEPS)]
    assert not any(drafts[:OFF_STEPS - 1]) and all(drafts[OFF_STEPS - 1:])
    for _ in range(TRIAL_STEPS):                  # the trial accepts well: the gain recovers, drafting stays
        p.observe(1.0, 2, 3, step_s=0.05, verify_s=0.04, rows=3, plain_s=0.1, batch_size=1,
                  drafted=True, fed_context=False)
    assert p.on and p.gain > 0.4 and p.plan(None, 1, 1, 10, 4, 8).draft


def test_dynamic_trees_keep_greedy_and_coupled(pair, ar_greedy):
    eng = llm(pair, "model", tree="dynamic", max_tree_nodes=16, max_draft_length=4)
    assert eng.engine.tree_planner.adaptive
    for _ in range(3):                   # long enough for the planner to size, probe and switch
        assert tokens(eng.generate(PROMPTS, GREEDY)) == ar_greedy


def test_planner_sized_trees_sample_what_plain_sampling_samples(pair):
    """Under the default acceptance ("rejection") a planner-sized tree verifies sampled requests
    with the coupled rule: a seeded request's tokens equal plain sampling with its seed, whatever
    sizes the planner picked (and so again on a second run of a changed planner)."""
    params = [SamplingParams(temperature=0.9, top_k=30, max_tokens=20, ignore_eos=True, seed=300 + i)
              for i in range(len(PROMPTS))]
    ar = tokens(llm(pair, "none").generate(PROMPTS, params))
    eng = llm(pair, "model", tree="dynamic", max_tree_nodes=10, max_draft_length=4)
    assert eng.engine.spec.acceptance == "rejection"
    for _ in range(2):
        assert tokens(eng.generate(PROMPTS, params)) == ar


def test_failed_trials_back_off_and_a_paying_one_resets():
    """Where drafting never pays, each failed trial doubles the plain stretch before the next (a
    trial every 48 steps cost a batch of 8 on one core a quarter of its steps); a trial that pays
    switches drafting on and the next off period starts short again."""
    from specrt.policy.tree import MAX_OFF_STEPS, OFF_STEPS, TRIAL_CHECK, TRIAL_STEPS, TreePlanner

    p = TreePlanner()
    _observe(p, 0.5, 80)                 # off
    gaps, trials, plain, run = [], [], 0, 0
    for _ in range(6 * MAX_OFF_STEPS):
        if p.plan(None, 1, 1, 10, 4, 8).draft:
            if plain:
                gaps.append(plain)
            plain, run = 0, run + 1
            _observe(p, 0.5, 1)          # every trial step at half the plain speed
        else:
            if run:
                trials.append(run)
            plain, run = plain + 1, 0
    assert gaps[:4] == [OFF_STEPS - 1, 2 * OFF_STEPS - 1, 4 * OFF_STEPS - 1, 8 * OFF_STEPS - 1]
    assert max(gaps) == MAX_OFF_STEPS - 1
    assert set(trials) == {TRIAL_CHECK + 1} and TRIAL_CHECK + 1 < TRIAL_STEPS   # hopeless trials end early
    while not p.plan(None, 1, 1, 10, 4, 8).draft:
        pass
    _observe(p, 1.5, TRIAL_STEPS)        # this trial pays: on, and the off period is short again
    assert p.on and p.switch(1).off_steps == OFF_STEPS


def test_on_and_off_are_kept_per_load():
    """Drafting that pays for one request and not for eight: each load keeps its own decision, so a
    batch of eight does not inherit one request's 'on' (nor one request the batch's 'off')."""
    from specrt.policy.tree import OFF_BELOW, TreePlanner, load_bucket

    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 2, 3, 3, 4, 4, 5, 6]
    p = TreePlanner()

    def step(batch: int, ratio: float) -> None:
        p.plan(None, batch, batch, 10 * batch, 4, 8)
        p.observe(1.0, 1, batch, step_s=0.1 / ratio, verify_s=0.05, rows=2 * batch, plain_s=0.1, batch_size=batch,
                  drafted=True, fed_context=False)

    for _ in range(80):
        step(1, 1.4)
        step(8, 0.6)
    assert p.switch(1).on and p.switch(1).speedup > 1.2
    assert not p.switch(8).on and p.switch(8).speedup < OFF_BELOW
    assert p.plan(None, 1, 1, 10, 4, 8).draft and not p.plan(None, 8, 8, 80, 4, 8).draft


def test_a_load_never_run_plain_is_measured_plain_first():
    """Before drafting at a load the planner has no plain step for, it runs one plain: the baseline a
    tree step must beat (before, the first trees at 8 in flight were judged against the verify curve's
    flat guess below its first count and stayed on for 35 steps at ~0.6x)."""
    from specrt.policy import CostModel
    from specrt.policy.tree import TreePlanner

    p, costs = TreePlanner(), CostModel()
    assert not p.plan(costs, 8, 8, 80, 4, 8).draft
    p.observe(0.0, 0, 8, step_s=0.014, verify_s=0.014, rows=8, plain_s=None, batch_size=8, drafted=False,
              fed_context=False)
    assert p.plan(costs, 8, 8, 80, 4, 8).draft
    assert not p.plan(costs, 4, 4, 40, 4, 8).draft       # another load: its own plain step first


def test_nodes_are_priced_by_the_rows_the_whole_batch_adds():
    """A request's (n+1)-th node costs the average row of the block of rows every request's (n+1)-th
    node adds (b(n+1) .. b(n+2)); one block past the largest verified count follows the last slope,
    blocks past that are not bought at all until a step has verified them."""
    import math

    from specrt.policy.tree import TreePlanner

    p = TreePlanner()
    for rows, s in ((1, 0.009), (8, 0.014), (16, 0.022)):
        p.curve.add(rows, s)
    assert p._node_row(8, 0, 16) == pytest.approx((0.022 - 0.014) / 8)     # rows 9-16: measured
    assert p._node_row(8, 1, 16) == pytest.approx(0.001)                   # rows 17-24: along the last slope
    assert p._node_row(8, 2, 16) == math.inf                                # rows 25-32: never verified here
    assert p._node_row(1, 0, 16) == pytest.approx(0.005 / 7)               # row 2: between 1 and 8
    assert p._node_row(1, 15, 16) == pytest.approx(0.001) and p._node_row(1, 16, 16) == math.inf


def test_a_losing_trial_ends_early():
    """A trial whose steps after the catch-up average below TRIAL_GIVE_UP (here 0.9x, where the old
    bar was 0.85x) can hardly reach ON_ABOVE over TRIAL_STEPS: it ends after TRIAL_CHECK of them (at
    8 in flight such trials were the largest cost of the default engine)."""
    from specrt.policy.tree import TRIAL_CHECK, TreePlanner

    p = TreePlanner()
    _observe(p, 0.5, 80)                 # off
    while not p.plan(None, 1, 1, 10, 4, 8).draft:
        pass
    _observe(p, 0.9, TRIAL_CHECK + 1)
    assert p.switch(1).trial is None and not p.on


def test_a_noisy_paying_trial_is_not_given_up():
    """One request's step ratios swing with each step's acceptance (~0.65 when nothing is accepted,
    ~1.3 / ~2 for one / two): four misses and a hit after the catch-up are bad luck, not a load
    where drafting cannot pay (at a 0.85 or 0.95 bar on the mean alone, about one trial in five
    failed so at batch 1, and the doubling off periods then kept the model drafter off for a run)."""
    from specrt.policy.tree import TRIAL_STEPS, TreePlanner

    p = TreePlanner()
    _observe(p, 0.5, 80)                 # off
    while not p.plan(None, 1, 1, 10, 4, 8).draft:
        pass
    ratios = [0.8, 0.65, 0.65, 0.65, 0.65, 1.3] + [2.0, 1.3, 0.65, 2.0, 2.0] * 2   # mean 1.24
    assert len(ratios) == TRIAL_STEPS
    for r in ratios:
        assert p.switch(1).trial is not None
        _observe(p, r)
    assert p.switch(1).trial is None and p.on


def test_a_trial_waits_until_its_catch_up_is_affordable():
    """A trial's first step pays the draft's catch-up over everything decoded while off (at 32 in
    flight ~1,400-2,900 tokens, ~0.25-0.7 s, several plain steps): it begins only once that costs at
    most TRIAL_SHARE of the plain time waited at the load since the last trial (or of the plain
    time the batch still has ahead); a cheap catch-up starts on time (before, a trial every 48-96
    steps cost a batch of 32 ~5% against plain decoding)."""
    from specrt.policy.tree import OFF_STEPS, TRIAL_SHARE, TreePlanner

    def plain_step(p, s=0.1):
        p.observe(0.0, 0, 1, step_s=s, verify_s=s, rows=1, plain_s=None, batch_size=1, drafted=False,
                  fed_context=False)

    def run(catchup_s: float, ahead_s: float = 0.0) -> int:
        """Plain steps (0.1 s each) until the trial's first drafted step."""
        p = TreePlanner()
        _observe(p, 0.5, 80)                 # off
        n = 0
        while not p.plan(None, 1, 1, 10, 4, 8, catchup_s=catchup_s, ahead_s=ahead_s).draft:
            plain_step(p)
            n += 1
            assert n < 10_000
        return n

    assert run(0.0) == OFF_STEPS - 1                     # no catch-up: as before
    cheap = 0.99 * TRIAL_SHARE * 0.1 * (OFF_STEPS - 1)   # just affordable at the usual time
    assert run(cheap) == OFF_STEPS - 1
    dear = 0.7                                           # needs 0.7 / TRIAL_SHARE = 35 s of plain steps
    assert run(dear) == pytest.approx(dear / TRIAL_SHARE / 0.1, abs=1)
    assert run(dear, ahead_s=dear / TRIAL_SHARE) == OFF_STEPS - 1   # a long way ahead pays for it


def test_the_first_drafted_step_at_a_load_is_gated_like_a_trial():
    """A load that never drafted starts 'on'; its first drafted step pays the catch-up over every
    prompt in the batch: it must cost at most FIRST_SHARE of the plain time ahead (or TRIAL_SHARE of
    the time waited); later ones (on, measured) are not gated."""
    from specrt.policy.tree import TreePlanner

    p = TreePlanner()
    assert not p.plan(None, 32, 32, 3200, 4, 8, catchup_s=0.7, ahead_s=7.5).draft     # 32 prompts, 64 tokens ahead
    assert p.plan(None, 32, 32, 3200, 4, 8, catchup_s=0.7, ahead_s=40.0).draft       # 340 tokens ahead
    q = TreePlanner()
    assert not q.plan(None, 1, 1, 1000, 4, 8, catchup_s=0.23, ahead_s=0.64).draft    # a long prompt, 64 tokens ahead
    assert q.plan(None, 1, 1, 100, 4, 8, catchup_s=0.023, ahead_s=0.96).draft        # one prompt, 96 tokens ahead
    _observe(q, 1.4, 3)
    assert q.plan(None, 1, 1, 100, 4, 8, catchup_s=0.5, ahead_s=0.1).draft           # on and measured: no gate
