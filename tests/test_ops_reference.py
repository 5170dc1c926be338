"""Every op against specrt/ops/reference.py (the pure-torch specification) at odd sizes.

Tokens must be EQUAL (the kernels use bit-identical randomness: same Philox counter
layout, same float32 operation order), num_accepted equal; probs_from_logits agrees to
1e-6 with the identical support. Inputs mix greedy (one-hot) and sampled rows, draft_probs
None and given, per-request num_draft_tokens including 0, seeds that are negative or above
2^32, positions above 2^32, and unnormalised draft rows whose residual max(p - q, 0) is all
zero (the "fall back to p" branch).
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops
from specrt.ops import reference

from _cases import (gen, greedy_case, logits_case, random_rows, seeds_positions,  # noqa: E402  (tests/ on sys.path)
                    spec_case)

# (B, V, K): every B in {1,3,17}, V in {2,7,1000,32003}, K in {0,1,4}; the reference's Python
# loops are slow, so the large-V cases use small B.
SIZES = [(1, 2, 0), (3, 2, 4), (17, 2, 1), (1, 7, 4), (3, 7, 0), (17, 7, 4), (3, 1000, 1), (17, 1000, 4),
         (1, 1000, 0), (1, 32003, 4), (3, 32003, 1)]


@pytest.mark.parametrize("b,v,k", SIZES)
@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sample_matches_reference(b, v, k, with_q):
    g = gen("rej", b, v, k, with_q)
    tp, dp, ids, nd, seeds, pos = spec_case(b, v, k, with_q, g)
    out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, pos)
    ref_out, ref_acc = reference.rejection_sample(tp, dp, ids, nd, seeds, pos)
    assert out.dtype == torch.int32 and acc.dtype == torch.int32
    assert out.shape == (b, k + 1) and acc.shape == (b,)
    assert torch.equal(acc, ref_acc), (acc, ref_acc)
    assert torch.equal(out, ref_out), (out, ref_out)
    # structure: num_accepted + 1 tokens, then -1; accepted tokens are the drafts
    for r in range(b):
        m = int(acc[r])
        assert 0 <= m <= int(nd[r])
        assert bool((out[r, : m + 1] >= 0).all()) and bool((out[r, m + 1:] == -1).all())
        assert torch.equal(out[r, :m], ids[r, :m])
        if r % 3 == 0:   # greedy target rows: every emitted token is that row's hot token
            assert torch.equal(out[r, : m + 1].long(), tp[r, : m + 1].argmax(-1))


@pytest.mark.parametrize("b,v,k", SIZES)
def test_coupled_matches_reference(b, v, k):
    g = gen("coupled", b, v, k)
    tp, _, ids, nd, seeds, pos = spec_case(b, v, k, False, g)
    # make some drafts the target's own race winners so long prefixes get accepted
    winners = reference.rejection_sample(tp, None, torch.full_like(ids, -1), torch.zeros_like(nd), seeds, pos,
                                         method="coupled")[0]
    for r in range(0, b, 2):
        for i in range(int(nd[r])):
            ids[r, i] = int(reference.race(tp[r, i], int(seeds[r]), int(pos[r]) + i, reference.PURPOSE_TARGET)[0])
    del winners
    dp = random_rows(g, (b, k), v)
    out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method="coupled")
    ref_out, ref_acc = reference.rejection_sample(tp, dp, ids, nd, seeds, pos, method="coupled")
    assert torch.equal(acc, ref_acc) and torch.equal(out, ref_out)
    out_none, acc_none = ops.rejection_sample(tp, None, ids, nd, seeds, pos, method="coupled")
    assert torch.equal(out_none, out) and torch.equal(acc_none, acc)   # coupled ignores draft_probs
    if b > 2 and k > 0:
        assert int(acc[0]) == int(nd[0])   # row 0 was drafted with the target's own winners


@pytest.mark.parametrize("b,v", [(1, 2), (3, 7), (17, 7), (17, 1000), (3, 32003)])
@pytest.mark.parametrize("purpose", sorted(ops.PURPOSES))
def test_sample_tokens_matches_reference(b, v, purpose):
    g = gen("sample", b, v, purpose)
    probs = random_rows(g, (b,), v)
    probs[0] = torch.nn.functional.one_hot(torch.tensor(v - 1), v).float()   # greedy row
    if b > 2:
        probs[2] *= 7.5   # need not be normalised
    seeds, pos = seeds_positions(g, b)
    got = ops.sample_tokens(probs, seeds, pos, purpose=purpose)
    want = reference.sample_tokens(probs, seeds, pos, purpose=purpose)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert int(got[0]) == v - 1


@pytest.mark.parametrize("n,v", [(1, 2), (3, 2), (17, 7), (17, 1000), (3, 32003), (40, 7)])
def test_probs_from_logits_matches_reference(n, v):
    g = gen("probs", n, v)
    logits, t, k, p = logits_case(n, v, g)
    got = ops.probs_from_logits(logits, t, k, p)
    want = reference.probs_from_logits(logits, t, k, p)
    assert got.dtype == torch.float32 and got.shape == (n, v)
    assert torch.equal(got > 0, want > 0), "support differs"
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.allclose(got.double().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-5)
    # greedy temperatures (0, 1e-8) -> exactly one-hot at the NaN-as-(-inf) argmax, ties to the lowest index
    nan_free = torch.where(torch.isnan(logits), torch.full_like(logits, float("-inf")), logits)
    for r in range(n):
        if float(t[r]) < ops.TEMPERATURE_EPS or r == 0:
            hot = int(torch.argmax(nan_free[r]))       # torch.argmax returns the first maximum
            assert float(got[r, hot]) == 1.0 and int((got[r] != 0).sum()) == 1, r
    assert float(got[0, 0]) == 1.0                     # all-NaN row


def test_probs_from_logits_any_float_dtype_and_exact_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        got = ops.probs_from_logits(logits.to(dtype), [0.0, 0.0], [0, 0], [1.0, 1.0])
        assert torch.equal(got, torch.tensor([[0, 1.0, 0, 0, 0], [1.0, 0, 0, 0, 0]]))
    # top-k = 1 keeps all three tied maxima; top-p keeps ties at the threshold
    got = ops.probs_from_logits(logits[:1], [1.0], [1], [1.0])
    assert torch.allclose(got, torch.tensor([[0, 1 / 3, 1 / 3, 0, 1 / 3]]), atol=1e-7)
    got = ops.probs_from_logits(logits[:1], [1.0], [0], [0.1])
    assert torch.equal(got > 0, torch.tensor([[False, True, True, False, True]]))


@pytest.mark.parametrize("t", [1e-45, 1e-40, 1e-38, 1e-8, 9.9e-6, 0.0])
def test_tiny_temperatures_are_greedy(t):
    """Issue 14, defect 3: logits / 1e-40 overflowed to inf and inf - inf gave NaN rows, even
    with value checks on. Below ops.TEMPERATURE_EPS a temperature is greedy: one-hot at the
    argmax (ties to the lowest index), in the kernel and in the reference alike."""
    logits = torch.tensor([[1.0, 5.0, 3.0], [-2.0, 7.5, 7.5], [3e38, -3e38, 0.0], [float("nan"), -1.0, -4.0]])
    n = logits.shape[0]
    want = torch.tensor([[0, 1.0, 0], [0, 1.0, 0], [1.0, 0, 0], [0, 1.0, 0]])
    for top_k, top_p in ((0, 1.0), (2, 0.5)):
        args = ([t] * n, [top_k] * n, [top_p] * n)
        got = ops.probs_from_logits(logits, *args)
        assert torch.equal(got, want), got
        assert torch.equal(reference.probs_from_logits(logits, *map(torch.tensor, args)), want)
    assert t < ops.TEMPERATURE_EPS and ops.is_greedy(t)


@pytest.mark.parametrize("t", [1e-5, 2e-5, 1e-3])
def test_small_temperatures_above_eps_are_valid_distributions(t):
    """At and just above the greedy threshold the softmax is computed, and stays finite."""
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0 - 1e-5], [0.0, 1e-5, 2e-5, 3e-5]])
    got = ops.probs_from_logits(logits, [t, t], [0, 0], [1.0, 1.0])
    want = reference.probs_from_logits(logits, torch.tensor([t, t]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert bool(torch.isfinite(got).all()) and bool((got >= 0).all())
    assert torch.allclose(got.double().sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert float(got[1, 3]) > float(got[1, 0])   # not greedy: lower logits keep some mass


@pytest.mark.parametrize("b,v,k", SIZES)
def test_verify_greedy_matches_reference(b, v, k):
    g = gen("greedy", b, v, k)
    logits, ids, nd = greedy_case(b, v, k, g)   # plenty of ties, NaN, an all-NaN row
    out, acc = ops.verify_greedy(logits, ids, nd)
    ref_out, ref_acc = reference.verify_greedy(logits, ids, nd)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    assert int(acc[0]) == k   # row 0 drafted exactly the argmaxes: all accepted
    if b > 2 and int(nd[2]) > 0:
        assert int(out[2, 0]) == 0 or int(acc[2]) > 0


def test_verify_greedy_ties_and_nan_documented():
    """Greedy semantics: NaN counts as -inf; ties go to the LOWEST token id; a row that is
    entirely NaN (or -inf) therefore yields token 0. A draft equal to a tied-but-higher
    token is rejected and the lowest tied token is emitted."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[[1.0, 5.0, 5.0, nan], [nan, nan, nan, nan], [-inf, -inf, -inf, -inf]],
                           [[nan, 0.5, 0.5, 0.4], [9.0, nan, 9.0, 1.0], [0.0, 0.0, 0.0, 1.0]]])
    ids = torch.tensor([[1, 0], [2, 0]], dtype=torch.int32)
    out, acc = ops.verify_greedy(logits, ids, [2, 2])
    assert out.tolist() == [[1, 0, 0], [1, -1, -1]]
    assert acc.tolist() == [2, 0]
    ref_out, ref_acc = reference.verify_greedy(logits, ids, torch.tensor([2, 2]))
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


def test_copy_blocks_and_write_kv_match_reference():
    g = gen("kv")
    caches = [torch.randn(3, 2, 9, 4, 2, 5, generator=g),
              torch.randn(1, 2, 11, 2, 3, 7, generator=g).to(torch.bfloat16)]
    mapping = torch.tensor([[0, 5], [3, 2], [0, 7], [8, 1]])
    want = [c.clone() for c in caches]
    reference.copy_blocks(want, mapping)
    ops.copy_blocks(caches, mapping)
    for a, b in zip(caches, want):
        assert torch.equal(a, b)
    cache = caches[0]
    k = torch.randn(6, 2, 5, generator=g)
    v = torch.randn(6, 2, 5, generator=g)
    slots = torch.tensor([0, 35, -1, 17, 4, 22])
    want = cache.clone()
    reference.write_kv(want, 1, k, v, slots)
    ops.write_kv(cache, 1, k, v, slots)
    assert torch.equal(cache, want)
