"""Token-tree verification (verify_tree_greedy, rejection_sample_tree) and copy_slots
(docs/architecture.md section 2, "Token trees"; issue 32 parts 4-5).

* the CPU kernels return exactly what specrt/ops/reference.py returns, on random trees (chains,
  stars, deep and wide trees, empty ones, duplicate siblings, one-hot target rows, a residual
  with no mass), on every CPU instruction set;
* a chain given as a tree (parents -1, 0, 1, ...) returns the chain ops' tokens and counts bit
  for bit (verify_greedy, rejection_sample with and without draft_probs, coupled);
* coupled verification emits plain autoregressive sample_tokens(purpose="target") tokens;
* greedy follows the right path in hand-built trees;
* bad inputs raise, naming the argument; unchecked garbage never faults;
* copy_slots equals its reference, gathers before it scatters (overlapping chains), serves
  several caches in one call;
* CUDA == CPU bit for bit (skipped without a GPU).
Statistical exactness is in tests/test_tree_exactness.py.
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops
from specrt.models import attention
from specrt.ops import reference

from _cases import gen, greedy_case, seeds_positions, spec_case, tree_case, tree_greedy_case  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and ops.cuda_built()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of specrt (SPECRT_CUDA=1)")


def _isas() -> list[str]:
    """The CPU instruction sets this machine can run (every one must give the same bits)."""
    names = []
    prev = torch.ops.specrt.set_cpu_isa("auto")
    for name in ("scalar", "avx2", "avx512"):
        try:
            torch.ops.specrt.set_cpu_isa(name)
            names.append(name)
        except (RuntimeError, ValueError):
            pass
    torch.ops.specrt.set_cpu_isa(prev)
    return names


@pytest.fixture(params=_isas())
def isa(request):
    prev = torch.ops.specrt.set_cpu_isa(request.param)
    yield request.param
    torch.ops.specrt.set_cpu_isa(prev)


def _chain_parents(b: int, k: int) -> torch.Tensor:
    return torch.arange(-1, k - 1, dtype=torch.int32).expand(b, k).contiguous()


def _equal(got, want):
    assert len(got) == len(want)
    for a, w in zip(got, want):
        assert a.dtype == w.dtype and a.shape == w.shape, (a.dtype, w.dtype, a.shape, w.shape)
        assert torch.equal(a, w), (a, w)


# --------------------------------------------------------------------------- #
# kernels == reference on random trees
# --------------------------------------------------------------------------- #
TREE_CASES = [(b, n, v) for b, n, v in ((1, 1, 2), (4, 3, 7), (6, 8, 300), (5, 12, 1000), (4, 6, 5003))]


@pytest.mark.parametrize("b,n,v", TREE_CASES)
def test_verify_tree_greedy_matches_reference(b, n, v, isa):
    logits, ids, parents, counts = tree_greedy_case(b, n, v, gen("tree-greedy", b, n, v))
    got = ops.verify_tree_greedy(logits, ids, parents, counts)
    _equal(got, reference.verify_tree_greedy(logits, ids, parents, counts))
    assert int(got[1].max()) >= 1                        # some paths were accepted


@pytest.mark.parametrize("b,n,v", TREE_CASES)
@pytest.mark.parametrize("method,with_q", [("rejection", True), ("rejection", False), ("coupled", False)])
def test_rejection_sample_tree_matches_reference(b, n, v, method, with_q, isa):
    tp, dp, ids, parents, counts, seeds, positions = tree_case(b, n, v, with_q, gen("tree", b, n, v, with_q))
    got = ops.rejection_sample_tree(tp, dp, ids, parents, counts, seeds, positions, method=method)
    want = reference.rejection_sample_tree(tp, dp, ids, parents, counts, seeds, positions, method=method)
    _equal(got, want)
    out, acc, nodes = got
    for r in range(b):                                   # the path is a root-to-node path of the tree
        a = int(acc[r])
        assert (out[r, :a + 1] >= 0).all() and (out[r, a + 1:] == -1).all() and (nodes[r, a:] == -1).all()
        parent = -1
        for i in range(a):
            j = int(nodes[r, i])
            assert int(parents[r, j]) == parent and int(ids[r, j]) == int(out[r, i])
            parent = j


def _depth(parents_row: torch.Tensor, node: int) -> int:
    """Depth of `node` (-1 = the root, depth 0)."""
    d = 0
    while node >= 0:
        node, d = int(parents_row[node]), d + 1
    return d


def test_tree_cases_reach_every_branch():
    """The random cases above do accept deep paths and later siblings (rank >= 1)."""
    deep = later = 0
    for with_q in (True, False):
        tp, dp, ids, parents, counts, seeds, positions = tree_case(6, 8, 300, with_q, gen("tree", 6, 8, 300, with_q))
        _, acc, nodes = ops.rejection_sample_tree(tp, dp, ids, parents, counts, seeds, positions)
        deep += int((acc >= 2).sum())
        for r in range(6):
            for i in range(int(acc[r])):
                parent = int(nodes[r, i - 1]) if i else -1
                later += int(nodes[r, i]) != reference.tree_children(parents[r], int(counts[r]), parent)[0]
    assert deep and later


def test_residual_mass_is_the_fixed_order_sum():
    """reference.tree_mass is specrt/tree.h's order (lane v % 256 adds in increasing v, then the
    lanes pairwise), computed here independently in numpy float32."""
    import numpy as np
    g = gen("mass")
    for n in (1, 255, 256, 257, 5003):
        w = (torch.rand(n, generator=g) ** 8).numpy().astype(np.float32)
        lanes = np.zeros(256, dtype=np.float32)
        for v in range(n):
            lanes[v % 256] = np.float32(lanes[v % 256] + w[v])
        s = 128
        while s:
            lanes[:s] = (lanes[:s] + lanes[s:2 * s]).astype(np.float32)
            s //= 2
        assert float(reference.tree_mass(torch.from_numpy(w))) == float(lanes[0])


# --------------------------------------------------------------------------- #
# a chain given as a tree == the chain ops, bit for bit
# --------------------------------------------------------------------------- #
CHAIN_CASES = [(b, v, k) for b in (1, 3, 17) for v in (2, 7, 1000, 5003) for k in (0, 1, 4, 8)]


@pytest.mark.parametrize("b,v,k", CHAIN_CASES)
def test_chain_as_tree_equals_verify_greedy(b, v, k):
    for trial in range(3):
        logits, ids, nd = greedy_case(b, v, k, gen("chain-greedy", b, v, k, trial), jitter=trial == 1)
        out, acc = ops.verify_greedy(logits, ids, nd)
        t_out, t_acc, nodes = ops.verify_tree_greedy(logits, ids, _chain_parents(b, k), nd)
        assert torch.equal(t_out, out) and torch.equal(t_acc, acc)
        for r in range(b):
            a = int(acc[r])
            assert torch.equal(nodes[r, :a], torch.arange(a, dtype=torch.int32)) and (nodes[r, a:] == -1).all()


@pytest.mark.parametrize("b,v,k", CHAIN_CASES)
@pytest.mark.parametrize("method,with_q", [("rejection", True), ("rejection", False), ("coupled", True),
                                           ("coupled", False)])
def test_chain_as_tree_equals_rejection_sample(b, v, k, method, with_q):
    for trial in range(2):
        tp, dp, ids, nd, seeds, positions = spec_case(b, v, k, with_q, gen("chain", b, v, k, with_q, trial))
        out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, positions, method=method)
        t_out, t_acc, nodes = ops.rejection_sample_tree(tp, dp, ids, _chain_parents(b, k), nd, seeds, positions,
                                                        method=method)
        assert torch.equal(t_out, out), (trial, t_out, out)
        assert torch.equal(t_acc, acc)
        for r in range(b):
            a = int(acc[r])
            assert torch.equal(nodes[r, :a], torch.arange(a, dtype=torch.int32)) and (nodes[r, a:] == -1).all()


def test_chain_as_tree_on_many_random_inputs():
    """Thousands of independent chains in a few calls (random p, q, lengths, seeds, positions)."""
    g = gen("many-chains")
    for trial in range(6):
        b, v, k = 512, int(torch.randint(2, 600, (1,), generator=g)), int(torch.randint(0, 7, (1,), generator=g))
        for with_q in (True, False):
            tp, dp, ids, nd, seeds, positions = spec_case(b, v, k, with_q, g)
            for method in ("rejection", "coupled"):
                out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, positions, method=method)
                t_out, t_acc, _ = ops.rejection_sample_tree(tp, dp, ids, _chain_parents(b, k), nd, seeds, positions,
                                                            method=method)
                assert torch.equal(t_out, out) and torch.equal(t_acc, acc), (trial, with_q, method)


# --------------------------------------------------------------------------- #
# coupled = autoregressive sampling; greedy picks the right path
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("v", [5, 300])
def test_coupled_tree_emits_autoregressive_tokens(v):
    """Every emitted token is sample_tokens(row of the path so far, seed, pos + i, "target"), and the
    path is the deepest one the tree offers: whatever the tree, the output is plain sampling."""
    g = gen("coupled-ar", v)
    b, n = 64, 10
    tp, _, ids, parents, counts, seeds, positions = tree_case(b, n, v, False, g)
    # half the nodes carry their parent's own race winner: long accepted paths
    for r in range(b):
        for j in range(int(counts[r])):
            if torch.rand(1, generator=g) < 0.5:
                c = int(parents[r, j])
                ids[r, j] = int(ops.sample_tokens(tp[r, c + 1][None].contiguous(), seeds[r:r + 1],
                                                  positions[r:r + 1] + _depth(parents[r], c)))
    out, acc, nodes = ops.rejection_sample_tree(tp, None, ids, parents, counts, seeds, positions, method="coupled")
    assert int(acc.max()) >= 2
    for r in range(b):
        node = -1
        for i in range(int(acc[r]) + 1):
            want = ops.sample_tokens(tp[r, node + 1][None].contiguous(), seeds[r:r + 1], positions[r:r + 1] + i)
            assert int(out[r, i]) == int(want), (r, i)
            if i < int(acc[r]):
                node = int(nodes[r, i])
        # no child of the last node drafted the emitted token
        last = reference.tree_children(parents[r], int(counts[r]), node)
        assert all(int(ids[r, j]) != int(out[r, int(acc[r])]) for j in last)


def _logits(v: int, rows: dict[int, int], n1: int) -> torch.Tensor:
    """[1, n1, v] logits, row i's argmax at rows[i] (others 0 < 1)."""
    x = torch.zeros(1, n1, v)
    for i, t in rows.items():
        x[0, i, t] = 1.0
    return x


def test_greedy_follows_the_argmax_path_in_a_hand_built_tree():
    #            root (row 0: argmax 3)
    #     0:5      1:3        2:3           <- node 1 is the first child with token 3 (node 2 duplicates it)
    #            3:7  4:2     5:2           <- row 2 (node 1): argmax 2 -> node 4; node 5 hangs under node 2
    #                 6:1 7:4               <- row 5 (node 4): argmax 4 -> node 7; row 8 (node 7): argmax 6
    ids = torch.tensor([[5, 3, 3, 7, 2, 2, 1, 4]], dtype=torch.int32)
    parents = torch.tensor([[-1, -1, -1, 1, 1, 2, 4, 4]], dtype=torch.int32)
    logits = _logits(10, {0: 3, 1: 9, 2: 2, 3: 2, 4: 0, 5: 4, 6: 0, 7: 1, 8: 6}, 9)
    out, acc, nodes = ops.verify_tree_greedy(logits, ids, parents, [8])
    assert out.tolist() == [[3, 2, 4, 6, -1, -1, -1, -1, -1]]
    assert acc.tolist() == [3] and nodes.tolist() == [[1, 4, 7, -1, -1, -1, -1, -1]]
    # fewer nodes: node 7 is not in the tree, so the walk stops at node 4 and emits its argmax
    out, acc, nodes = ops.verify_tree_greedy(logits, ids, parents, [7])
    assert out.tolist()[0][:3] == [3, 2, 4] and acc.tolist() == [2] and nodes.tolist()[0][:3] == [1, 4, -1]
    # the root's argmax drafted by nobody: nothing accepted
    out, acc, _ = ops.verify_tree_greedy(_logits(10, {0: 8}, 9), ids, parents, [8])
    assert out.tolist()[0][:2] == [8, -1] and acc.tolist() == [0]


def test_greedy_tree_nan_and_ties():
    """NaN counts as -inf and ties go to the lowest id, as verify_greedy."""
    logits = torch.tensor([[[float("nan"), 2.0, 2.0, 1.0], [5.0, float("nan"), 5.0, 0.0],
                            [0.0, 0.0, 0.0, 0.0]]])
    out, acc, nodes = ops.verify_tree_greedy(logits, [[2, 1]], [[-1, -1]], [2])
    assert out.tolist() == [[1, 0, -1]] and acc.tolist() == [1] and nodes.tolist() == [[1, -1]]


def test_rejection_tree_accepts_a_sure_child_at_every_rank():
    """One-hot q at a token with p = 1 passes at once; a sibling after children whose p is 0 is
    still accepted with p_res = 1 (their rejections leave the residual unchanged)."""
    v = 6
    p = torch.zeros(1, 5, v)
    p[0, :, 4] = 1.0
    ids = [[0, 1, 4, 2]]                           # children of the root; only token 4 has mass
    out, acc, nodes = ops.rejection_sample_tree(p, None, ids, [[-1, -1, -1, 2]], [4], [3], [10])
    assert out.tolist()[0][:3] == [4, 4, -1] and acc.tolist() == [1] and nodes.tolist()[0][:2] == [2, -1]


# --------------------------------------------------------------------------- #
# bad inputs
# --------------------------------------------------------------------------- #
def _valid():
    """A valid call: B = 2 requests, N = 3 nodes, V = 5."""
    g = gen("valid")
    tp = torch.rand(2, 4, 5, generator=g) + 0.1
    dp = torch.rand(2, 3, 5, generator=g) + 0.1
    return dict(target_probs=tp / tp.sum(-1, keepdim=True), draft_probs=dp / dp.sum(-1, keepdim=True),
                node_token_ids=torch.tensor([[1, 2, 3], [0, 4, 2]]), node_parents=torch.tensor([[-1, 0, 0], [-1, -1, 1]]),
                num_nodes=torch.tensor([3, 3]), seeds=torch.tensor([5, 6]), positions=torch.tensor([10, 20]))


@pytest.mark.parametrize("change,exc,name", [
    (dict(node_token_ids=torch.zeros(2, 3)), TypeError, "node_token_ids"),
    (dict(node_parents=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "node_parents"),
    (dict(node_parents=torch.zeros(3, dtype=torch.int32)), ValueError, "node_parents"),
    (dict(num_nodes=torch.zeros(3, dtype=torch.int32)), ValueError, "num_nodes"),
    (dict(num_nodes=torch.tensor([4, 0])), ValueError, "num_nodes[0]"),
    (dict(num_nodes=torch.tensor([-1, 0])), ValueError, "num_nodes[0]"),
    (dict(node_parents=torch.tensor([[-1, 1, 0], [-1, 0, 1]]), num_nodes=[3, 3]), ValueError, "node_parents[0, 1]"),
    (dict(node_parents=torch.tensor([[-1, 0, 0], [-1, -2, 1]]), num_nodes=[3, 3]), ValueError, "node_parents[1, 1]"),
    (dict(node_parents=torch.tensor([[0, 0, 0], [-1, 0, 1]]), num_nodes=[3, 3]), ValueError, "node_parents[0, 0]"),
    (dict(node_token_ids=torch.tensor([[0, 5, 0], [0, 0, 0]]), num_nodes=[3, 3]), ValueError, "node_token_ids[0, 1]"),
    (dict(node_token_ids=torch.tensor([[0, 0, 0], [0, 0, -1]]), num_nodes=[3, 3]), ValueError, "node_token_ids[1, 2]"),
    (dict(target_probs=torch.full((2, 4, 5), 0.2, dtype=torch.float64).int()), TypeError, "target_probs"),
    (dict(target_probs=torch.full((2, 3, 5), 0.2)), ValueError, "node_token_ids"),
    (dict(draft_probs=torch.full((2, 4, 5), 0.2)), ValueError, "draft_probs"),
    (dict(draft_probs=torch.full((2, 3, 5), -0.2)), ValueError, "draft_probs"),
    (dict(target_probs=torch.full((2, 4, 5), float("nan"))), ValueError, "target_probs"),
    (dict(target_probs=torch.zeros(2, 4, 5)), ValueError, "target_probs[0, 0]"),
    (dict(seeds=torch.zeros(2)), TypeError, "seeds"),
    (dict(seeds=torch.zeros(3, dtype=torch.int64)), ValueError, "seeds"),
    (dict(positions=torch.tensor([-1, 0])), ValueError, "positions[0]"),
    (dict(node_parents=torch.zeros(2, 3, dtype=torch.int32, device="meta")), ValueError, "node_parents"),
    (dict(draft_probs=torch.zeros(2, 3, 5, device="meta")), ValueError, "draft_probs"),
])
def test_rejection_sample_tree_bad_input_names_the_argument(change, exc, name):
    args = {**_valid(), **change}
    with pytest.raises(exc, match=name.replace("[", r"\[").replace("]", r"\]")):
        ops.rejection_sample_tree(**args)


def test_tree_bad_method_and_greedy_checks():
    a = _valid()
    with pytest.raises(ValueError, match="method"):
        ops.rejection_sample_tree(**a, method="greedy")
    logits = torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match=r"node_parents\[0, 2\]"):
        ops.verify_tree_greedy(logits, [[0, 1, 2], [0, 0, 0]], [[-1, 0, 2], [-1, -1, -1]], [3, 3])
    with pytest.raises(ValueError, match=r"node_token_ids\[1, 0\]"):
        ops.verify_tree_greedy(logits, [[0, 1, 2], [7, 0, 0]], [[-1, 0, 1], [-1, -1, -1]], [3, 3])
    with pytest.raises(TypeError, match="target_logits"):
        ops.verify_tree_greedy(logits.int(), [[0, 1, 2]] * 2, [[-1, 0, 1]] * 2, [3, 3])
    with pytest.raises(ValueError, match="num_nodes"):
        ops.verify_tree_greedy(logits, [[0, 1, 2]] * 2, [[-1, 0, 1]] * 2, [3, 3, 3])
    with pytest.raises(TypeError, match="node_parents"):
        ops.verify_tree_greedy(logits, [[0, 1, 2]] * 2, [[-1.0, 0, 1]] * 2, [3, 3])


def test_unchecked_garbage_never_faults():
    """check_values=False: out-of-range parents, tokens and counts (also past int32) stay in bounds."""
    g = gen("garbage")
    b, n, v = 8, 6, 11
    tp = torch.rand(b, n + 1, v, generator=g)
    dp = torch.rand(b, n, v, generator=g)
    ids = torch.randint(-2**40, 2**40, (b, n), generator=g)
    ids[:, ::2] = torch.randint(0, v, (b, (n + 1) // 2), generator=g)
    parents = torch.randint(-2**35, 2**35, (b, n), generator=g)
    parents[:, 1::2] = torch.randint(-3, n + 2, (b, n // 2), generator=g)
    counts = torch.tensor([-5, 0, 3, n, n + 1, 2**40, -2**40, 4])
    seeds, positions = seeds_positions(g, b)
    for method in ("rejection", "coupled"):
        for q in (dp, None):
            out, acc, nodes = ops.rejection_sample_tree(tp, q, ids, parents, counts, seeds, positions, method=method,
                                                        check_values=False)
            assert ((out >= -1) & (out < v)).all() and ((acc >= 0) & (acc <= n)).all()
            assert ((nodes >= -1) & (nodes < n)).all()
    out, acc, nodes = ops.verify_tree_greedy(tp, ids, parents, counts, check_values=False)
    assert ((out >= -1) & (out < v)).all() and ((acc >= 0) & (acc <= n)).all()


def test_empty_batch_and_no_nodes():
    out, acc, nodes = ops.rejection_sample_tree(torch.rand(0, 3, 4), None, torch.zeros(0, 2, dtype=torch.int32),
                                                torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                                torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 3) and acc.shape == (0,) and nodes.shape == (0, 2)
    p = torch.full((1, 1, 4), 0.25)
    out, acc, nodes = ops.rejection_sample_tree(p, None, torch.zeros(1, 0, dtype=torch.int32),
                                                torch.zeros(1, 0, dtype=torch.int32), [0], [1], [2])
    want = ops.sample_tokens(p[:, 0].contiguous(), [1], [2], purpose="residual")   # the bonus draw
    assert out.tolist() == [[int(want)]] and acc.tolist() == [0] and nodes.shape == (1, 0)


# --------------------------------------------------------------------------- #
# copy_slots
# --------------------------------------------------------------------------- #
def _caches(g, device="cpu"):
    """Two caches of different layers / heads / dims / dtypes / block sizes (slots are per cache)."""
    return [torch.randn(3, 2, 6, 4, 2, 8, generator=g).to(device),
            torch.randn(2, 2, 5, 5, 1, 3, generator=g).to(device=device, dtype=torch.bfloat16)]


MAPPINGS = {
    # a tree path's nodes at slots 10, 13, 15 move down to 8, 9, 10: slot 10 is read (-> 8) and written
    "path_down": [[10, 8], [13, 9], [15, 10]],
    # a chain where copying pair by pair in order would read an already-overwritten slot
    "overlapping_chain": [[6, 5], [5, 4], [7, 6]],
    "swap": [[3, 7], [7, 3]],
    "self_and_far": [[4, 4], [0, 23], [23, 1]],
    "single": [[2, 17]],
}


@pytest.mark.parametrize("name", sorted(MAPPINGS))
def test_copy_slots_matches_reference(name):
    g = gen("copy-slots", name)
    mapping = torch.tensor(MAPPINGS[name], dtype=torch.int64)
    caches = _caches(g)
    want = [c.clone() for c in caches]
    reference.copy_slots(want, mapping)
    ops.copy_slots(caches, mapping)
    for c, w in zip(caches, want):
        assert torch.equal(c, w)
    # gather-then-scatter, spelled out on the originals
    orig = _caches(gen("copy-slots", name))
    for c, o in zip(caches, orig):
        bs = c.shape[3]
        for src, dst in mapping.tolist():
            assert torch.equal(c[:, :, dst // bs, dst % bs], o[:, :, src // bs, src % bs])
        touched = {dst for _, dst in mapping.tolist()}
        for s in range(c.shape[2] * bs):
            if s not in touched:
                assert torch.equal(c[:, :, s // bs, s % bs], o[:, :, s // bs, s % bs])


def test_copy_slots_lists_and_wrapper():
    g = gen("copy-slots-list")
    caches = _caches(g)
    want = [c.clone() for c in caches]
    reference.copy_slots(want, torch.tensor([[6, 5], [5, 4]]))
    attention.copy_slots(caches, torch.tensor([[6, 5], [5, 4]]))
    assert all(torch.equal(c, w) for c, w in zip(caches, want))
    ops.copy_slots(caches, [[1, 2], [2, 3]])                       # a list mapping
    reference.copy_slots(want, torch.tensor([[1, 2], [2, 3]]))
    assert all(torch.equal(c, w) for c, w in zip(caches, want))
    ops.copy_slots(caches[0], [])                                   # one cache, nothing to do
    attention.copy_slots(caches, torch.zeros(0, 2, dtype=torch.int64))


@pytest.mark.parametrize("mapping,exc,match", [
    ([[1, 2], [3, 2]], ValueError, "duplicate destination slot 2"),
    ([[1, 24]], ValueError, r"slot_mapping\[0\] = \(1, 24\) is out of range for caches\[0\] with 24 slots"),
    ([[0, 1], [2, 30]], ValueError, r"slot_mapping\[1\] = \(2, 30\) is out of range"),
    ([[-1, 2]], ValueError, "out of range"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "slot_mapping"),
    (torch.tensor([[1, 2, 3]]), ValueError, "slot_mapping must be"),
    (torch.tensor([[1, 2]], dtype=torch.int32), TypeError, "slot_mapping"),
])
def test_copy_slots_bad_input(mapping, exc, match):
    with pytest.raises(exc, match=match):
        ops.copy_slots(_caches(gen("bad")), mapping)


def test_copy_slots_bad_caches():
    with pytest.raises(ValueError, match=r"caches\[0\]"):
        ops.copy_slots([torch.zeros(2, 3, 4, 4, 1, 2)], [[0, 1]])
    with pytest.raises(ValueError, match="caches"):
        ops.copy_slots([], [[0, 1]])
    with pytest.raises(ValueError, match=r"caches\[1\]"):
        ops.copy_slots([torch.zeros(1, 2, 2, 2, 1, 1), torch.zeros(1, 2, 2, 2, 1, 1, device="meta")], [[0, 1]])


# --------------------------------------------------------------------------- #
# speed: much faster than the reference
# --------------------------------------------------------------------------- #
def test_tree_kernel_is_much_faster_than_the_reference():
    """One thread each (a shared, busy machine makes OpenMP timings noisy); best of several runs."""
    import time
    tp, dp, ids, parents, counts, seeds, positions = tree_case(8, 12, 4000, True, gen("speed"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def best(fn, runs):
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                result = fn()
                times.append(time.perf_counter() - t0)
            return min(times), result
        t_ref, want = best(lambda: reference.rejection_sample_tree(tp, dp, ids, parents, counts, seeds, positions), 2)
        t_kernel, got = best(lambda: ops.rejection_sample_tree(tp, dp, ids, parents, counts, seeds, positions,
                                                               check_values=False), 10)
    finally:
        torch.set_num_threads(threads)
    _equal(got, want)
    print(f"rejection_sample_tree B=8 N=12 V=4000: kernel {t_kernel * 1e3:.3f} ms, reference {t_ref * 1e3:.1f} ms")
    assert t_kernel * 50 < t_ref, (t_kernel, t_ref)


# --------------------------------------------------------------------------- #
# CUDA == CPU, bit for bit
# --------------------------------------------------------------------------- #
CUDA_CASES = [(b, n, v) for b in (1, 5, 33) for n in (0, 1, 6, 16) for v in (2, 7, 1000, 32003, 128256)
              if b * (n + 1) * v <= 30_000_000]


def _to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


@cuda
@pytest.mark.parametrize("b,n,v", CUDA_CASES)
@pytest.mark.parametrize("method,with_q", [("rejection", True), ("rejection", False), ("coupled", False)])
def test_rejection_sample_tree_cuda_equals_cpu(b, n, v, method, with_q):
    case = tree_case(b, n, v, with_q, gen("tree-cuda", b, n, v, with_q))
    want = ops.rejection_sample_tree(*case, method=method)
    got = ops.rejection_sample_tree(*_to("cuda", *case), method=method)
    _equal([t.cpu() for t in got], want)


@cuda
@pytest.mark.parametrize("b,n,v", CUDA_CASES)
def test_verify_tree_greedy_cuda_equals_cpu(b, n, v):
    case = tree_greedy_case(b, n, v, gen("tree-greedy-cuda", b, n, v))
    want = ops.verify_tree_greedy(*case)
    got = ops.verify_tree_greedy(*_to("cuda", *case))
    _equal([t.cpu() for t in got], want)


@cuda
def test_tree_cuda_chain_equals_chain_cuda_and_no_host_sync():
    b, v, k = 17, 32003, 8
    tp, dp, ids, nd, seeds, positions = _to("cuda", *spec_case(b, v, k, True, gen("chain-cuda")))
    parents = _chain_parents(b, k).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for method in ("rejection", "coupled"):
            out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, positions, method=method)
            t_out, t_acc, _ = ops.rejection_sample_tree(tp, dp, ids, parents, nd, seeds, positions, method=method)
            assert torch.equal(t_out, out) and torch.equal(t_acc, acc)
        ops.verify_tree_greedy(tp, ids, parents, nd)
        ops.copy_slots([torch.zeros(2, 2, 4, 4, 2, 8, device="cuda")], torch.tensor([[3, 1], [1, 0]], device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
@pytest.mark.parametrize("name", sorted(MAPPINGS))
@pytest.mark.parametrize("mapping_on_device", [False, True])
def test_copy_slots_cuda_exact(name, mapping_on_device):
    mapping = torch.tensor(MAPPINGS[name], dtype=torch.int64)
    want = _caches(gen("copy-slots-cuda", name))
    reference.copy_slots(want, mapping)
    got = _caches(gen("copy-slots-cuda", name), "cuda")
    ops.copy_slots(got, mapping.cuda() if mapping_on_device else mapping)
    for c, w in zip(got, want):
        assert torch.equal(c.cpu(), w)
