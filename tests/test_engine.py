"""The speculative engine on a tiny random target/draft pair (CPU).

Properties proven here (docs/architecture.md sections 3 and 4):
- greedy: speculative output == autoregressive output, every drafter and policy,
  batches of 1-8 mixed-length prompts, overlap on and off;
- coupled acceptance: sampled output == autoregressive sampling with the same
  seed, for every drafter, policy, K and batch;
- rejection acceptance: the same request + seed + draft lengths gives the same
  tokens alone or in any batch and with overlap on/off; the distribution of the
  first generated tokens equals autoregressive sampling (chi-square);
- preemption when the KV cache runs out resumes with the same tokens, and every
  block is returned at the end;
- bad input is refused with a clear error while other requests keep running.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import EOS, VOCAB, LLMCache, pair_for_tests, tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31], [40, 41, 42, 43, 44, 45, 46],
           [50] * 3 + [51] * 3, [60, 61, 62, 60, 61, 62, 60], [70]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory, accept_head=True)


llm = LLMCache()


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ar_greedy(pair):
    return tokens(llm(pair, "none").generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("draft", ["model", "ngram", "self:1"])
@pytest.mark.parametrize("policy", ["fixed", "confidence", "head", "budget"])
def test_greedy_equals_autoregressive(pair, ar_greedy, draft, policy):
    if policy == "head" and draft != "model":
        pytest.skip("the head policy needs a draft model's hidden states")
    eng = llm(pair, draft, policy=policy, max_draft_length=4)
    for batch in (1, 3, 8):
        got = tokens(eng.generate(PROMPTS[:batch], GREEDY))
        assert got == ar_greedy[:batch], f"draft={draft} policy={policy} batch={batch}"


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_overlap_and_k(pair, ar_greedy, overlap):
    for k in (1, 2, 6):
        got = tokens(llm(pair, "model", max_draft_length=k, overlap=overlap).generate(PROMPTS, GREEDY))
        assert got == ar_greedy
        # the target as its own draft: every draft and every bonus guess is right, so with overlap
        # nearly every round runs on the pre-draft made while the previous round verified
        eng = llm(pair, str(pair[0]), max_draft_length=k, overlap=overlap)
        assert tokens(eng.generate(PROMPTS, GREEDY)) == ar_greedy
        snap = eng.stats()
        if overlap:
            assert snap["overlap_pre_drafts_used"] >= 0.8 * snap["overlap_pre_drafts"] > 0
        else:
            assert snap["overlap_pre_drafts"] == 0


def test_lagging_draft_keeps_target_prefix_sharing(pair, ar_greedy):
    """A request that never drafted leaves the draft's KV of its prefix unwritten. The next
    request with that prefix must still reuse the target's cached blocks, recompute the draft's
    (its catch-up), decode exactly the autoregressive tokens, and after it the blocks hold the
    draft's KV too (a third request reuses them for both)."""
    tdir, ddir = pair
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=3, block_size=4, tree="fixed", lookup=None),
                      seed=0)           # drafts every step once allowed (the planner may judge this pair not worth it)
    eng = llm_.engine
    seen = []
    alloc = eng.scheduler.try_allocate

    def spy(req):
        ok = alloc(req)
        seen.append((req.target_cached, req.draft_cached))
        return ok
    eng.scheduler.try_allocate = spy
    plan = eng.policy.plan
    eng.policy.plan = lambda reqs, caps, costs=None, catchup=None: [0] * len(reqs)   # speculation off
    first = tokens(llm_.generate([PROMPTS[0]], GREEDY))
    eng.policy.plan = plan
    second = tokens(llm_.generate([PROMPTS[0]], GREEDY))
    third = tokens(llm_.generate([PROMPTS[0]], GREEDY))
    assert first == second == third == [ar_greedy[0]]
    assert seen[0] == (0, 0)
    assert seen[1] == (16, 0)          # 4 blocks of 4 reused by the target, none by the draft
    assert seen[2] == (16, 16)         # the second request's draft wrote them
    assert llm_.stats()["total"]["drafted_tokens"] > 0


def test_requests_sharing_a_lagging_prefix_catch_up_together(pair, ar_greedy):
    """Several requests of one batch reuse the same target-only blocks: their drafts recompute
    those blocks in the same forward (the same slots, the same tokens). That must write each
    slot once, decode the autoregressive tokens, and never fail with a duplicate slot."""
    tdir, ddir = pair
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=3, block_size=4, tree="fixed", lookup=None),
                        seed=0)
    eng = llm_.engine
    plan = eng.policy.plan
    eng.policy.plan = lambda reqs, caps, costs=None, catchup=None: [0] * len(reqs)   # speculation off
    assert tokens(llm_.generate([PROMPTS[0]], GREEDY)) == [ar_greedy[0]]
    eng.policy.plan = plan
    got = tokens(llm_.generate([PROMPTS[0]] * 3 + [PROMPTS[1]], GREEDY))
    assert got == [ar_greedy[0]] * 3 + [ar_greedy[1]]
    assert llm_.stats()["total"]["drafted_tokens"] > 0
    # a slot shared by two rows with DIFFERENT tokens is a real bug and still refused
    from specrt.models.attention import AttentionMetadata

    meta = AttentionMetadata.build([4, 4], [4, 4], [[3], [3]], 4, token_ids=[1, 2, 3, 4] * 2)
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="slot"):
        AttentionMetadata.build([4, 4], [4, 4], [[3], [3]], 4, token_ids=[1, 2, 3, 4, 1, 2, 3, 5])


def test_calibrate_seeds_both_step_kinds_and_leaves_no_trace(pair, ar_greedy):
    """warmup() of a budget engine calibrates: the cost model then holds steady plain and drafted
    samples of both batch sizes, while metrics, queues, outputs and KV blocks are as before."""
    tdir, ddir = pair
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(policy="budget", max_draft_length=3), seed=0)
    eng = llm_.engine
    free = eng.num_free_blocks()
    before = llm_.stats()["total"]
    eng.calibrate(batch_sizes=(1, 3))
    assert llm_.stats()["total"] == before
    assert not eng.has_unfinished() and eng.num_free_blocks() == free and not eng._finished_pending
    samples = eng.costs.verify_samples
    assert eng.costs.num_plain >= 4 and sum(s[2] for s in samples) >= 8
    assert {s[0] for s in samples if s[2]} >= {1 + 3, 3 + 9}          # drafted: batch + K per request
    assert len(eng.costs.draft_samples) >= 8
    assert tokens(llm_.generate(PROMPTS[:3], GREEDY)) == ar_greedy[:3]
    eng.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.calibrate()


def test_ngram_proposals_are_known_when_planning(pair, ar_greedy):
    """With the n-gram drafter the policy plans with each request's actual proposal length as
    its cap (0 without a match, and 0 on a step that feeds the prompt: its rows run as without a
    drafter), and drafts are prefixes of those proposals: same tokens as AR."""
    from specrt.drafters import NgramProposer
    from specrt.step.verify import feeds_context

    tdir, _ = pair
    llm_ = specrt.LLM(target=str(tdir), draft="ngram", spec=SpecConfig(policy="budget", max_draft_length=4), seed=0)
    eng = llm_.engine
    seen = []
    plan = eng.policy.plan

    def spy(reqs, caps, costs=None, catchup=None):
        seen.append([(list(r.token_ids), c, r.params.max_tokens - r.num_generated - 1, feeds_context(r))
                     for r, c in zip(reqs, caps)])
        return plan(reqs, caps, costs, catchup)
    eng.policy.plan = spy
    assert tokens(llm_.generate(PROMPTS[:4], GREEDY)) == ar_greedy[:4]
    prop = NgramProposer()
    caps = [c for step in seen for _, c, _, _ in step]
    assert 0 in caps and max(caps) > 0
    assert any(prefill for step in seen for *_, prefill in step)
    for step in seen:
        for ids, c, remaining, prefill in step:
            assert c == (0 if prefill else len(prop.propose(ids, max(0, min(4, remaining)))))


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_a_dormant_policy_is_not_asked_to_plan(pair, ar_greedy, draft):
    """A step the policy sleeps through (BudgetPolicy.dormant) drafts nothing and skips the plan
    (no caps, no catch-up sums); the output stays autoregressive. The n-gram drafter's caps come
    and go every step, so an n-gram engine plans every step and never asks."""
    tdir, ddir = pair
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir) if draft == "model" else "ngram",
                      spec=SpecConfig(policy="budget", max_draft_length=4), seed=0)
    eng = llm_.engine
    asked, planned, drafted = [], [], []
    plan, max_k = eng.policy.plan, eng._max_k

    def dormant(n):
        asked.append(n)
        return len(asked) % 3 != 0          # two steps of three asleep

    def spy(reqs, max_ks, costs=None, catchup=None):
        planned.append(len(asked))
        return plan(reqs, max_ks, costs, catchup)

    def spy_max_k(r):
        drafted.append(len(asked))
        return max_k(r)
    eng.policy.dormant, eng.policy.plan, eng._max_k = dormant, spy, spy_max_k
    assert tokens(llm_.generate(PROMPTS[:4], GREEDY)) == ar_greedy[:4]
    if draft == "ngram":
        assert not asked and planned
    else:
        assert asked and all(a % 3 == 0 for a in planned) and len(planned) == len(asked) // 3
        assert set(drafted) <= set(planned)


@pytest.mark.parametrize("sizes", [(1, 4), (2, 3), (1, 1)])
def test_ngram_index_equals_the_scan(sizes):
    """The n-gram drafter's per-request index (extended as the context grows) proposes exactly
    what a scan of the whole context finds, for growing contexts, any k, small and large
    vocabularies (many and few matches), and rebuilds when the context got shorter or its
    last indexed token changed (a regenerated tail). It reports the length of the suffix it
    matched (state.match_n, 0 without a match)."""
    import random

    from specrt.drafters import NgramProposer, NgramState

    prop = NgramProposer(*sizes)

    def match_len(ctx):       # the longest suffix (min_n..max_n) that occurs earlier, 0 if none
        L = len(ctx)
        for n in range(min(prop.max_n, L - 1), prop.min_n - 1, -1):
            if any(ctx[s:s + n] == ctx[L - n:] for s in range(L - n)):
                return n
        return 0
    rnd = random.Random(sum(sizes))
    for _ in range(150):
        vocab = rnd.choice([2, 3, 5, 50])
        ctx = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 5))]
        state = NgramState()
        for _ in range(40):
            k = rnd.randrange(0, 6)
            assert prop.propose(ctx, k, state) == prop._scan(ctx, k), (ctx, k)
            if k:    # the match length the budget policy pools acceptance by
                assert state.match_n == match_len(ctx), ctx
            ctx = ctx + [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 4))]
        shorter = ctx[:rnd.randrange(1, len(ctx) + 1)]
        assert prop.propose(shorter, 3, state) == prop._scan(shorter, 3)
        changed = shorter[:-2] + [vocab] + [rnd.randrange(vocab)]   # token `vocab` never seen before
        if len(changed) >= 2:
            assert prop.propose(changed, 3, state) == prop._scan(changed, 3)


def test_speculation_actually_accepts(pair):
    """The layer-init draft must agree with the target often enough that steps emit >1 token,
    otherwise the identity tests above would pass vacuously."""
    out = llm(pair, "model", max_draft_length=4).generate(PROMPTS, GREEDY)
    accepted = sum(o.metrics["accepted_tokens"] for o in out)
    emitted = sum(o.metrics["emitted_tokens"] for o in out)
    steps = sum(o.metrics["steps"] for o in out)
    assert accepted > 0 and emitted == sum(len(o.token_ids) for o in out)
    assert emitted / steps > 1.05


SAMPLED = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=20, ignore_eos=True, seed=s)
           for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (0.0, 0, 1.0),
                                          (1.0, 5, 0.8), (0.5, 0, 1.0), (1.0, 0, 1.0), (2.0, 50, 0.95)])]


@pytest.fixture(scope="module")
def ar_sampled(pair):
    return tokens(llm(pair, "none").generate(PROMPTS, SAMPLED))


@pytest.mark.parametrize("draft", ["model", "ngram", "self:1"])
@pytest.mark.parametrize("policy", ["fixed", "confidence", "budget"])
def test_coupled_equals_autoregressive_sampling(pair, ar_sampled, draft, policy):
    eng = llm(pair, draft, policy=policy, acceptance="coupled", max_draft_length=3)
    assert tokens(eng.generate(PROMPTS, SAMPLED)) == ar_sampled
    # alone, in another order, in a smaller batch: still the same tokens
    assert tokens(eng.generate(PROMPTS[5:6], SAMPLED[5:6])) == ar_sampled[5:6]
    rev = eng.generate(PROMPTS[::-1], SAMPLED[::-1])
    assert tokens(rev) == ar_sampled[::-1]


@pytest.mark.parametrize("k", [1, 5])
def test_coupled_any_k_and_overlap(pair, ar_sampled, k):
    for overlap in (False, True):
        eng = llm(pair, "model", acceptance="coupled", max_draft_length=k, overlap=overlap)
        assert tokens(eng.generate(PROMPTS, SAMPLED)) == ar_sampled


def test_rejection_batch_invariance_and_overlap(pair):
    """Under rejection sampling tokens may depend on K and the tree's shape, but not on batch
    neighbours, slot or overlap (overlap drafts chains: the comparison is chain against chain)."""
    eng = llm(pair, "model", max_draft_length=3, tree="chain")
    full = tokens(eng.generate(PROMPTS, SAMPLED))
    for i in (0, 4, 7):
        assert tokens(eng.generate([PROMPTS[i]], [SAMPLED[i]])) == [full[i]]
    assert tokens(eng.generate(PROMPTS[::-1], SAMPLED[::-1])) == full[::-1]
    assert tokens(llm(pair, "model", max_draft_length=3, overlap=True, tree="chain").generate(PROMPTS, SAMPLED)) == full
    trees = llm(pair, "model", max_draft_length=3)          # fixed trees: the same per-request shapes
    tree_full = tokens(trees.generate(PROMPTS, SAMPLED))
    for i in (0, 4, 7):
        assert tokens(trees.generate([PROMPTS[i]], [SAMPLED[i]])) == [tree_full[i]]
    assert tokens(trees.generate(PROMPTS[::-1], SAMPLED[::-1])) == tree_full[::-1]
    # continuous batching: requests joining mid-run do not change anyone's tokens
    e = eng.engine
    rid0 = e.add_request(PROMPTS[0], SAMPLED[0])
    done = {}
    for step in range(200):
        if step == 2:
            rid1 = e.add_request(PROMPTS[1], SAMPLED[1])
        if step == 4:
            rid2 = e.add_request(PROMPTS[2], SAMPLED[2])
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if len(done) == 3:
            break
    assert [done[rid0], done[rid1], done[rid2]] == full[:3]


def _first_tokens(eng, n, temperature=1.0, top_k=6, tokens_per_req=3, seed0=0):
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=tokens_per_req, ignore_eos=True,
                             seed=seed0 + i) for i in range(n)]
    return [o.token_ids for o in eng.generate([PROMPTS[1]] * n, params)]


@pytest.mark.parametrize("draft", ["model", "ngram", "self:1"])
def test_sampling_distribution_matches_autoregressive(pair, draft):
    """Chi-square (two-sample) on each of the first 3 tokens: speculative (rejection) vs autoregressive.
    Distinct seed sets: the two runs are independent samples."""
    from scipy.stats import chi2_contingency

    n = 1500
    ar = _first_tokens(llm(pair, "none", max_batch_size=256), n, seed0=10_000)
    sp = _first_tokens(llm(pair, draft, max_batch_size=256, max_draft_length=3), n, seed0=50_000)
    for pos in range(3):
        a = torch.bincount(torch.tensor([t[pos] for t in ar]), minlength=VOCAB)
        b = torch.bincount(torch.tensor([t[pos] for t in sp]), minlength=VOCAB)
        keep = (a + b) > 0
        table = torch.stack([a[keep], b[keep]]).numpy()
        p = chi2_contingency(table)[1]
        assert p > 1e-4, f"draft={draft} token {pos}: p={p:.2e}"


def test_sampling_distribution_test_has_power(pair):
    """The chi-square above must reject a slightly different distribution (top-k 6 vs 5: one
    token's mass moved to the others). Subtler sampler bugs are caught by the kernel-level
    exactness tests (tests/test_sampling_exactness.py) with far more draws."""
    from scipy.stats import chi2_contingency

    eng = llm(pair, "none", max_batch_size=256)
    a = _first_tokens(eng, 1500, top_k=6, seed0=10_000)
    b = _first_tokens(eng, 1500, top_k=5, seed0=50_000)
    x = torch.bincount(torch.tensor([t[0] for t in a]), minlength=VOCAB)
    y = torch.bincount(torch.tensor([t[0] for t in b]), minlength=VOCAB)
    keep = (x + y) > 0
    assert chi2_contingency(torch.stack([x[keep], y[keep]]).numpy())[1] < 1e-6


def test_preemption_resumes_with_same_tokens(pair, ar_sampled):
    tdir, ddir = pair
    # 12 blocks of 4 tokens for 8 requests of up to 38 tokens: preemption is unavoidable
    from specrt.models import load_model
    from specrt.models.kv_cache import kv_bytes_per_block

    cfgs = [load_model(tdir).config, load_model(ddir).config]
    budget = 12 * kv_bytes_per_block(cfgs, 4, torch.float32)
    eng = specrt.LLM(target=str(tdir), draft=str(ddir),
                     spec=SpecConfig(acceptance="coupled", max_draft_length=3, block_size=4, kv_cache_budget=budget))
    out = eng.generate(PROMPTS, SAMPLED)
    assert tokens(out) == ar_sampled
    assert eng.stats()["preemptions"] > 0
    assert eng.engine.num_free_blocks() == eng.engine.kv.manager.num_blocks


def test_request_too_big_for_cache_fails_cleanly(pair):
    tdir, _ = pair
    from specrt.models import load_model
    from specrt.models.kv_cache import kv_bytes_per_block

    budget = 3 * kv_bytes_per_block([load_model(tdir).config], 4, torch.float32)
    eng = specrt.LLM(target=str(tdir), spec=SpecConfig(block_size=4, kv_cache_budget=budget))
    out = eng.generate([[5] * 40, [6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out[0].finish_reason == "error" and "KV cache" in out[0].error
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 4


def test_stop_conditions(pair):
    eng = llm(pair, "model", max_draft_length=4)
    base = eng.generate([PROMPTS[0]], GREEDY)[0]
    # max_tokens
    assert len(eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
               .token_ids) == 5
    # a stop string cuts the text before it
    words = base.text.split()
    stop = words[3]
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text and base.text.startswith(out.text.rstrip())
    # EOS stops unless ignored; min_tokens forbids it early
    outs = eng.generate([PROMPTS[1]] * 64, [SamplingParams(temperature=1.5, max_tokens=30, seed=s) for s in range(64)])
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] == EOS and EOS not in o.token_ids[:-1] for o in stopped)
    outs = eng.generate([PROMPTS[1]] * 64, [SamplingParams(temperature=1.5, max_tokens=30, min_tokens=12, seed=s)
                                            for s in range(64)])
    assert all(EOS not in o.token_ids[:12] for o in outs)


def test_bad_input_keeps_engine_serving(pair, tmp_path):
    eng = llm(pair, "model", max_draft_length=2)
    e = eng.engine
    good = e.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2 ** 70)
    with pytest.raises(ValueError, match="empty"):
        e.add_request([], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        e.add_request("", GREEDY)
    with pytest.raises(ValueError, match="context"):
        e.add_request([5] * 600, GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        e.add_request([5, VOCAB + 3], GREEDY)
    with pytest.raises(ValueError, match="policy"):
        SpecConfig(policy="magic")
    done = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o
    assert done[good].finish_reason == "length" and len(done[good].token_ids) == 24


def test_draft_with_other_vocabulary_is_refused(pair, tmp_path):
    tdir, _ = pair
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(str(other))
    with pytest.raises(ValueError, match="vocab"):
        specrt.LLM(target=str(tdir), draft=str(other))


def test_abort_frees_blocks_and_streaming(pair):
    eng = llm(pair, "model", max_draft_length=3)
    e = eng.engine
    rid = e.add_request(PROMPTS[0], GREEDY)
    e.step()
    e.abort_request(rid)
    outs = e.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert e.num_free_blocks() == e.kv.manager.num_blocks
    pieces = list(eng.generate_stream([PROMPTS[2]], GREEDY))
    assert pieces[-1].finished
    assert sum((p.new_token_ids for p in pieces), []) == pieces[-1].token_ids


def test_metrics_and_prometheus(pair):
    eng = llm(pair, "model", max_draft_length=4)
    eng.generate(PROMPTS[:4], GREEDY, tags=["code", "code", "chat", "chat"])
    snap = eng.stats()
    assert set(snap["by_tag"]) >= {"code", "chat"}
    tot = snap["total"]
    assert 0 <= tot["draft_hit_rate"] <= 1 and tot["tokens_per_target_forward"] >= 1
    assert len(tot["acceptance_rate_per_position"]) == 4     # a tree's depths (max_draft_length)
    text = eng.engine.metrics.prometheus()
    assert 'specrt_draft_tokens_total{tag="code",length_bucket="0-256"}' in text
    steps = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("specrt_spec_steps_total{"))
    assert steps == snap["total"]["steps"]          # every step counted once across the series
    assert "specrt_position_acceptance_rate{position=\"0\"}" in text
    assert "# TYPE specrt_emitted_tokens_total counter" in text


# ----------------------------------------------------------------------------- reliability (issue 14)
class _Flaky:
    """A drafter or model that raises while ``fail(args)`` says so (every other call delegated)."""

    def __init__(self, inner, method: str, fail):
        self.inner, self.method, self.fail, self.raised = inner, method, fail, 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def call(*a, **kw):
            if self.fail(a):
                self.raised += 1
                raise RuntimeError("injected fault")
            return attr(*a, **kw)
        return call

    def __call__(self, *a, **kw):
        return self.__getattr__("__call__")(*a, **kw) if self.method == "__call__" else self.inner(*a, **kw)


def _once():
    state = {"left": 1}

    def fail(_args):
        state["left"] -= 1
        return state["left"] == 0
    return fail


@pytest.mark.parametrize("tree", ["chain", "fixed"])
def test_a_fault_in_one_step_fails_only_what_it_must(pair, ar_greedy, tree):
    """A drafter that raises once, or a target forward that raises once: every request still
    completes with the autoregressive tokens (the step is retried request by request) and the
    engine serves on. A drafter that raises whenever one request is in its batch fails that
    request alone (finish_reason "error", its KV freed, not left running); the others finish
    with their tokens, and the engine serves afterwards."""
    tdir, ddir = pair
    spec = SpecConfig(max_draft_length=3, tree=tree)
    propose = "propose"             # chains and trees alike
    flaky = {}

    def wrap(d):
        flaky["d"] = _Flaky(d, propose, _once())
        return flaky["d"]
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=spec, seed=0, wrap_drafter=wrap)
    assert tokens(llm_.generate(PROMPTS, GREEDY)) == ar_greedy and flaky["d"].raised == 1
    e = llm_.engine
    assert not e.has_unfinished() and e.num_free_blocks() == e.kv.num_blocks

    from specrt.models.sources import default_loader
    models = {}

    def load(path, role, dtype, device):
        m = default_loader(path, role, dtype, device)
        if role == "target":
            models["t"] = m = _Flaky(m, "__call__", _once())
        return m
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=spec, seed=0, model_loader=load)
    assert tokens(llm_.generate(PROMPTS, GREEDY)) == ar_greedy and models["t"].raised == 1

    poison = [9, 9, 9, 9]

    def wrap_poisoned(d):
        flaky["p"] = _Flaky(d, propose, lambda a: any(r.prompt_token_ids == poison for r in a[0]))
        return flaky["p"]
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=spec, seed=0, wrap_drafter=wrap_poisoned)
    e = llm_.engine
    outs = llm_.generate(PROMPTS[:4] + [poison] + PROMPTS[4:], GREEDY)
    bad = outs.pop(4)
    assert bad.finish_reason == "error" and "injected fault" in bad.error and flaky["p"].raised >= 1
    assert tokens(outs) == ar_greedy
    assert not e.scheduler.running and not e.has_unfinished() and e.num_free_blocks() == e.kv.num_blocks
    assert tokens(llm_.generate(PROMPTS[:2], GREEDY)) == ar_greedy[:2]


def test_a_request_whose_parameters_overflow_the_kernels_runs_normally(pair, ar_sampled):
    """A top_k beyond int32 (it slipped past SamplingParams' own checks) means "no top-k" like
    any top_k >= the vocabulary: it must not break the step for its batch neighbours, and it
    samples exactly what top_k=0 samples."""
    eng = llm(pair, "model", max_draft_length=3)
    params = list(SAMPLED)
    huge = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=0)
    huge.top_k = 2 ** 31                     # what the engine must survive, however it got there
    params[0] = huge
    assert SAMPLED[0].top_k == 0
    assert tokens(eng.generate(PROMPTS, params)) == tokens(eng.generate(PROMPTS, SAMPLED))
    assert not eng.engine.has_unfinished()


def test_python_api_refuses_bad_input_before_queuing_anything(pair):
    """generate() validates every prompt before it queues any (no orphan left running); token
    ids must be integers (not 100.7, "100" or True); params of the wrong type are named as such."""
    import numpy as np

    tdir, ddir = pair
    eng = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=2), seed=0)
    e = eng.engine
    with pytest.raises(ValueError, match="empty"):
        eng.generate(["w5 w6", ""], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        eng.generate([[5, 6], [5, VOCAB]], GREEDY)
    assert not e.has_unfinished()
    for bad in ([5, 100.7], [5, "100"], [True, 5], [5.0]):
        with pytest.raises(ValueError, match="integer"):
            e.add_request(bad, GREEDY)
    assert not e.has_unfinished()
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        eng.generate(["w5 w6"], {"temperature": 0.0})
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        eng.generate(["w5 w6", "w7"], [GREEDY, {"temperature": 0.0}])
    assert not e.has_unfinished()
    # integer types other than int are token ids too
    want = tokens(eng.generate([PROMPTS[1]], GREEDY))
    assert tokens(eng.generate([np.array(PROMPTS[1])], GREEDY)) == want
    assert tokens(eng.generate([torch.tensor(PROMPTS[1])], GREEDY)) == want


def test_dtype_names_and_a_kv_cache_sized_for_the_workload(pair, ar_greedy):
    """dtype may be given by name ("float32", "fp32", "bfloat16", "bf16", "float16") like a torch
    dtype; the default CPU cache holds what max_batch_size requests at max_model_len need (plus a
    margin), not a share of the machine's RAM."""
    tdir, ddir = pair
    spec = SpecConfig(max_draft_length=2, max_batch_size=3, max_model_len=128)
    for name in ("float32", "fp32"):
        eng = specrt.LLM(target=str(tdir), draft=str(ddir), spec=spec, dtype=name, seed=0)
        assert eng.engine.kv["target"].dtype == torch.float32
        assert tokens(eng.generate(PROMPTS[:2], GREEDY)) == ar_greedy[:2]
    for name, want in (("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16)):
        eng = specrt.LLM(target=str(tdir), draft="ngram", spec=spec, dtype=name, seed=0)
        assert eng.engine.target.dtype == want and eng.engine.kv["target"].dtype == want
        assert len(eng.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="dtype"):
        specrt.LLM(target=str(tdir), dtype="int8")
    assert eng.engine.kv.num_blocks == 64 + 3 * (128 // 16 + 2)


def test_head_policy_without_a_head_names_the_command_that_trains_one(pair, tmp_path):
    """policy="head" needs accept_head/ beside the draft; the error says how to train one with a
    command that exists (python -m specrt.training.accept_head), and other drafters are refused."""
    import shutil

    tdir, ddir = pair
    bare = tmp_path / "draft"
    shutil.copytree(ddir, bare, ignore=shutil.ignore_patterns("accept_head"))
    with pytest.raises(ValueError, match="no acceptance head") as info:
        specrt.LLM(target=str(tdir), draft=str(bare), spec=SpecConfig(policy="head"))
    assert "python -m specrt.training.accept_head" in str(info.value) and "distill head" not in str(info.value)
    assert f"--draft {bare}" in str(info.value)
    for draft in ("ngram", "self:1", None):
        with pytest.raises(ValueError, match="needs a draft model"):
            specrt.LLM(target=str(tdir), draft=draft, spec=SpecConfig(policy="head"))


def test_what_preemption_reproduces(pair, ar_greedy):
    """What holds when the KV cache is short (drafts dropped to make room, requests preempted and
    recomputed; see specrt.step.scheduler): greedy and coupled outputs are token-identical to running
    alone; seeded rejection-sampled outputs may differ from running alone (their tokens depend on
    the draft lengths, which the shortage changes) but stay exact in distribution."""
    from scipy.stats import chi2_contingency

    from specrt.models.kv_cache import kv_bytes_per_block
    from specrt.models import load_model

    tdir, ddir = pair
    cfgs = [load_model(tdir).config, load_model(ddir).config]
    tight = SpecConfig(max_draft_length=3, block_size=4, max_batch_size=64,
                       kv_cache_budget=40 * kv_bytes_per_block(cfgs, 4, torch.float32))
    eng = specrt.LLM(target=str(tdir), draft=str(ddir), spec=tight, seed=0)
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar_greedy
    n, pos = 1200, (3, 5, 7)
    params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=8, ignore_eos=True, seed=i) for i in range(n)]
    squeezed = tokens(eng.generate([PROMPTS[1]] * n, params))
    assert eng.stats()["preemptions"] > 0
    roomy = tokens(llm(pair, "model", max_batch_size=256, max_draft_length=3).generate([PROMPTS[1]] * n, params))
    assert sum(a != b for a, b in zip(squeezed, roomy)) > 0      # not token-identical: the draft lengths differed
    ar = _first_tokens(llm(pair, "none", max_batch_size=256), n, tokens_per_req=8, seed0=10_000)
    for p in pos:
        a = torch.bincount(torch.tensor([t[p] for t in ar]), minlength=VOCAB)
        b = torch.bincount(torch.tensor([t[p] for t in squeezed]), minlength=VOCAB)
        keep = (a + b) > 0
        assert chi2_contingency(torch.stack([a[keep], b[keep]]).numpy())[1] > 1e-4, p


def test_an_admission_fault_fails_that_request_alone(pair, ar_greedy):
    """An exception while admitting one request (reserving its prompt's blocks) fails that
    request; the queue behind it is admitted and served as usual."""
    tdir, ddir = pair
    llm_ = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=3), seed=0)
    e = llm_.engine
    allocate = e.scheduler.try_allocate

    def faulty(req):
        if req.prompt_token_ids == [9, 9, 9]:
            raise RuntimeError("injected admission fault")
        return allocate(req)
    e.scheduler.try_allocate = faulty
    outs = llm_.generate(PROMPTS[:2] + [[9, 9, 9]] + PROMPTS[2:], GREEDY)
    bad = outs.pop(2)
    assert bad.finish_reason == "error" and "injected admission fault" in bad.error
    assert tokens(outs) == ar_greedy and not e.has_unfinished() and e.num_free_blocks() == e.kv.num_blocks
