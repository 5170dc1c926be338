"""Tree attention: ops.paged_attention's per-row ancestor bits (``tree_mask``) on every path.

Row t at position pos sees key kp iff it would without a tree AND (pos - kp >= 64 or bit pos - kp
of tree_mask[t] is set). Checked: all -1 (and masks that only hide already hidden keys) give the
bits of tree_mask=None at every instruction-set level; random trees after a context against the
float64 reference and against attention computed by hand over context + ancestors, the same bits
on every level and thread count; the model's attention paths (kernel, SDPA, bf16, long trees,
fresh trees, long SDPA chunks) on tree metadata; a real model's tree forward equals its causal
forwards over each node's path; CUDA vs CPU bit for bit (skipped without a GPU)."""
from __future__ import annotations

import random

import pytest
import torch

from specrt import ops
from specrt.ops import reference
from specrt.models.attention import AttentionMetadata
from specrt.models.attention_path import _plan, paged_attention

TOL = 1e-5
BS = 16


def int64(x: int) -> int:
    """A Python int's low 64 bits as a signed int64."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def random_parents(n: int, rng: random.Random) -> list[int]:
    """A random tree of n nodes: parent[i] < i, -1 = a root (a child of the last context key)."""
    parents = [-1]
    for i in range(1, n):
        parents.append(rng.randrange(-1, i) if rng.random() < 0.2 else rng.randrange(max(0, i - 4), i))
    return parents


def ancestors(parents: list[int], i: int) -> list[int]:
    """Node i and its ancestors, root first."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_masks(parents: list[int]) -> list[int]:
    """Each node's ancestor bits when the nodes occupy consecutive keys after the context: bit d is the
    key d positions back, so itself (0), its ancestors (i - j) and every key before the tree (> i)."""
    out = []
    for i in range(len(parents)):
        m = ~((1 << (i + 1)) - 1)
        for j in ancestors(parents, i):
            m |= 1 << (i - j)
        out.append(int64(m))
    return out


def make_batch(seq_lens, query_lens, masks, heads=9, kv_heads=3, head_dim=64, dtype=torch.float32, seed=0,
               padding_rows=0):
    """Random q and cache over shuffled blocks; masks: per request a list of row masks or None (causal).
    Returns (q, cache, meta with meta.tree_mask)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // BS) for s in seq_lens]
    ids = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(ids[i:i + n])
        i += n
    cache = torch.randn(2, len(ids), BS, kv_heads, head_dim, generator=g).to(dtype)
    rows = [x for m, q in zip(masks, query_lens) for x in (m if m is not None else [-1] * q)]
    meta = AttentionMetadata.build(list(seq_lens), list(query_lens), tables, BS, tree_mask=rows)
    q = torch.randn(sum(query_lens) + padding_rows, heads, head_dim, generator=g)
    return q, cache, meta


def run(q, cache, meta, window=0, tree=True, **kw):
    tm = meta.tree_mask if tree else None
    if tm is not None and tm.shape[0] < q.shape[0]:
        tm = torch.cat([tm, tm.new_full((q.shape[0] - tm.shape[0],), -1)])
    return ops.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, q.shape[2] ** -0.5,
                               window, tree_mask=tm, **kw)


def on_every_level(fn) -> list[torch.Tensor]:
    """fn() at every instruction-set level this CPU has (0 .. 4), the default restored afterwards."""
    default = ops.attention_cpu_isa(-1)
    try:
        ops.attention_cpu_isa(4)
        top = ops.attention_cpu_isa(-1)
        outs = []
        for level in range(top + 1):
            ops.attention_cpu_isa(level)
            outs.append(fn())
    finally:
        ops.attention_cpu_isa(default)
    return outs


def by_hand(q, cache, meta, window=0) -> torch.Tensor:
    """Per row, float64 attention over exactly the keys it may see, gathered one by one: keys before
    the row's request's new tokens that the window keeps, then the new keys whose bit is set."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    H, Hkv = q.shape[1], cache.shape[3]
    masks = meta.tree_mask.tolist()
    starts = meta.query_start_loc.tolist()
    for b, (s, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        table = meta.block_tables[b].tolist()
        for i in range(n):
            t = starts[b] + i
            pos = s - n + i
            keys = [kp for kp in range(pos + 1) if (window == 0 or kp > pos - window)
                    and (pos - kp >= 64 or (masks[t] >> (pos - kp)) & 1)]
            k = torch.stack([cache[0, table[kp // BS], kp % BS] for kp in keys]).double()  # [n_keys, Hkv, D]
            v = torch.stack([cache[1, table[kp // BS], kp % BS] for kp in keys]).double()
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            p = (torch.einsum("hd,khd->hk", q[t].double(), k) * q.shape[2] ** -0.5).softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", p, v)
    return out.float()


# ----------------------------------------------------------------------------- -1 == None
SHAPES = [  # seq_lens, query_lens, heads, kv_heads, window
    ([40, 300, 20, 530], [1, 5, 20, 16], 9, 3, 0),
    ([64, 90, 700], [12, 3, 17], 8, 2, 0),
    ([33, 260, 19], [7, 20, 2], 9, 3, 37),
    ([18, 100], [18, 9], 4, 4, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_causal_masks_give_the_bits_of_no_mask(dtype, shape):
    """tree_mask all -1 returns exactly tree_mask=None's bits on every level; so do masks whose cleared
    bits only point at keys that are hidden anyway (before key 0, outside the window), which send the
    tiles near those rows through the masked tree code."""
    seq_lens, query_lens, heads, kv_heads, window = SHAPES[shape]
    q, cache, meta = make_batch(seq_lens, query_lens, [None] * len(seq_lens), heads, kv_heads, 64, dtype,
                                seed=shape, padding_rows=2)
    redundant = []
    for s, n in zip(seq_lens, query_lens):
        for i in range(n):
            pos = s - n + i
            hidden = [d for d in range(64) if d > pos or (window and d >= window)]
            redundant.append(int64(~sum(1 << d for d in hidden)))
    assert any(m != -1 for m in redundant)
    _, _, red_meta = make_batch(seq_lens, query_lens, [redundant[sum(query_lens[:b]):sum(query_lens[:b + 1])]
                                                       for b in range(len(seq_lens))], heads, kv_heads, 64, dtype,
                                seed=shape)
    none = on_every_level(lambda: run(q, cache, meta, window, tree=False))
    ones = on_every_level(lambda: run(q, cache, meta, window))
    red = on_every_level(lambda: run(q, cache, red_meta, window))
    assert all(torch.equal(o, none[0]) for o in none + ones + red)
    assert (none[0] - reference.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                                64 ** -0.5, window)).abs().max().item() <= TOL


# ----------------------------------------------------------------------------- random trees
def tree_batch(dtype, seed, heads=9, kv_heads=3, head_dim=64):
    """Trees of 1..40 nodes after contexts of 0..300 keys, beside a causal verify and a decode."""
    rng = random.Random(seed)
    seq_lens, query_lens, masks = [], [], []
    for ctx, n in [(0, 6), (1, 10), (37, 30), (300, 13), (250, 40), (20, 1)]:
        parents = random_parents(n, rng)
        seq_lens.append(ctx + n)
        query_lens.append(n)
        masks.append(tree_masks(parents))
    seq_lens += [90, 400]
    query_lens += [5, 1]
    masks += [None, None]
    return make_batch(seq_lens, query_lens, masks, heads, kv_heads, head_dim, dtype, seed=seed, padding_rows=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(9, 3, 64, 0), (4, 4, 64, 0), (2, 1, 128, 0),
                                                            (9, 3, 64, 24)])
def test_random_trees_match_reference_and_attention_by_hand(dtype, heads, kv_heads, head_dim, window):
    q, cache, meta = tree_batch(dtype, seed=heads + head_dim + window, heads=heads, kv_heads=kv_heads,
                                head_dim=head_dim)
    outs = on_every_level(lambda: run(q, cache, meta, window))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    out = outs[0]
    want = reference.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     head_dim ** -0.5, window, tree_mask=meta.tree_mask)
    assert (out - want).abs().max().item() <= TOL
    rows = meta.num_tokens
    assert (out[:rows] - by_hand(q[:rows], cache, meta, window)).abs().max().item() <= TOL
    assert torch.all(out[rows:] == 0)
    # the trees matter: causal attention differs
    assert (run(q, cache, meta, window, tree=False) - out).abs().max().item() > 1e-2


def test_tree_bits_independent_of_thread_count_and_neighbours():
    q, cache, meta = tree_batch(torch.bfloat16, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(q, cache, meta)
        torch.set_num_threads(2)
        two = run(q, cache, meta)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # each request alone: the same bits
    starts = meta.query_start_loc.tolist()
    masks = meta.tree_mask.tolist()
    for b, (s, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        table = [x for x in meta.block_tables[b].tolist() if x >= 0]
        alone = AttentionMetadata.build([s], [n], [table], BS, tree_mask=masks[starts[b]:starts[b] + n])
        assert torch.equal(run(q[starts[b]:starts[b] + n].contiguous(), cache, alone), one[starts[b]:starts[b] + n])


def test_bit_63_and_far_keys():
    """Bit 63 (a negative mask) hides or shows the key 63 back; keys 64 and more back are always seen."""
    ctx, n = 100, 2
    keep = int64((1 << 63) | 1)              # itself and the key 63 back only (within reach)
    drop = int64(1)                          # itself only
    q, cache, meta = make_batch([ctx + n], [n], [[keep, drop]], 4, 4, 64, seed=5)
    assert keep < 0
    out = run(q, cache, meta)
    assert (out - by_hand(q, cache, meta)).abs().max().item() <= TOL
    want = reference.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
                                     tree_mask=meta.tree_mask)
    assert (out - want).abs().max().item() <= TOL


def test_bad_tree_mask_is_rejected_naming_it():
    q, cache, meta = make_batch([40, 20], [3, 2], [None, None], 4, 4, 64, seed=6)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
    for bad, match in [(meta.tree_mask.int(), "tree_mask must have dtype torch.int64"),
                       (meta.tree_mask[:4], r"tree_mask must be \[T\] = \[5\]"),
                       (meta.tree_mask[None], r"tree_mask must be \[T\] = \[5\]"),
                       (torch.full((10,), -1)[::2], "tree_mask must be contiguous")]:
        with pytest.raises(ValueError, match=match):
            ops.paged_attention(*args, tree_mask=bad)
    with pytest.raises(ValueError, match="tree_mask must be a torch.Tensor"):
        ops.paged_attention(*args, tree_mask=[-1] * 5)
    with pytest.raises(ValueError, match="tree_mask has 4 entries, the batch has 5 new tokens"):
        AttentionMetadata.build([40, 20], [3, 2], meta.block_tables.tolist(), BS, tree_mask=[-1] * 4)
    with pytest.raises(ValueError, match="tree_mask values must be signed int64"):
        AttentionMetadata.build([40, 20], [3, 2], meta.block_tables.tolist(), BS, tree_mask=[-1] * 4 + [1 << 63])


def test_opcheck_with_tree_mask():
    q, cache, meta = tree_batch(torch.bfloat16, seed=7)
    tm = torch.cat([meta.tree_mask, meta.tree_mask.new_full((3,), -1)])
    torch.library.opcheck(torch.ops.specrt.paged_attention,
                          (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 0, 40, 400, True,
                           tm))


# ----------------------------------------------------------------------------- the model's attention paths
def path_case(layout, seed):
    """layout: per request (context, new tokens, tree?). Returns q, k, v (the new rows' cache values),
    the layer cache and the metadata."""
    rng = random.Random(seed)
    seq_lens = [c + n for c, n, _ in layout]
    query_lens = [n for _, n, _ in layout]
    masks = [tree_masks(random_parents(n, rng)) if tree else None for _, n, tree in layout]
    q, cache, meta = make_batch(seq_lens, query_lens, masks, 6, 2, 64, seed=seed)
    k, v = [], []
    for b, (s, n) in enumerate(zip(seq_lens, query_lens)):
        for p in range(s - n, s):
            blk = int(meta.block_tables[b, p // BS])
            k.append(cache[0, blk, p % BS])
            v.append(cache[1, blk, p % BS])
    return q, torch.stack(k), torch.stack(v), cache, meta


LAYOUTS = {
    # a 30-node tree and an 8-node one beside a decode and a verify: one kernel call
    "verify": [(37, 30, True), (200, 8, True), (90, 1, False), (60, 5, False)],
    # beside a fresh prefill and a long causal chunk (SDPA on the sdpa path), and a tree with no context (not a fresh prefill)
    "mixed": [(0, 12, False), (40, 30, True), (70, 24, False), (0, 9, True), (300, 1, False)],
    # a 30-node tree after a short context beside a long decode: SDPA runs it alone (long chunk)
    "long": [(5, 30, True), (500, 1, False)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", ["kernel", "sdpa", "bf16"])
def test_attention_path_honors_tree_mask(layout, backend):
    q, k, v, cache, meta = path_case(LAYOUTS[layout], seed=len(layout))
    plan = _plan(meta)
    long, batch = plan.kernel()
    assert not any(plan.tree[b] for b, *_ in long) and not any(plan.tree[b] for b, *_ in plan.fresh)
    assert batch is not None and batch.rows is None and not long  # the CPU: every request in one kernel call
    if layout == "long" and backend != "kernel":
        assert [b for b, *_ in plan.sdpa()[0]] == [0]  # the tree runs through _attend_long
    want = reference.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
                                     tree_mask=meta.tree_mask)
    if backend == "bf16":
        got = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), meta, 0.125)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max().item() <= 0.05
        causal = reference.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
        assert (causal - want).abs().max().item() > 0.2  # the tolerance above still tells trees from causal
    else:
        got = paged_attention(q, k, v, cache, meta, 0.125, backend=backend)
        assert (got - want).abs().max().item() <= TOL


def test_kernel_path_pads_tree_rows():
    """q with trailing padding rows (slot -1): the kernel's tree_mask is padded with -1."""
    q, k, v, cache, meta = path_case(LAYOUTS["verify"], seed=9)
    rows = q.shape[0]
    qp = torch.cat([q, torch.randn(3, *q.shape[1:])])
    got = paged_attention(qp, torch.cat([k, k[:3]]), torch.cat([v, v[:3]]), cache, meta, 0.125)
    assert torch.equal(got[:rows], paged_attention(q, k, v, cache, meta, 0.125)) and torch.all(got[rows:] == 0)


# ----------------------------------------------------------------------------- a real model
@pytest.fixture(scope="module")
def target():
    from specrt.models.sources import resolve_model_path
    from specrt.models import load_model

    try:
        path = resolve_model_path("builtin", "target")
    except ValueError:
        pytest.skip("the built-in target is not present")
    return load_model(path, dtype=torch.float32)


def _forward(model, tokens, positions, seq_len, table, cache, tree_mask=None):
    n = len(tokens)
    meta = AttentionMetadata.build([seq_len], [n], [table], cache.shape[3], tree_mask=tree_mask)
    logits, _ = model(torch.tensor(tokens), torch.tensor(positions), meta, cache)
    return logits


@pytest.mark.parametrize("mode", ["stack", "ops", "sdpa"])
def test_model_tree_forward_equals_causal_forward_of_each_path(target, mode):
    """Context + a 12-node tree in ONE forward (nodes at consecutive slots, position = depth after the
    context): every node's logits equal a plain causal forward over context + the node's path."""
    cfg = target.config
    target.set_layer_stack(mode == "stack")
    target.set_attention_backend("sdpa" if mode == "sdpa" else "kernel")
    try:
        rng = random.Random(11)
        ctx = [rng.randrange(cfg.vocab_size) for _ in range(37)]
        parents = [-1, 0, 0, 1, 1, 2, 3, -1, 7, 5, 8, 4]
        nodes = [rng.randrange(cfg.vocab_size) for _ in parents]
        depth = [len(ancestors(parents, i)) for i in range(len(parents))]  # root: 1
        C, n = len(ctx), len(nodes)
        shape = (cfg.num_layers, 2, 8, BS, cfg.num_kv_heads, cfg.head_dim)
        cache = torch.zeros(shape)
        table = [5, 2, 7, 0]
        _forward(target, ctx, list(range(C)), C, table, cache)
        tree_logits = _forward(target, nodes, [C - 1 + d for d in depth], C + n, table, cache, tree_masks(parents))
        for i in range(n):
            path = [nodes[j] for j in ancestors(parents, i)]
            fresh = torch.zeros(shape)
            want = _forward(target, ctx + path, list(range(C + len(path))), C + len(path), table, fresh)[-1]
            assert torch.allclose(tree_logits[i], want, atol=1e-4, rtol=1e-4), (i, (tree_logits[i] - want).abs().max())
        # without its tree mask the same forward is wrong for nodes with an earlier non-ancestor
        causal = _forward(target, nodes, [C - 1 + d for d in depth], C + n, table, cache.clone())
        assert (causal[2] - tree_logits[2]).abs().max().item() > 1e-2
    finally:
        target.set_layer_stack(True)
        target.set_attention_backend("kernel")


# ----------------------------------------------------------------------------- CUDA vs CPU
@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()), reason="needs CUDA and the CUDA build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 24])
def test_cuda_tree_matches_cpu_bit_for_bit(dtype, window):
    q, cache, meta = tree_batch(dtype, seed=13)
    want = run(q, cache, meta, window)
    tm = torch.cat([meta.tree_mask, meta.tree_mask.new_full((3,), -1)]).cuda()
    got = ops.paged_attention(q.cuda(), cache.cuda(), meta.block_tables.cuda(), meta.seq_lens.cuda(),
                              meta.query_start_loc.cuda(), 0.125, window, max_query_len=40, max_seq_len=400,
                              tree_mask=tm)
    assert torch.equal(got.cpu(), want)
    none = ops.paged_attention(q.cuda(), cache.cuda(), meta.block_tables.cuda(), meta.seq_lens.cuda(),
                               meta.query_start_loc.cuda(), 0.125, window, max_query_len=40, max_seq_len=400,
                               tree_mask=torch.full_like(tm, -1))
    assert torch.equal(none.cpu(), run(q, cache, meta, window, tree=False))
    with pytest.raises(ValueError, match="tree_mask must be on cuda"):
        ops.paged_attention(q.cuda(), cache.cuda(), meta.block_tables.cuda(), meta.seq_lens.cuda(),
                            meta.query_start_loc.cuda(), 0.125, window, max_query_len=40, max_seq_len=400,
                            tree_mask=tm.cpu())
