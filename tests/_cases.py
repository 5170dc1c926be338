"""Input builders shared by the CPU-vs-reference (test_ops_reference.py) and CUDA-vs-CPU
(test_cuda_kernels.py) kernel tests: one set of cases, run against both oracles."""
from __future__ import annotations

import zlib

import torch

from specrt.ops import reference


def gen(*key) -> torch.Generator:
    """A generator seeded from ``key`` (crc32, not hash(): str hashes vary per process)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def seeds_positions(g: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [B] int64 incl. negative, > 2^32 and extreme ones; positions [B] int64 incl. one
    whose draft positions straddle the 2^32 word boundary and a small one."""
    seeds = torch.randint(-2**63, 2**63 - 1, (b,), generator=g, dtype=torch.int64)
    specials = torch.tensor([-1, 2**32 + 5, -2**40 - 3, 0, 2**63 - 1], dtype=torch.int64)
    seeds[: min(b, 5)] = specials[: min(b, 5)]
    positions = torch.randint(0, 2**50, (b,), generator=g, dtype=torch.int64)
    positions[0] = 2**32 - 2
    if b > 1:
        positions[1] = 3
    return seeds, positions


def random_rows(g: torch.Generator, shape: tuple[int, ...], v: int, sparsity: float = 0.3) -> torch.Tensor:
    """Normalised probability rows [*shape, V] with ~sparsity zeros, never an all-zero row."""
    x = torch.rand(*shape, v, generator=g) ** 2
    x = torch.where(torch.rand(*shape, v, generator=g) < sparsity, torch.zeros_like(x), x)
    x[..., int(torch.randint(0, v, (1,), generator=g))] += 0.05
    return x / x.sum(-1, keepdim=True)


def spec_case(b: int, v: int, k: int, with_q: bool, g: torch.Generator):
    """(target_probs [B,K+1,V], draft_probs [B,K,V] or None, draft_token_ids [B,K],
    num_draft_tokens [B], seeds [B], positions [B]) for rejection_sample.

    Every third request is greedy (one-hot target rows); request 2 has an unnormalised draft
    row q = 2p (its residual max(p - q, 0) is all zero: the "fall back to p" branch);
    num_draft_tokens mixes K (request 0), 0 (request 1) and random counts; drafts come from
    q (or p) with 30% drawn uniformly; ids past num_draft_tokens are -1 (never read)."""
    target = random_rows(g, (b, k + 1), v)
    draft = random_rows(g, (b, k), v)
    for r in range(0, b, 3):
        hot = torch.randint(0, v, (k + 1,), generator=g)
        target[r] = torch.nn.functional.one_hot(hot, v).float()
    if with_q and b > 2 and k > 0:
        draft[2] = 2 * target[2, :k]
    num_draft = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
    num_draft[0] = k
    if b > 1:
        num_draft[1] = 0
    ids = torch.full((b, k), -1, dtype=torch.int32)
    for r in range(b):
        for i in range(int(num_draft[r])):
            src = draft[r, i] if with_q else target[r, i]      # one-hot drafts often hit the target
            if torch.rand(1, generator=g) < 0.3:
                src = torch.ones(v)
            ids[r, i] = int(torch.multinomial(src, 1, generator=g))
    seeds, positions = seeds_positions(g, b)
    return target, (draft if with_q else None), ids, num_draft, seeds, positions


def greedy_case(b: int, v: int, k: int, g: torch.Generator, jitter: bool = False):
    """(logits [B,K+1,V], draft ids [B,K], num_draft_tokens [B]) for verify_greedy.

    Integer logits give plenty of ties (``jitter`` adds 0.25 to half of them: fewer, still
    many); 10% NaN; row (2, 0) entirely NaN (-> token 0). Row 0 drafts exactly the argmaxes
    of all K positions (everything accepted); odd rows get one wrong draft somewhere."""
    logits = torch.randint(-3, 3, (b, k + 1, v), generator=g).float()
    if jitter:
        logits = logits + torch.where(torch.rand(b, k + 1, v, generator=g) < 0.5, 0.0, 0.25)
    logits[torch.rand(b, k + 1, v, generator=g) < 0.1] = float("nan")
    if b > 2:
        logits[2, 0] = float("nan")
    best = reference.argmax_nan_low(logits)
    nd = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
    nd[0] = k
    ids = torch.full((b, k), -1, dtype=torch.int32)
    for r in range(b):
        n = int(nd[r])
        ids[r, :n] = best[r, :n].int()
        if n and r % 2:
            j = int(torch.randint(0, n, (1,), generator=g))
            ids[r, j] = (best[r, j] + 1) % v
    return logits, ids, nd


def logits_case(n: int, v: int, g: torch.Generator):
    """(logits [N,V], temperature [N], top_k [N] int32, top_p [N]) for probs_from_logits.

    Integer-valued logits (x 0.75) half of them jittered: exact ties at the argmax and at the
    top-k / top-p thresholds; 10% NaN, 5% -inf; row 0 all NaN (one-hot at 0), row 1 all tied,
    row 2 has a +inf (one-hot there). Parameters per row from small lists: greedy (0 and a
    tiny 1e-8), top-k 1, 2, 3, 50, V-1, V, V+5 (off), top-p cuts and 1 (off)."""
    x = torch.randint(-4, 5, (n, v), generator=g).float() * 0.75
    x = torch.where(torch.rand(n, v, generator=g) < 0.5, x + torch.randn(n, v, generator=g), x)
    x[torch.rand(n, v, generator=g) < 0.1] = float("nan")
    x[torch.rand(n, v, generator=g) < 0.05] = float("-inf")
    x[0] = float("nan")
    if n > 1:
        x[1] = 2.0
    if n > 2:
        x[2, v // 2] = float("inf")
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.0, 1.0, 0.9, 1e-8])
    ks = torch.tensor([0, 1, 3, 50, v - 1, v, v + 5, 2])
    ps = torch.tensor([1.0, 0.9, 0.5, 0.05, 1.0, 0.7, 0.999, 1.0])
    idx = torch.randint(0, 8, (n, 3), generator=g)
    return x, temps[idx[:, 0]], ks[idx[:, 1]].clamp(min=0).int(), ps[idx[:, 2]]


# --------------------------------------------------------------------------- #
# token trees (verify_tree_greedy / rejection_sample_tree)
# --------------------------------------------------------------------------- #
def tree_shapes(b: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(node_parents [B, N] int32, num_nodes [B] int32): request 0 a full chain, request 1 no
    nodes, request 2 a star (every node a child of the root: many siblings), the rest random
    trees (parent of j uniform in [-1, j-1], so wide and deep ones) with random node counts.
    Parents past num_nodes are garbage (never read)."""
    parents = torch.randint(-5, 50, (b, n), generator=g, dtype=torch.int32)
    counts = torch.randint(0, n + 1, (b,), generator=g, dtype=torch.int32)
    for r in range(b):
        for j in range(n):
            parents[r, j] = int(torch.randint(-1, j, (1,), generator=g)) if j else -1
    parents[0] = torch.arange(-1, n - 1, dtype=torch.int32)
    counts[0] = n
    if b > 1:
        counts[1] = 0
    if b > 2:
        parents[2] = -1
        counts[2] = n
    for r in range(b):
        parents[r, int(counts[r]):] = torch.randint(-9, 99, (n - int(counts[r]),), generator=g, dtype=torch.int32)
    return parents, counts


def tree_case(b: int, n: int, v: int, with_q: bool, g: torch.Generator):
    """(target_probs [B,N+1,V], draft_probs [B,N,V] or None, node_token_ids [B,N], node_parents
    [B,N], num_nodes [B], seeds [B], positions [B]) for rejection_sample_tree.

    Shapes from tree_shapes. Every third request is greedy (one-hot target rows). Half the
    tokens are drawn from the parent's target row (so paths are accepted deep), the rest from
    the node's q (or uniformly); siblings often repeat a token. Request 2 (a star) has draft
    rows q = 2 p_root: its first rejection leaves a residual with no mass (the fall-back to p)."""
    parents, counts = tree_shapes(b, n, g)
    target = random_rows(g, (b, n + 1), v)
    draft = random_rows(g, (b, n), v)
    for r in range(0, b, 3):
        hot = torch.randint(0, v, (n + 1,), generator=g)
        target[r] = torch.nn.functional.one_hot(hot, v).float()
    if with_q and b > 2:
        draft[2] = 2 * target[2, 0]
    ids = torch.randint(-3, v + 3, (b, n), generator=g, dtype=torch.int32)   # garbage past num_nodes
    for r in range(b):
        for j in range(int(counts[r])):
            src = target[r, int(parents[r, j]) + 1] if torch.rand(1, generator=g) < 0.5 else (
                draft[r, j] if with_q else torch.ones(v))
            ids[r, j] = int(torch.multinomial(src, 1, generator=g))
    seeds, positions = seeds_positions(g, b)
    return target, (draft if with_q else None), ids, parents, counts, seeds, positions


def tree_greedy_case(b: int, n: int, v: int, g: torch.Generator):
    """(logits [B,N+1,V], node_token_ids [B,N], node_parents [B,N], num_nodes [B]) for
    verify_tree_greedy: integer logits with ties and 10% NaN (row (2, 0) all NaN -> token 0);
    60% of the nodes carry their parent row's argmax (deep accepted paths, and duplicate
    siblings: the lowest index must win), the rest a random token."""
    parents, counts = tree_shapes(b, n, g)
    logits = torch.randint(-3, 3, (b, n + 1, v), generator=g).float()
    logits[torch.rand(b, n + 1, v, generator=g) < 0.1] = float("nan")
    if b > 2:
        logits[2, 0] = float("nan")
    best = reference.argmax_nan_low(logits)
    ids = torch.randint(-3, v + 3, (b, n), generator=g, dtype=torch.int32)
    for r in range(b):
        for j in range(int(counts[r])):
            hit = torch.rand(1, generator=g) < 0.6
            ids[r, j] = int(best[r, int(parents[r, j]) + 1]) if hit else int(torch.randint(0, v, (1,), generator=g))
    return logits, ids, parents, counts
