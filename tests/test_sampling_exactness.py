"""Sampling exactness of rejection_sample / sample_tokens / probs_from_logits (docs/architecture.md 2-3).

Method: one op call with N = 200k rows that all share the same (p, q) (seeds = arange(N),
so every row is an independent draw; positions random), then Pearson chi-square goodness of
fit (scipy) of the emitted tokens against the target distribution, and binomial tests of the
acceptance counts against sum_v min(p_v, q_v). Pass = p > 1e-4; the deliberately wrong
samplers below must get p < 1e-6 (tests/_stats.py), proving each test can fail.

Which event do we condition on (the second emitted token)?
  Request with K = 2: draft x0 ~ q0, x1 ~ Q(.|x0); target rows p0, T(.|x0), T(.|x1).
  * y0 = out[:, 0] is emitted in every draw and must be ~ p0 (unconditionally).
  * A = {num_accepted >= 1} = "draft 0 was accepted", so y0 = x0 on A, and the second emitted
    token y1 = out[:, 1] exists. A is decided by position-0 randomness only (the draft x0 and the
    ACCEPT coin at pos), while y1 is produced by an independent speculative step at pos + 1 with
    rows (T(.|x0), Q(.|x0)). Hence  y1 | (A, y0 = a)  ~  T(.|a)  -- tested per a (summed
    chi-square). Conditioning on y0 = a alone (without A) would NOT be valid for out[:, 1]: on
    A^c there is no second token in this step.
  * Joint check: on A^c the engine would emit y1 in the NEXT step from T(.|y0); we complete
    those draws with sample_tokens(T(.|y0), seed, pos + 1, "target"). Then over ALL draws
    (y0, y1) ~ p0(a) T(b|a): a 36-cell chi-square.
  * Acceptance at position 1 given A and x0 = a is Bernoulli(sum min(T(.|a), Q(.|a))): the
    count over A is a sum of independent Bernoullis (normal approximation).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specrt import ops

from _stats import (P_FAIL, P_PASS, binomial_p, chisquare_conditional, chisquare_gof, counts,
                     poisson_binomial_z_p)

N = 200_000
V = 8
RESULTS: dict[str, float] = {}   # printed (pytest -s) for the issue note


def _report(name: str, stat: float, p: float, dof: int | None = None) -> None:
    print(f"[exactness] {name}: stat={stat:.2f}" + (f" dof={dof}" if dof is not None else "") + f" p={p:.3g}")


def _dirichlet(seed: int, v: int = V, alpha: float = 1.0, zeros: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.dirichlet([alpha] * v)
    if zeros:
        x[rng.choice(v, zeros, replace=False)] = 0.0
    return torch.tensor(x / x.sum(), dtype=torch.float32)


def _inputs(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + seed * 10_000_019
    positions = torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64)
    return seeds, positions


def _min_sum(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.minimum(p.double(), q.double()).sum())


# --------------------------------------------------------------------------- #
# torch samplers: a correct one (harness sanity) and two deliberately wrong ones
# --------------------------------------------------------------------------- #
def torch_sampler(tp, dp, ids, nd, seeds, positions, *, wrong_q=False, always_reject=False,
                  shared_coin=False, gen_seed=1234):
    """Vectorised Leviathan/Chen sampler in torch (its own torch.Generator randomness).

    wrong_q:       accept when u * q'(x) <= p(x) with q' = the q row of another vocabulary
                   ordering (q rolled by one token: "q read from the wrong row"); the residual
                   still uses the right q.  Wrong output distribution.
    always_reject: never accept; emit a fresh sample of p at position 0. Right output
                   distribution, acceptance rate 0.
    shared_coin:   one coin u per request reused at every position (the position left out of
                   the counter). Position-0 marginal right, later positions wrong.
    """
    g = torch.Generator().manual_seed(gen_seed)
    b, k1, v = tp.shape
    k = k1 - 1
    nd = torch.as_tensor(nd).long()
    out = torch.full((b, k1), -1, dtype=torch.int32)
    acc = torch.zeros(b, dtype=torch.int32)
    alive = torch.ones(b, dtype=torch.bool)
    coin = torch.rand(b, generator=g, dtype=torch.float64).float()

    def draw(rows: torch.Tensor, weights: torch.Tensor) -> None:
        if rows.any():
            out[rows, i] = torch.multinomial(weights[rows], 1, generator=g).squeeze(1).int()

    for i in range(k1):
        p = tp[:, i]
        bonus = alive & (nd <= i)
        draw(bonus, p)
        if i == k:
            break
        has = alive & (nd > i)
        x = ids[:, i].long().clamp(min=0)
        q = dp[:, i] if dp is not None else torch.nn.functional.one_hot(x, v).float()
        q_acc = q.roll(1, dims=-1) if wrong_q else q
        u = coin if shared_coin else torch.rand(b, generator=g, dtype=torch.float64).float()
        accept = has & (u * q_acc.gather(1, x[:, None]).squeeze(1) < p.gather(1, x[:, None]).squeeze(1))
        if always_reject:
            accept = torch.zeros_like(has)
        reject = has & ~accept
        if always_reject:
            draw(reject, p)
        else:
            resid = (p - q).clamp(min=0)
            resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
            draw(reject, resid)
        out[accept, i] = x[accept].int()
        acc += accept.int()
        alive = accept
    return out, acc


def kernel_sampler(tp, dp, ids, nd, seeds, positions):
    return ops.rejection_sample(tp, dp, ids, nd, seeds, positions)


# --------------------------------------------------------------------------- #
# the check shared by every position-independent case
# --------------------------------------------------------------------------- #
def run_constant_case(sampler, p_rows, q_rows, nd, seed, onehot_ids=None, expect_rows=None):
    """Every request: target rows p_rows [K+1, V], draft rows q_rows [K, V] (or None with
    fixed draft ids onehot_ids [K]); drafts x_i ~ q_i drawn by sample_tokens(purpose="draft")
    at position pos + i. Returns {name: (stat, p, dof)}: 'dist{j}' = chi-square of token j over
    the draws that emitted it (num_accepted >= j: drafts 0..j-1 accepted, an event decided by
    earlier positions only, so token j ~ p_j; against expect_rows[j] when given); 'acc{i}' = binomial test of acceptance at
    position i among draws that reached it with a draft there."""
    k = p_rows.shape[0] - 1
    seeds, positions = _inputs(N, seed)
    nd = torch.as_tensor(nd, dtype=torch.int32).expand(N).contiguous()
    tp = p_rows[None].expand(N, k + 1, -1).contiguous()
    if q_rows is None:
        dp = None
        ids = torch.as_tensor(onehot_ids, dtype=torch.int32)[None].expand(N, k).contiguous()
        q_eff = torch.nn.functional.one_hot(torch.as_tensor(onehot_ids).long(), p_rows.shape[1]).float()
    else:
        dp = q_rows[None].expand(N, k, -1).contiguous()
        ids = torch.stack([ops.sample_tokens(dp[:, i].contiguous(), seeds, positions + i, purpose="draft")
                           for i in range(k)], 1) if k else torch.zeros(N, 0, dtype=torch.int32)
        q_eff = q_rows
    ids = torch.where(torch.arange(k)[None] < nd[:, None].long(), ids, torch.full_like(ids, -1))
    out, acc = sampler(tp, dp, ids, nd, seeds, positions)
    res = {}
    for j in range(k + 1):
        rows = acc >= j
        if rows.sum() > 1000:
            want = p_rows[j] if expect_rows is None else expect_rows[j]
            res[f"dist{j}"] = chisquare_gof(counts(out[rows, j], p_rows.shape[1]), want)
    for i in range(k):
        reach = (nd > i) & (acc >= i)
        if int(reach.sum()) == 0:
            continue
        succ = int((acc[reach] >= i + 1).sum())
        alpha = _min_sum(p_rows[i], q_eff[i])
        res[f"acc{i}"] = (succ / max(int(reach.sum()), 1), binomial_p(succ, int(reach.sum()), alpha), alpha)
    return res


def _assert_pass(res, label):
    for name, (stat, p, extra) in res.items():
        _report(f"{label}/{name}", stat, p, extra if name.startswith("dist") else None)
        if name.startswith("acc"):
            print(f"    observed rate {stat:.4f} vs sum(min(p,q)) = {extra:.4f}")
        assert p > P_PASS, (label, name, stat, p)


P1 = _dirichlet(1)
Q1 = _dirichlet(2)
P_BONUS = _dirichlet(3, alpha=0.5)

CASES = {
    # name: (p_rows [K+1,V], q_rows [K,V] | None, onehot ids | None, num_draft_tokens)
    "random_p_q": (torch.stack([P1, P_BONUS]), Q1[None], None, 1),
    "disjoint_p_q": (torch.stack([torch.tensor([.1, .2, .3, .4, 0, 0, 0, 0]), P_BONUS]),
                     torch.tensor([[0, 0, 0, 0, .25, .25, .3, .2]]), None, 1),
    "q_equals_p": (torch.stack([P1, P_BONUS]), P1[None], None, 1),
    "p_with_zeros": (torch.stack([_dirichlet(4, zeros=3), P_BONUS]), _dirichlet(5, zeros=2)[None], None, 1),
    "onehot_q": (torch.stack([P1, P_BONUS]), None, [int(torch.argsort(P1)[4])], 1),
    "onehot_q_zero_p": (torch.stack([_dirichlet(6, zeros=1), P_BONUS]), None,
                        [int(torch.nonzero(_dirichlet(6, zeros=1) == 0)[0])], 1),
    "no_drafts": (torch.stack([P1, P_BONUS]), Q1[None], None, 0),
    "k4_varied_rows": (torch.stack([_dirichlet(10 + j) for j in range(5)]),
                       torch.stack([_dirichlet(20 + j, alpha=2.0) for j in range(4)]), None, 4),
    "k4_onehot": (torch.stack([_dirichlet(30 + j, alpha=0.3) for j in range(5)]), None,
                  [int(_dirichlet(30 + j, alpha=0.3).argmax()) for j in range(4)], 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_sample_exact(case):
    p_rows, q_rows, onehot, n = CASES[case]
    res = run_constant_case(kernel_sampler, p_rows, q_rows, n, seed=7,
                            onehot_ids=onehot)
    _assert_pass(res, case)
    if case == "disjoint_p_q":
        assert res["acc0"][0] == 0.0
    if case == "q_equals_p":
        assert res["acc0"][0] == 1.0
    if case == "no_drafts":
        assert not any(name.startswith("acc") for name in res)


def test_mixed_num_draft_tokens_exact():
    """num_draft_tokens drawn from {0..4} per request in one call: token j over the draws that
    emitted it is still ~ p_j, and acceptance at i is sum(min(p_i, q_i))."""
    p_rows, q_rows, _, _ = CASES["k4_varied_rows"]
    nd = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    res = run_constant_case(kernel_sampler, p_rows, q_rows, nd, seed=8)
    _assert_pass(res, "mixed_nd")


def test_correct_torch_sampler_passes_the_harness():
    """The harness accepts an independent correct implementation (its randomness is torch's)."""
    p_rows, q_rows, _, n = CASES["k4_varied_rows"]
    _assert_pass(run_constant_case(torch_sampler, p_rows, q_rows, n, seed=9), "torch_correct")


def test_wrong_q_sampler_fails_distribution_test():
    for case in ("random_p_q", "k4_varied_rows"):
        p_rows, q_rows, _, n = CASES[case]
        res = run_constant_case(lambda *a: torch_sampler(*a, wrong_q=True), p_rows, q_rows, n, seed=7)
        stat, p, dof = res["dist0"]
        _report(f"WRONG wrong_q/{case}/dist0", stat, p, dof)
        assert p < P_FAIL, (case, stat, p)


def test_always_reject_sampler_fails_acceptance_test():
    p_rows, q_rows, _, n = CASES["random_p_q"]
    res = run_constant_case(lambda *a: torch_sampler(*a, always_reject=True), p_rows, q_rows, n, seed=7)
    stat, p, dof = res["dist0"]
    _report("WRONG always_reject/dist0 (distribution right)", stat, p, dof)
    assert p > P_PASS                      # its output distribution is right ...
    rate, p_acc, alpha = res["acc0"]
    print(f"[exactness] WRONG always_reject/acc0: rate={rate:.4f} vs {alpha:.4f} p={p_acc:.3g}")
    assert p_acc < P_FAIL                  # ... but the acceptance test catches it


# --------------------------------------------------------------------------- #
# probs_from_logits rows: the target of the test is the TRANSFORMED distribution
# --------------------------------------------------------------------------- #
def _transform_f64(logits: np.ndarray, t: float, k: int, top_p: float) -> np.ndarray:
    """Independent float64 implementation of temperature -> top-k -> softmax -> top-p."""
    x = logits.astype(np.float64) / t
    if 0 < k < x.size:
        kth = np.sort(x)[::-1][k - 1]
        x = np.where(x >= kth, x, -np.inf)
    e = np.exp(x - x.max())
    p = e / e.sum()
    if top_p < 1:
        s = np.sort(p)[::-1]
        cut = s[np.nonzero(np.cumsum(s) >= top_p)[0][0]]
        p = np.where(p >= cut, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("t,k,top_p", [(0.7, 5, 0.85), (1.3, 0, 0.6), (0.5, 3, 1.0), (1.0, 0, 1.0)])
def test_transformed_rows_exact(t, k, top_p):
    g = torch.Generator().manual_seed(int(t * 100) + k)
    v = 10
    target_logits = torch.randn(3, v, generator=g) * 1.5     # rows: p0, p1 (bonus), draft q0
    target_logits[2] = target_logits[0] + 0.7 * torch.randn(v, generator=g)   # a draft close to p0
    params = (torch.full((3,), t), torch.full((3,), k, dtype=torch.int32), torch.full((3,), top_p))
    rows = ops.probs_from_logits(target_logits, *params)
    expected = [_transform_f64(target_logits[r].numpy(), t, k, top_p) for r in range(3)]
    for r in range(3):
        assert np.array_equal(rows[r].numpy() > 0, expected[r] > 0)
        assert np.allclose(rows[r].numpy(), expected[r], atol=1e-6)
    p_rows = rows[:2]
    q_rows = rows[2:]
    # chi-square against the float64 transform, not against the kernel's own probabilities
    res = run_constant_case(kernel_sampler, p_rows, q_rows, 1, seed=11, expect_rows=expected[:2])
    seeds, positions = _inputs(N, 11)
    for j in range(2):
        stat, p, dof = res[f"dist{j}"]
        _report(f"transform(t={t},k={k},p={top_p})/dist{j}", stat, p, dof)
        assert p > P_PASS
    rate, p_acc, alpha = res["acc0"]
    assert p_acc > P_PASS, (rate, alpha)
    # and directly: sample_tokens of the transformed row ~ the float64 transform
    toks = ops.sample_tokens(rows[0][None].expand(N, v).contiguous(), seeds, positions)
    stat, p, dof = chisquare_gof(counts(toks, v), expected[0])
    _report(f"transform(t={t},k={k},p={top_p})/sample_tokens", stat, p, dof)
    assert p > P_PASS


def test_greedy_rows_in_a_sampled_batch_are_deterministic():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    rows = ops.probs_from_logits(logits, [0.0, 1.0], [0, 0], [1.0, 1.0])
    n = 20_000
    seeds, positions = _inputs(n, 12)
    probs = rows.repeat(n // 2, 1)
    toks = ops.sample_tokens(probs, seeds, positions)
    assert bool((toks[0::2] == int(logits[0].argmax())).all())
    assert int(torch.unique(toks[1::2]).numel()) > 5


@pytest.mark.parametrize("purpose", ["target", "draft", "residual"])
def test_sample_tokens_exact(purpose):
    p = _dirichlet(40, v=V, zeros=2) * 3.0        # unnormalised weights are fine
    seeds, positions = _inputs(N, 13)
    toks = ops.sample_tokens(p[None].expand(N, V).contiguous(), seeds, positions, purpose=purpose)
    stat, pv, dof = chisquare_gof(counts(toks, V), p)
    _report(f"sample_tokens[{purpose}]", stat, pv, dof)
    assert pv > P_PASS


# --------------------------------------------------------------------------- #
# K = 2 with context: first token ~ p0, second | first ~ T(.|first)
# --------------------------------------------------------------------------- #
VS = 6


def _two_token_setup():
    p0, q0 = _dirichlet(50, VS), _dirichlet(51, VS)
    T = torch.stack([_dirichlet(60 + a, VS, alpha=0.7) for a in range(VS)])    # target P(next | prev)
    Q = torch.stack([_dirichlet(70 + a, VS, alpha=0.7) for a in range(VS)])    # draft  Q(next | prev)
    return p0, q0, T, Q


def run_two_token(sampler, seed=21):
    p0, q0, T, Q = _two_token_setup()
    seeds, positions = _inputs(N, seed)
    x0 = ops.sample_tokens(q0[None].expand(N, VS).contiguous(), seeds, positions, purpose="draft")
    x1 = ops.sample_tokens(Q[x0.long()], seeds, positions + 1, purpose="draft")
    tp = torch.stack([p0[None].expand(N, VS), T[x0.long()], T[x1.long()]], 1).contiguous()
    dp = torch.stack([q0[None].expand(N, VS), Q[x0.long()]], 1).contiguous()
    ids = torch.stack([x0, x1], 1)
    nd = torch.full((N,), 2, dtype=torch.int32)
    out, acc = sampler(tp, dp, ids, nd, seeds, positions)
    y0 = out[:, 0].long()
    res = {"first": chisquare_gof(counts(y0, VS), p0)}
    a_rows = acc >= 1
    assert torch.equal(y0[a_rows], x0[a_rows].long())
    joint_a = np.zeros((VS, VS))
    np.add.at(joint_a, (y0[a_rows].numpy(), out[a_rows, 1].long().numpy()), 1)
    res["second_given_first_on_A"] = chisquare_conditional(joint_a, T.double().numpy())
    # complete the draws that emitted one token with the next step's autoregressive sample
    nxt = ops.sample_tokens(T[y0], seeds, positions + 1, purpose="target").long()
    y1 = torch.where(a_rows, out[:, 1].long(), nxt)
    joint = np.zeros((VS, VS))
    np.add.at(joint, (y0.numpy(), y1.numpy()), 1)
    res["joint_completed"] = chisquare_gof(joint.ravel(), (p0.double()[:, None] * T.double()).numpy().ravel())
    # acceptance: position 0 ~ Binom(sum min(p0, q0)); position 1 | A, x0 = a ~ Bern(sum min(T_a, Q_a))
    res["acc0"] = (float(a_rows.double().mean()), binomial_p(int(a_rows.sum()), N, _min_sum(p0, q0)), 0)
    alpha1 = torch.minimum(T.double(), Q.double()).sum(-1)[x0[a_rows].long()]
    succ = int((acc[a_rows] >= 2).sum())
    res["acc1_given_A"] = (succ / int(a_rows.sum()), poisson_binomial_z_p(succ, alpha1.numpy()), 0)
    return res


def test_second_token_conditional_on_first():
    res = run_two_token(kernel_sampler)
    for name, (stat, p, dof) in res.items():
        if name.startswith("acc"):
            print(f"[exactness] two_token/{name}: rate={stat:.4f} p={p:.3g}")
        else:
            _report(f"two_token/{name}", stat, p, dof)
        assert p > P_PASS, (name, stat, p)


def test_two_token_harness_has_power():
    """A coin reused across positions keeps y0 right but breaks y1 | y0; reading q from the
    wrong row breaks y0. Both must be rejected (p < 1e-6); the correct torch sampler passes."""
    good = run_two_token(torch_sampler)
    assert all(p > P_PASS for _, p, _ in good.values()), good
    shared = run_two_token(lambda *a: torch_sampler(*a, shared_coin=True))
    for name in ("second_given_first_on_A", "joint_completed"):
        stat, p, dof = shared[name]
        _report(f"WRONG shared_coin/two_token/{name}", stat, p, dof)
    assert shared["first"][1] > P_PASS
    assert shared["second_given_first_on_A"][1] < P_FAIL
    wrong = run_two_token(lambda *a: torch_sampler(*a, wrong_q=True))
    _report("WRONG wrong_q/two_token/first", *wrong["first"])
    _report("WRONG wrong_q/two_token/joint_completed", *wrong["joint_completed"])
    assert wrong["first"][1] < P_FAIL and wrong["joint_completed"][1] < P_FAIL


# --------------------------------------------------------------------------- #
# coupled mode: drafter-invariant, equals plain sampling of the target
# --------------------------------------------------------------------------- #
NC = 60_000
VC = 7


def _coupled_check(tp, ids, nd, seeds, positions, dp=None):
    k = ids.shape[1]
    out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, positions, method="coupled")
    # the target alone: sample_tokens at position pos + i for output i (one call, N*(K+1) rows)
    ar = ops.sample_tokens(tp.reshape(-1, tp.shape[-1]), seeds.repeat_interleave(k + 1),
                           (positions[:, None] + torch.arange(k + 1)).reshape(-1)).reshape(-1, k + 1)
    # accepted length = first mismatch between drafts and the target's own tokens (capped at n)
    match = (ids == ar[:, :k]) & (torch.arange(k)[None] < nd[:, None].long())
    expect_acc = torch.cumprod(match.int(), 1).sum(1) if k else torch.zeros_like(acc)
    assert torch.equal(acc.long(), expect_acc.long())
    emitted = torch.arange(k + 1)[None] <= acc[:, None].long()
    assert torch.equal(out[emitted], ar[emitted]), "coupled output differs from plain sampling"
    assert bool((out[~emitted] == -1).all())
    return out, acc


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("drafter", ["random_tokens", "target_noise_from_q", "the_target_itself"])
def test_coupled_equals_plain_sampling(k, drafter):
    g = torch.Generator().manual_seed(100 + k)
    seeds = torch.randint(-2**63, 2**63 - 1, (NC,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**40, (NC,), generator=g, dtype=torch.int64)
    tp = torch.rand(NC, k + 1, VC, generator=g) ** 3
    tp[torch.rand(NC, k + 1, VC, generator=g) < 0.2] = 0.0
    tp[..., 0] += 1e-3
    tp = tp / tp.sum(-1, keepdim=True)
    nd = torch.randint(0, k + 1, (NC,), generator=g, dtype=torch.int32)
    q = torch.rand(NC, k, VC, generator=g) ** 2
    q = q / q.sum(-1, keepdim=True)
    if drafter == "random_tokens":
        ids = torch.randint(0, VC, (NC, k), generator=g, dtype=torch.int32)
    elif drafter == "target_noise_from_q":
        ids = torch.stack([ops.sample_tokens(q[:, i].contiguous(), seeds, positions + i, purpose="target")
                           for i in range(k)], 1) if k else torch.zeros(NC, 0, dtype=torch.int32)
    else:
        ids = torch.stack([ops.sample_tokens(tp[:, i].contiguous(), seeds, positions + i)
                           for i in range(k)], 1) if k else torch.zeros(NC, 0, dtype=torch.int32)
    ids = torch.where(torch.arange(k)[None] < nd[:, None].long(), ids, torch.full_like(ids, -1))
    out, acc = _coupled_check(tp, ids, nd, seeds, positions, dp=q if drafter != "random_tokens" else None)
    if drafter == "the_target_itself":
        assert torch.equal(acc, nd)


def _exact_coupled_rate(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(race winner under p == race winner under q) with shared exponential noise:
    sum_v 1 / sum_u max(p_u / p_v, q_u / q_v) over v with p_v, q_v > 0 (the Gumbel coupling)."""
    p, q = p.double(), q.double()
    total = 0.0
    for v in range(p.numel()):
        if p[v] > 0 and q[v] > 0:
            total += 1.0 / float(torch.maximum(p / p[v], q / q[v]).sum())
    return total


def test_coupled_acceptance_rate_reported_beside_optimal():
    """Drafts sampled with the TARGET noise from q. Per position the coupled acceptance rate
    is the Gumbel-coupling probability (exact formula, binomial test), which lies between
    (1-d)/(1+d) and the optimum 1-d = sum(min(p, q)) that method="rejection" attains."""
    k = 4
    p_rows = torch.stack([_dirichlet(80 + j, VC) for j in range(k + 1)])
    q_rows = torch.stack([_dirichlet(90 + j, VC, alpha=2.0) for j in range(k)])
    seeds, positions = _inputs(N, 31)
    tp = p_rows[None].expand(N, k + 1, VC).contiguous()
    dp = q_rows[None].expand(N, k, VC).contiguous()
    nd = torch.full((N,), k, dtype=torch.int32)
    ids_c = torch.stack([ops.sample_tokens(dp[:, i].contiguous(), seeds, positions + i, purpose="target")
                         for i in range(k)], 1)
    _, acc_c = _coupled_check(tp, ids_c, nd, seeds, positions, dp=dp)
    ids_r = torch.stack([ops.sample_tokens(dp[:, i].contiguous(), seeds, positions + i, purpose="draft")
                         for i in range(k)], 1)
    _, acc_r = ops.rejection_sample(tp, dp, ids_r, nd, seeds, positions)
    print()
    for i in range(k):
        opt = _min_sum(p_rows[i], q_rows[i])
        exact = _exact_coupled_rate(p_rows[i], q_rows[i])
        reach_c, reach_r = acc_c >= i, acc_r >= i
        rate_c = float((acc_c[reach_c] > i).double().mean())
        rate_r = float((acc_r[reach_r] > i).double().mean())
        pc = binomial_p(int((acc_c[reach_c] > i).sum()), int(reach_c.sum()), exact)
        pr = binomial_p(int((acc_r[reach_r] > i).sum()), int(reach_r.sum()), opt)
        print(f"[coupled] position {i}: coupled {rate_c:.4f} (exact {exact:.4f}, p={pc:.3g}) | "
              f"rejection {rate_r:.4f} (p={pr:.3g}) | optimal sum(min(p,q)) {opt:.4f} | "
              f"lower bound (1-d)/(1+d) {opt / (2 - opt):.4f}")
        assert opt / (2 - opt) - 1e-9 <= exact <= opt + 1e-9
        assert pc > P_PASS and pr > P_PASS
    print(f"[coupled] mean accepted per step: coupled {float(acc_c.double().mean()):.3f}, "
          f"rejection {float(acc_r.double().mean()):.3f}")
