"""Token trees: the shape of a tree proposal, its attention masks, and the EAGLE-2-style dynamic
expansion a model drafter runs (Li et al. 2024, "EAGLE-2: dynamic draft trees").

A proposal is a tree per request: node j has a token and a parent (-1: the request's pending
token); parents precede their children and siblings are ordered by the draft's preference (the
verification tries them in that order). A chain is the tree whose node j has parent j - 1, so
chains and trees take one code path. Node j's depth is its path length from the pending token;
it sits at position ``context_len - 1 + depth`` and its K/V in slot ``context_len + j``: the
accepted path moves to consecutive slots at the commit.

Dynamic expansion, per request with a node budget N and a depth limit D:
  * the catch-up forward gives the draft's distribution after the pending token: its top
    ``branching`` tokens become depth-1 candidates, scored by their log-probability;
  * each further level forwards the ``beam`` best candidates of the newest depth in ONE draft
    forward (tree attention: each sees the context and its own ancestors) and adds their top
    ``branching`` children, scored by the sum of log-probabilities along the path;
  * after D levels the N best candidates form the tree. A child never scores above its parent,
    so the N best include every ancestor of every chosen node.
Greedy requests are verified by argmax, sampled ones by recursive rejection over the siblings
(one-hot draft probabilities: the tree is a deterministic function of the context) or coupled.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from specrt.drafters.base import DraftCost, DraftProposal

MAX_TREE_NODES = 63       # the attention kernel's ancestor mask covers 64 keys: the node and 63 before it
MASK_BITS = 64


@dataclass(frozen=True)
class TreeShape:
    """How a drafter grows a tree (the node budget per request comes with each step)."""

    max_depth: int            # longest path (draft forwards per step)
    branching: int = 4        # children considered per expanded node (its draft's top tokens)
    beam: int = 4             # nodes expanded per depth (the best by path score)
    row_costs: tuple[float, ...] = ()   # [n] the n+1-th node's verify row over the step's time per
                                         # request (empty: rows are free, fill the budget)
    level_cost: float = 0.0   # one more draft level's time over the step's (0: grow to max_depth)
    calibration: float = 1.0  # accepted nodes per predicted node (specrt.policy.tree)

    def row_cost(self, n: int) -> float:
        """The price of a request's (n+1)-th node."""
        return self.row_costs[min(n, len(self.row_costs) - 1)] if self.row_costs else 0.0

    def worth_growing(self, best_score: float, nodes: int) -> bool:
        """Whether a request with ``nodes`` candidates whose best newest one has path log-probability
        ``best_score`` grows another level: its expected acceptance must repay the level and a row."""
        return self.calibration * math.exp(best_score) > self.level_cost + self.row_cost(nodes)

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_depth", 1, MAX_TREE_NODES), ("branching", 1, 16), ("beam", 1, MAX_TREE_NODES)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"tree {name} must be an integer in [{lo}, {hi}], got {v!r:.40}")


def chain_parents(n: int) -> list[int]:
    """The parents of an n-token chain."""
    return list(range(-1, n - 1))


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node (1 for the pending token's children)."""
    depth: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"node_parents[{j}] = {p}: a parent must precede its node (or be -1)")
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def ancestor_mask(parents: list[int]) -> list[int]:
    """Per node, the paged-attention kernel's ``tree_mask`` (signed int64): bit i set when the key
    i slots before the node is visible (the node itself, its ancestors, and everything before the
    tree). A chain's nodes get -1 (plain causal)."""
    if len(parents) > MAX_TREE_NODES:
        raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes, got {len(parents)}")
    node_depths(parents)                    # checks the parents
    out = []
    for j in range(len(parents)):
        ancestors, a = [], parents[j]
        while a >= 0:
            ancestors.append(a)
            a = parents[a]
        out.append(slot_bits(j, ancestors))
    return out


def slot_bits(slot: int, ancestor_slots: list[int]) -> int:
    """The ``tree_mask`` of a node in tree slot ``slot`` (slots counted from the tree's first)
    whose ancestors sit in ``ancestor_slots``, as a signed int64."""
    full = (1 << MASK_BITS) - 1
    bits = ((full << (slot + 1)) & full) | 1
    for a in ancestor_slots:
        bits |= 1 << (slot - a)
    return bits - (1 << MASK_BITS) if bits >> (MASK_BITS - 1) else bits


def is_chain(parents: list[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


@dataclass
class _Candidates:
    """One request's candidate nodes, in creation order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)   # candidate index, -1: the pending token
    scores: list[float] = field(default_factory=list)  # sum of the draft's log-probabilities on the path
    depths: list[int] = field(default_factory=list)
    slot: list[int] = field(default_factory=list)      # draft KV slot offset once forwarded, else -1

    def add(self, parent: int, depth: int, base: float, tokens: list[int], logps: list[float]) -> None:
        for t, lp in zip(tokens, logps):
            if lp == float("-inf"):
                continue                                # the draft cannot propose it (reduced head)
            self.tokens.append(t)
            self.parents.append(parent)
            self.scores.append(base + lp)
            self.depths.append(depth)
            self.slot.append(-1)

    def best_at(self, depth: int) -> float:
        """The best path score among the candidates of ``depth`` (-inf: none)."""
        return max((sc for sc, d in zip(self.scores, self.depths) if d == depth), default=float("-inf"))

    def frontier(self, depth: int, beam: int, room: int) -> list[int]:
        """The best ``min(beam, room)`` candidates of ``depth`` (ties: the earlier)."""
        at = [i for i, d in enumerate(self.depths) if d == depth]
        at.sort(key=lambda i: (-self.scores[i], i))
        return sorted(at[:max(0, min(beam, room))])

    def select(self, budget: int, shape: "TreeShape | None" = None) -> tuple[list[int], list[int], float]:
        """The tree of the best candidates: (tokens, parents) in creation order and the nodes it
        expects accepted (the sum of their path probabilities). At most ``budget`` of them, as many
        as maximise (1 + calibration * expected) / (1 + the cost of their rows) (specrt.policy.tree);
        all ``budget`` when rows are free (no shape, or no row costs)."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:budget]
        free = shape is None or not shape.row_costs
        n, best, total, chosen, cost = 0, 1.0, 0.0, 0.0, 0.0
        for i, c in enumerate(order):
            total += math.exp(self.scores[c])
            if free:
                n, chosen = i + 1, total
                continue
            cost += shape.row_cost(i)
            value = (1.0 + shape.calibration * total) / (1.0 + cost)
            if value > best:
                n, best, chosen = i + 1, value, total
        keep = sorted(order[:n])
        index = {c: j for j, c in enumerate(keep)}
        return ([self.tokens[c] for c in keep],
                [index[self.parents[c]] if self.parents[c] >= 0 else -1 for c in keep], chosen)

    def slot_mask(self, c: int) -> int:
        """``tree_mask`` of candidate c in the draft's forward: its ancestors by draft slot."""
        ancestors, a = [], self.parents[c]
        while a >= 0:
            ancestors.append(self.slot[a])
            a = self.parents[a]
        return slot_bits(self.slot[c], ancestors)


def draft_tree(drafter, batch, budgets: list[int], depths: list[int], shape: TreeShape) -> DraftProposal:
    """A dynamic tree per request (module docstring) from a ModelDrafterBase's network: ``budgets[b]``
    nodes at most (0: nothing drafted; the request's draft KV then keeps what it held), paths of
    at most ``depths[b]`` (<= shape.max_depth) nodes. The
    draft's K/V of forwarded nodes lie past the context and are dropped (draft_cached is the
    context): the next step's catch-up feeds the accepted tokens."""
    B, dev = len(batch), drafter.settings.device
    t0 = time.perf_counter()
    cached = [min(drafter.cached(r), r.context_len - 1) for r in batch]
    found = {}
    if drafter.lookup is not None:      # an n-gram match drafts its continuation as a chain, no forward
        found = drafter.lookup.propose(batch, budgets, [False] * B)
    rows = [b for b in range(B) if budgets[b] > 0 and b not in found]
    cost = DraftCost()
    cands = {b: _Candidates() for b in rows}
    for b, toks in found.items():
        cands[b] = _Candidates()
        cands[b].add(-1, 1, 0.0, toks[:1], [0.0])
        for j, t in enumerate(toks[1:]):
            cands[b].add(j, j + 2, 0.0, [t], [0.0])
    if rows:
        reqs = [batch[b] for b in rows]
        chunks = [batch[b].token_ids[cached[b]:] for b in rows]
        host_ids = [t for c in chunks for t in c]
        input_ids = torch.tensor(host_ids, dtype=torch.int64).to(dev, non_blocking=True)
        seq_lens, query_lens = [r.context_len for r in reqs], [len(c) for c in chunks]
        features = drafter._step_features(reqs, [cached[b] for b in rows], None, None)
        out_index = [r.num_generated for r in reqs]
        raw = drafter.raw_logits_ok(reqs, out_index, None)   # top-k over the draft's own vocabulary
        _, logits, hidden = drafter._forward(reqs, input_ids, seq_lens, query_lens, out_index,
                                             host_ids, None, features=features, raw=raw)
        _count(cost, drafter, query_lens)
        tokens, logps = _top(logits, shape.branching, drafter.draft_token_ids if raw else None)
        for i, b in enumerate(rows):
            cands[b].add(-1, 1, 0.0, tokens[i], logps[i])
        prev_rows = {(b, -1): i for i, b in enumerate(rows)}   # (request, candidate) -> row of the last forward
        used = {b: 0 for b in rows}                             # draft slots taken past the context
        for depth in range(1, shape.max_depth):
            level = [(b, c) for b in rows if depth < depths[b]
                     and shape.worth_growing(cands[b].best_at(depth), len(cands[b].tokens))
                     for c in cands[b].frontier(depth, shape.beam, budgets[b] - used[b])]
            if not level:
                break
            for b, c in level:
                cands[b].slot[c] = used[b]
                used[b] += 1
            reqs_l, per = [], []
            for b, group in itertools.groupby(level, key=lambda x: x[0]):
                reqs_l.append(batch[b])
                per.append([c for _, c in group])
            bs = [b for b, _ in itertools.groupby(level, key=lambda x: x[0])]
            ids = torch.tensor([cands[b].tokens[c] for b, c in level], dtype=torch.int64).to(dev, non_blocking=True)
            sel = torch.tensor([prev_rows[(b, cands[b].parents[c])] for b, c in level],
                               dtype=torch.int64).to(dev, non_blocking=True)
            feats = drafter._step_features(reqs_l, None, hidden, sel)
            L = [r.context_len for r in reqs_l]
            seq = [L[i] + used[b] for i, b in enumerate(bs)]
            positions = [batch[b].context_len - 1 + depth + 1 for b, _ in level]
            masks = [cands[b].slot_mask(c) for b, c in level]
            out_index = [batch[b].num_generated + depth for b, _ in level]
            raw = drafter.raw_logits_ok([batch[b] for b, _ in level], out_index, None)
            _, logits, hidden = drafter._forward(reqs_l, ids, seq, [len(p) for p in per], out_index, None, None,
                                                 features=feats, positions=positions, tree_mask=masks, every_row=True,
                                                 raw=raw)
            _count(cost, drafter, [len(p) for p in per])
            tokens, logps = _top(logits, shape.branching, drafter.draft_token_ids if raw else None)
            prev_rows = {}
            for i, (b, c) in enumerate(level):
                cands[b].add(c, depth + 1, cands[b].scores[c], tokens[i], logps[i])
                prev_rows[(b, c)] = i
    N = max([min(budgets[b], len(c.tokens)) for b, c in cands.items()], default=0)
    draft_ids = torch.full((B, N), -1, dtype=torch.int32)
    n_nodes, parents, expected = [0] * B, [[] for _ in range(B)], [0.0] * B
    for b in cands:
        toks, par, expected[b] = cands[b].select(budgets[b], None if b in found else shape)
        draft_ids[b, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        n_nodes[b], parents[b] = len(toks), par
    draft_cached = [batch[b].context_len if b in rows else cached[b] for b in range(B)]
    cost.seconds = time.perf_counter() - t0
    return DraftProposal(draft_ids.to(dev, non_blocking=True), n_nodes, None, draft_cached, cost,
                         lookup_rows=frozenset(found), node_parents=parents,
                         expected_accepted=[e if b in rows else 0.0 for b, e in enumerate(expected)])


def _top(logits: torch.Tensor, k: int, to_target=None) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's k most likely tokens and their log-probabilities (T = 1), on the host (the level's
    one device->host sync: the next level's shape depends on them). ``to_target``: the logits are
    over the draft's vocabulary, and it maps their columns to target ids."""
    logp = torch.log_softmax(logits.float(), -1)
    v, i = logp.topk(min(k, logp.shape[1]), -1)
    if to_target is not None:
        i = to_target(i)
    return i.tolist(), v.tolist()


def _count(cost: DraftCost, drafter, query_lens: list[int]) -> None:
    cost.forwards += 1
    cost.tokens_fed += sum(query_lens)
    cost.attended += drafter.attended
