"""Statistical exactness of rejection_sample_tree (recursive rejection sampling over token trees).

Method (as tests/test_sampling_exactness.py): one op call with N requests that share the target
distribution but draw with their own seed (seeds = arange(N) + offset, random positions), then
Pearson chi-square (scipy) of the emitted tokens. Pass = p > 1e-4; a deliberately wrong tree
sampler run through the same checks must get p < 1e-6, proving the checks have power.

The target is a small language model over V = 6 tokens: p0 for the first token, T1[a] after a,
T2[a, b] after (a, b); deeper nodes get rows of their own. Every node's target row is the
target's distribution after the node's path, so the first two emitted tokens (y0, y1) must
follow p0(a) * T1[a](b):
  * y0 = out[:, 0] is emitted in every draw: y0 ~ p0.
  * If a depth-1 node was accepted (num_accepted >= 1, decided by position-0 randomness and the
    root's children only), y1 = out[:, 1] is drawn by the same step from the accepted node's
    subtree, whose tokens are independent of that decision: y1 | (A, y0 = a) ~ T1[a].
  * Otherwise the engine's next step would draw y1 from T1[y0]; the test completes those draws
    with sample_tokens(T1[y0], seed, pos + 1, "target") (a stream this step never used), and
    the joint (y0, y1) over all draws is tested against p0(a) T1[a](b) (36 cells).

Trees:
  (a) "topk": deterministic drafts (draft_probs=None): the root's 3 children are the top-3
      tokens of a draft q0, each child's 2 children the top-2 of q1[a], and every first
      grandchild has 2 children of its own (depth 3, 15 nodes).
  (b) "iid": stochastic drafts: the root's 3 children drawn i.i.d. from q0 (all carry q0 as
      their draft_probs row), each child's 2 children i.i.d. from q1[a] (depth 2, 9 nodes);
      siblings often repeat a token.
The wrong sampler tries every sibling against the node's own p instead of the residual left by
the siblings rejected before it (the residual update skipped for the test).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specrt import ops

from _stats import P_FAIL, P_PASS, chisquare_conditional, chisquare_gof, counts

pytestmark = pytest.mark.slow

N = 60_000
V = 6


def _dirichlet(seed: int, alpha: float = 1.0, shape: tuple[int, ...] = ()) -> torch.Tensor:
    x = np.random.default_rng(seed).dirichlet([alpha] * V, size=shape or None)
    return torch.tensor(x / x.sum(-1, keepdims=True), dtype=torch.float32)


P0 = _dirichlet(1)                       # [V]      first token
T1 = _dirichlet(2, shape=(V,))           # [V, V]   after a
T2 = _dirichlet(3, shape=(V, V))         # [V, V, V] after (a, b)
# drafts: a decent drafter (70% the target, 30% noise), so children carry much of the mass
Q0 = 0.7 * P0 + 0.3 * _dirichlet(4, alpha=2.0)
Q1 = 0.7 * T1 + 0.3 * _dirichlet(5, alpha=2.0, shape=(V,))
Q2 = 0.7 * T2 + 0.3 * _dirichlet(6, alpha=2.0, shape=(V, V))


def _topk_tree():
    """(parents [15], tokens [15], rows [16, V]) of tree (a)."""
    parents, tokens, rows = [], [], [P0]
    def add(parent: int, token: int, row: torch.Tensor) -> int:
        parents.append(parent)
        tokens.append(token)
        rows.append(row)
        return len(parents) - 1
    level1 = [add(-1, int(a), T1[a]) for a in torch.argsort(Q0, descending=True)[:3]]
    level2 = []
    for j in level1:
        a = tokens[j]
        level2 += [(add(j, int(b), T2[a, b]), a) for b in torch.argsort(Q1[a], descending=True)[:2]]
    g = torch.Generator().manual_seed(7)
    for j, a in level2[::2]:                                       # every first grandchild
        b = tokens[j]
        for c in torch.argsort(Q2[a, b], descending=True)[:2]:
            add(j, int(c), torch.rand(V, generator=g).softmax(0))   # a row of its own
    return parents, tokens, torch.stack(rows)


def _inputs(kind: str, seed: int):
    """(target_probs [N, n+1, V], draft_probs [N, n, V] | None, node_token_ids [N, n],
    node_parents [N, n], num_nodes [N], seeds [N], positions [N]) for tree kind "topk" / "iid"."""
    g = torch.Generator().manual_seed(seed)
    seeds = torch.arange(N, dtype=torch.int64) + seed * 10_000_019
    positions = torch.randint(0, 2**40, (N,), generator=g, dtype=torch.int64)
    if kind == "topk":
        parents, tokens, rows = _topk_tree()
        n = len(parents)
        tp = rows[None].expand(N, n + 1, V).contiguous()
        ids = torch.tensor(tokens, dtype=torch.int32)[None].expand(N, n).contiguous()
        dp = None
    else:
        parents = [-1, -1, -1, 0, 0, 1, 1, 2, 2]
        n = len(parents)
        ids = torch.zeros(N, n, dtype=torch.int64)
        ids[:, :3] = torch.multinomial(Q0.expand(N, V), 3, replacement=True, generator=g)
        dp = torch.zeros(N, n, V)
        dp[:, :3] = Q0
        tp = torch.zeros(N, n + 1, V)
        tp[:, 0] = P0
        for j in range(3):
            a = ids[:, j]
            tp[:, j + 1] = T1[a]
            kids = [k for k in range(n) if parents[k] == j]
            ids[:, kids] = torch.multinomial(Q1[a], len(kids), replacement=True, generator=g)
            for k in kids:
                dp[:, k] = Q1[a]
                tp[:, k + 1] = T2[a, ids[:, k]]
        ids = ids.to(torch.int32)
    node_parents = torch.tensor(parents, dtype=torch.int32)[None].expand(N, n).contiguous()
    num_nodes = torch.full((N,), n, dtype=torch.int32)
    return tp, dp, ids, node_parents, num_nodes, seeds, positions


def kernel_sampler(tp, dp, ids, parents, num_nodes, seeds, positions):
    out, acc, _ = ops.rejection_sample_tree(tp, dp, ids, parents, num_nodes, seeds, positions)
    return out, acc


def torch_tree_sampler(tp, dp, ids, parents, num_nodes, seeds, positions, *, test_against_p=False,
                       below_root_only=False, gen_seed=99):
    """Recursive rejection sampling over a tree shared by all requests, vectorised in torch with its
    own randomness. test_against_p: the deliberately wrong variant (siblings tested against the
    node's p, not the residual; the final draw still from the residual), at every node or, with
    below_root_only, only below the root (so only the second token and later are wrong)."""
    g = torch.Generator().manual_seed(gen_seed)
    b, n1, v = tp.shape
    par = parents[0].tolist()
    out = torch.full((b, n1), -1, dtype=torch.int32)
    acc = torch.zeros(b, dtype=torch.int64)
    cur = torch.full((b,), -1, dtype=torch.int64)
    alive = torch.ones(b, dtype=torch.bool)
    for c in range(-1, n1 - 1):                                   # parents come before children
        idx = torch.nonzero(alive & (cur == c)).squeeze(1)
        if idx.numel() == 0:
            continue
        p = tp[idx, c + 1].double()
        res = p.clone()
        decided = torch.zeros(idx.numel(), dtype=torch.bool)
        for j in [k for k in range(n1 - 1) if par[k] == c]:
            x = ids[idx, j].long()
            q = dp[idx, j].double() if dp is not None else torch.nn.functional.one_hot(x, v).double()
            u = torch.rand(idx.numel(), generator=g, dtype=torch.float64)
            against = p if test_against_p and (c >= 0 or not below_root_only) else res
            ok = ~decided & (u * q.gather(1, x[:, None]).squeeze(1) < against.gather(1, x[:, None]).squeeze(1))
            out[idx[ok], acc[idx[ok]]] = x[ok].int()
            cur[idx[ok]] = j
            acc[idx[ok]] += 1
            decided |= ok
            left = (res - q).clamp(min=0)
            mass = left.sum(-1, keepdim=True)
            res = torch.where(mass > 0, left / mass.clamp(min=1e-300), res)
        rest = idx[~decided]
        if rest.numel():
            out[rest, acc[rest]] = torch.multinomial(res[~decided], 1, generator=g).squeeze(1).int()
            alive[rest] = False
    return out, acc.int()


def _checks(sampler, kind: str, seed: int = 11) -> dict[str, tuple[float, float, int]]:
    """{name: (stat, p, dof)}: 'first' y0 ~ p0; 'joint' (y0, y1) ~ p0 T1 with the completion;
    'second' y1 | (A, y0 = a) ~ T1[a]."""
    tp, dp, ids, parents, num_nodes, seeds, positions = _inputs(kind, seed)
    out, acc = sampler(tp, dp, ids, parents, num_nodes, seeds, positions)
    y0 = out[:, 0].long()
    accepted = acc >= 1
    y1 = out[:, 1].long().clone()
    rest = ~accepted
    y1[rest] = ops.sample_tokens(T1[y0[rest]], seeds[rest], positions[rest] + 1, purpose="target").long()
    joint = counts(y0 * V + y1, V * V)
    cond = np.zeros((V, V))
    np.add.at(cond, (y0[accepted].numpy(), y1[accepted].numpy()), 1)
    res = {"first": chisquare_gof(counts(y0, V), P0),
           "joint": chisquare_gof(joint, (P0[:, None] * T1).reshape(-1)),
           "second": chisquare_conditional(cond, T1.numpy())}
    for name, (stat, p, dof) in res.items():
        print(f"[tree-exactness] {sampler.__name__}/{kind}/{name}: stat={stat:.2f} dof={dof} p={p:.3g}")
    return res


@pytest.mark.parametrize("kind", ["topk", "iid"])
def test_tree_first_two_tokens_follow_the_target(kind):
    for name, (stat, p, dof) in _checks(kernel_sampler, kind).items():
        assert p > P_PASS, (kind, name, stat, p, dof)


@pytest.mark.parametrize("kind", ["topk", "iid"])
def test_correct_torch_tree_sampler_passes_the_harness(kind):
    for name, (stat, p, dof) in _checks(torch_tree_sampler, kind).items():
        assert p > P_PASS, (kind, name, stat, p, dof)


@pytest.mark.parametrize("kind", ["topk", "iid"])
def test_wrong_tree_sampler_fails(kind):
    def siblings_against_p(*args):
        return torch_tree_sampler(*args, test_against_p=True)

    res = _checks(siblings_against_p, kind)
    assert res["first"][1] < P_FAIL and res["joint"][1] < P_FAIL, res


@pytest.mark.parametrize("kind", ["topk", "iid"])
def test_wrong_tree_sampler_below_the_root_fails_the_two_token_test(kind):
    """The bug only at depth >= 1: the first token stays right, the two-token tests must catch it."""
    def siblings_against_p_below_root(*args):
        return torch_tree_sampler(*args, test_against_p=True, below_root_only=True)

    res = _checks(siblings_against_p_below_root, kind)
    assert res["first"][1] > P_PASS and res["second"][1] < P_FAIL and res["joint"][1] < P_FAIL, res


def test_topk_tree_accepts_exactly_when_the_token_was_drafted():
    """With one-hot drafts a rejected child's token is removed from the residual, so the first
    token is accepted iff one of the root's children drafted it (no draw is wasted)."""
    tp, dp, ids, parents, num_nodes, seeds, positions = _inputs("topk", 12)
    out, acc = kernel_sampler(tp, dp, ids, parents, num_nodes, seeds, positions)
    drafted = torch.isin(out[:, 0], ids[0, :3])
    assert torch.equal(drafted, acc >= 1)
