"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): drafts from what was written before.

Two suffix indexes (specrt._C.SuffixIndex, a suffix array in segments; its semantics are
specrt.drafters.suffix_ref's):
  * per request, the prompt and the output so far (appended as the request decodes);
  * global, the outputs of earlier requests: bounded by ``global_tokens`` (oldest evicted first)
    and, with scoping on, one per tenant (a request reads only its own tenant's history). Read for
    greedy rows, and for sampled rows only under coupled acceptance: under rejection sampling a
    draft changes which tokens a seeded request samples, and its output must not depend on others.

Each step the context's longest suffix that occurred before (``max_match`` tokens at most) is
looked up in both. The continuations of its occurrences form a tree whose nodes carry their
frequency: a child's probability is its parent's times the share of the parent's occurrences
that continue with it. The most probable nodes (best first, while above ``min_prob``) make
the draft, at most ``match_factor`` x the match length deep: a long, often-seen match drafts
far, a short or branching one drafts little. Of the two trees the one that expects more accepted
tokens (the sum of its node probabilities) is proposed. A tree that does not branch is a
chain: the engine verifies it causally, so it may run past the tree's node budget.

Drafts are deterministic functions of the history (one-hot draft distributions), verified like
prompt lookup's; greedy output is token-identical to plain decoding.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Hashable

import torch

from specrt.config import clamp_k
from specrt.drafters.base import DraftAsk, DraftCost, Drafter, DrafterState, DraftLimits, DraftProposal, History
from specrt.drafters.tree import is_chain, node_depths

DEFAULT_MAX_DRAFT_LENGTH = 16     # suffix drafts run long where the history repeats (max_draft_length's default)
SOURCES = ("request", "global")
DEPTH_PRIOR = (0.8, 2.0)      # a depth's acceptance rate before evidence, and its weight in verifies
DEPTH_WINDOW = 256.0          # a depth's counts halve past this many verifies (recent evidence weighs most)


def index_class():
    """The compiled suffix index, specrt._C.SuffixIndex (semantics: specrt.drafters.suffix_ref)."""
    from specrt.ops.library import suffix_index_class

    return suffix_index_class()


@dataclass(frozen=True)
class SuffixSettings:
    """How suffix drafting matches and how far it drafts (``draft="suffix[:key=value,...]"``)."""

    max_match: int = 24           # longest context suffix looked up
    min_match: int = 1            # shortest match that drafts anything
    match_factor: float = 1.0     # a draft is at most this x the match length deep
    min_prob: float = 0.1         # nodes less likely than this (by frequency) are not drafted
    max_nodes: int = 32           # nodes per request's tree
    global_tokens: int = 1_000_000   # tokens of earlier outputs the global index keeps (0: no global index)
    scoped: bool = False          # one global index per tenant (requests without one share the "" tenant)

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_match", 1, 256), ("min_match", 1, 256), ("max_nodes", 1, 1024),
                             ("global_tokens", 0, 1 << 31)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"draft: suffix {name} must be an integer in [{lo}, {hi}], got {v!r:.40}")
        if self.min_match > self.max_match:
            raise ValueError(f"draft: suffix min_match ({self.min_match}) must not exceed max_match ({self.max_match})")
        for name, lo, hi in (("match_factor", 0.0, 64.0), ("min_prob", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise ValueError(f"draft: suffix {name} must be a number in [{lo}, {hi}], got {v!r:.40}")
        if not isinstance(self.scoped, bool):
            raise ValueError(f"draft: suffix scoped must be true or false, got {self.scoped!r:.40}")

    @classmethod
    def parse(cls, spec: str) -> "SuffixSettings":
        """``"suffix"`` or ``"suffix:max_match=16,min_prob=0.2,scoped=1"``; ValueError naming the field."""
        name, _, rest = spec.partition(":")
        if name != "suffix":
            raise ValueError(f"draft: expected 'suffix[:key=value,...]', got {spec!r:.80}")
        kw: dict = {}
        fields = cls.__dataclass_fields__
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in fields:
                raise ValueError(f"draft: unknown suffix setting {item!r:.40} (known: {', '.join(fields)})")
            try:
                kw[key] = (value in ("1", "true", "yes") if key == "scoped"
                           else float(value) if key in ("match_factor", "min_prob") else int(value))
            except ValueError:
                raise ValueError(f"draft: suffix {key} must be a number, got {value!r:.40}") from None
        return cls(**kw)


@dataclass
class SuffixTree:
    """One request's draft this step: nodes best first (a parent before its children)."""

    tokens: list[int]
    parents: list[int]            # -1: the pending token
    probs: list[float]            # path probability: frequency x the rate the target follows that deep
    source: str                   # "request" or "global"
    match_len: int

    @property
    def expected(self) -> float:
        return sum(self.probs)

    def chain(self, k: int) -> list[int]:
        """The first child at every level, k tokens at most."""
        out, at = [], -1
        while len(out) < k:
            nxt = next((j for j in range(at + 1, len(self.tokens)) if self.parents[j] == at), None)
            if nxt is None:
                break
            out.append(self.tokens[nxt])
            at = nxt
        return out

    def prune(self, budget: int, shape) -> tuple[list[int], list[int], float]:
        """At most ``budget`` nodes, the likeliest first (a child is never likelier than its parent,
        so every ancestor comes along); with row costs (a planner's ``shape``) as many as maximise
        (1 + calibration x expected) / (1 + their rows' cost). (tokens, parents, expected)."""
        order = sorted(range(len(self.tokens)), key=lambda j: (-self.probs[j], j))[:budget]
        n = len(order)
        if shape is not None and shape.row_costs:
            best, total, cost, n = 1.0, 0.0, 0.0, 0
            for i, j in enumerate(order):
                total += self.probs[j]
                cost += shape.row_cost(i)
                value = (1.0 + shape.calibration * total) / (1.0 + cost)
                if value > best:
                    best, n = value, i + 1
        keep = sorted(order[:n])
        index = {j: i for i, j in enumerate(keep)}
        return ([self.tokens[j] for j in keep], [index[self.parents[j]] if self.parents[j] >= 0 else -1 for j in keep],
                sum(self.probs[j] for j in keep))


@dataclass
class DepthRates:
    """Per depth d, how often the target accepted a suffix draft's depth-d node once it had accepted
    its parent, learned from every verify of this source. A continuation's frequency says which
    branch to draft; these rates say how far the target keeps following a copy."""

    tried: list[float] = field(default_factory=list)      # [d-1] verifies that reached depth d
    accepted: list[float] = field(default_factory=list)   # [d-1] ... and accepted it

    def factors(self, depth: int) -> list[float]:
        """[d] the chance of reaching and accepting depth d + 1 (a product of the rates), d < depth."""
        out, f = [], 1.0
        prior, weight = DEPTH_PRIOR
        for d in range(depth):
            t, a = (self.tried[d], self.accepted[d]) if d < len(self.tried) else (0.0, 0.0)
            f *= (a + prior * weight) / (t + weight)
            out.append(f)
        return out

    def observe(self, depth: int, accepted: int) -> None:
        """A verify of a draft ``depth`` deep whose first ``accepted`` levels were accepted."""
        for d in range(min(depth, accepted + 1)):
            if d == len(self.tried):
                self.tried.append(0.0), self.accepted.append(0.0)
            self.tried[d] += 1.0
            self.accepted[d] += 1.0 if d < accepted else 0.0
            if self.tried[d] > DEPTH_WINDOW:
                self.tried[d] /= 2.0
                self.accepted[d] /= 2.0


@dataclass
class SuffixState(DrafterState):
    """A request's own index and what this drafter knows about it."""

    index: object                 # SuffixIndex over this request's tokens (sequence 0)
    indexed: int = 0              # tokens of request.token_ids in the index
    tree: SuffixTree | None = None   # this step's draft (from ``limit``)
    source: str | None = None     # the source of the draft last verified
    depth: int = 0                # its depth


@dataclass
class SourceStats:
    lookups: int = 0              # requests looked up
    matches: int = 0              # ... whose draft came from this source
    drafted: int = 0              # nodes verified
    accepted: int = 0             # of them accepted


@dataclass
class SuffixIndexes:
    """The global indexes (one per tenant when scoped) and the per-source counts."""

    settings: SuffixSettings
    by_tenant: dict[str, object] = field(default_factory=dict)
    stats: dict[str, SourceStats] = field(default_factory=lambda: {s: SourceStats() for s in SOURCES})
    rates: dict[str, DepthRates] = field(default_factory=lambda: {s: DepthRates() for s in SOURCES})
    held_tokens: int = 0          # the indexes' size after the last output was added: read by other
    held_bytes: int = 0           # threads (stats, /metrics), which must not call into an index
    _next_seq: int = 0

    def index_for(self, tenant: str | None, create: bool):
        if self.settings.global_tokens == 0:
            return None
        key = (tenant or "") if self.settings.scoped else ""
        idx = self.by_tenant.get(key)
        if idx is None and create:
            idx = self.by_tenant[key] = index_class()(span(self.settings), self.settings.global_tokens)
        return idx

    def add_output(self, tenant: str | None, tokens: list[int]) -> None:
        if len(tokens) >= 2:
            self._next_seq += 1
            self.index_for(tenant, True).append(self._next_seq, tokens)
            self.held_tokens = sum(idx.num_tokens for idx in self.by_tenant.values())
            self.held_bytes = sum(idx.memory_bytes() for idx in self.by_tenant.values())


PRIOR_RATES = DepthRates()     # never observes: the depth rates before evidence


def span(s: SuffixSettings) -> int:
    """The longest pattern + continuation an index compares."""
    return s.max_match + max_depth(s, s.max_match, 1024)


def max_depth(s: SuffixSettings, match_len: int, max_k: int) -> int:
    return max(1, clamp_k(max_k, int(math.ceil(s.match_factor * match_len)), 256))


class SuffixLookup:
    """Suffix drafts for a batch: the engine's SuffixDrafter, or the lookup in front of a model
    drafter (``draft="MODEL+suffix"``: the model drafts where nothing matched)."""

    def __init__(self, settings: SuffixSettings, coupled: bool = False):
        self.settings = settings
        self.indexes = SuffixIndexes(settings)
        self.coupled = coupled     # acceptance="coupled": sampled output does not depend on the drafts

    def tree(self, r, max_k: int, state_attr: str = "drafter_state") -> SuffixTree | None:
        """Request r's best suffix tree of at most ``max_k`` levels (None: no match)."""
        s = self.settings
        st = getattr(r, state_attr)
        if not isinstance(st, SuffixState):
            st = SuffixState(index_class()(span(s), 0))
            setattr(r, state_attr, st)
        prompt, out = r.prompt_token_ids, r.output_token_ids    # (not r.token_ids: a copy per step)
        total = len(prompt) + len(out)
        if st.indexed > total:             # restored to an earlier step: index afresh
            st.index, st.indexed = index_class()(span(s), 0), 0
        if st.indexed < len(prompt):
            st.index.append(0, prompt[st.indexed:])
            st.indexed = len(prompt)
        if st.indexed < total:
            st.index.append(0, out[st.indexed - len(prompt):])
            st.indexed = total
        st.tree = None
        if max_k <= 0:
            return None
        tail = out[-s.max_match:] if len(out) >= s.max_match else (prompt + out)[-s.max_match:]
        best = None
        # what other requests left (their outputs, the depth rates learned from them) shapes drafts
        # only where it cannot change what this request samples: greedy rows, or coupled acceptance
        # (under rejection sampling a seeded request would otherwise depend on its neighbours)
        shared = self.coupled or r.params.greedy
        glob = self.indexes.index_for(getattr(r, "tenant", None), False) if shared else None
        for source, idx in (("request", st.index), ("global", glob)):
            if idx is None:
                continue
            self.indexes.stats[source].lookups += 1
            m, toks, parents, probs, _ = idx.draft(tail, s.max_match, s.min_match, s.max_nodes,
                                                   max_depth(s, min(s.max_match, len(tail)), max_k), s.min_prob)
            if not toks:
                continue
            tree = _shape(SuffixTree(toks, parents, probs, source, m), max_depth(s, m, max_k),
                          self.indexes.rates[source] if shared else PRIOR_RATES, s.min_prob)
            if tree.tokens and (best is None or tree.expected > best.expected):
                best = tree
        if best is not None:
            self.indexes.stats[best.source].matches += 1
        st.tree = best
        return best

    def record(self, r, drafted: int, accepted: int, state_attr: str = "drafter_state") -> None:
        """After a verify: the request's suffix nodes and how many were accepted."""
        st = getattr(r, state_attr)
        if isinstance(st, SuffixState) and st.source is not None and drafted:
            stats = self.indexes.stats[st.source]
            stats.drafted += drafted
            stats.accepted += accepted
            self.indexes.rates[st.source].observe(st.depth, accepted)
            st.source = None

    def finished(self, r) -> None:
        """A request ended: its output joins the global index (its tenant's)."""
        if self.settings.global_tokens and r.finish_reason in ("stop", "length"):
            self.indexes.add_output(getattr(r, "tenant", None), list(r.output_token_ids))

    def forget_outputs(self) -> None:
        """Empty the global indexes (earlier requests' outputs); counts and depth rates stay."""
        self.indexes.by_tenant.clear()
        self.indexes.held_tokens = self.indexes.held_bytes = 0

    def source_stats(self) -> dict:
        out = {k: vars(v).copy() for k, v in self.indexes.stats.items()}
        out["global"]["index_tokens"] = self.indexes.held_tokens
        out["global"]["index_bytes"] = self.indexes.held_bytes
        return out


def _shape(tree: SuffixTree, depth_cap: int, rates: DepthRates, min_prob: float) -> SuffixTree:
    """The tree as drafted: each node's frequency probability times the chance the target follows
    that deep (``rates``); nodes deeper than ``depth_cap`` or below ``min_prob`` go, with their
    descendants (a child is never likelier than its parent); order is kept."""
    factors = rates.factors(depth_cap)
    depth: list[int] = []
    keep, index, probs = [], {}, []
    for j, p in enumerate(tree.parents):
        d = 1 if p < 0 else depth[p] + 1
        depth.append(d)
        if d > depth_cap or (p >= 0 and p not in index):
            continue
        prob = tree.probs[j] * factors[d - 1]
        if prob < min_prob:
            continue
        index[j] = len(keep)
        keep.append(j)
        probs.append(prob)
    return SuffixTree([tree.tokens[j] for j in keep],
                      [index[tree.parents[j]] if tree.parents[j] >= 0 else -1 for j in keep],
                      probs, tree.source, tree.match_len)


class SuffixDrafter(Drafter, History):
    """``draft="suffix"``: no model. ``limit`` looks every request up before planning (its max_ks:
    the tree's nodes; the engine lets a chain run past the tree budget); ``propose`` drafts each
    tree's most probable chain, or asked for trees the tree pruned to the step's budget and costs."""

    name = "suffix"
    limits_vary = True
    grows_trees = True
    default_max_draft_length = DEFAULT_MAX_DRAFT_LENGTH

    def __init__(self, settings: SuffixSettings, device, coupled: bool = False):
        self.lookup = SuffixLookup(settings, coupled)
        self.device = device

    def limit(self, batch, max_ks: list[int]) -> DraftLimits:
        t0 = time.perf_counter()
        known: dict[Hashable, list[int]] = {}
        found_ks, chains = [], {}
        for r, c in zip(batch, max_ks):
            tree = self.lookup.tree(r, c)
            prop = [] if tree is None else tree.chain(c)
            found_ks.append(len(prop))
            if prop:
                known[r.request_id] = prop
                if is_chain(tree.parents):        # verified causally: not bound by the tree budget
                    chains[r.request_id] = len(prop)
        return DraftLimits(found_ks, known, time.perf_counter() - t0, chains=chains)

    def propose(self, batch, ask: DraftAsk) -> DraftProposal:
        if ask.tree is not None:
            return self._propose_tree(batch, ask.nodes, ask.tree)
        ks = ask.ks
        B, K = len(batch), max(ks, default=0)
        ids = torch.full((B, K), -1, dtype=torch.int32)
        t0 = time.perf_counter()
        n = []
        for b, r in enumerate(batch):
            st = r.drafter_state
            tree = st.tree if isinstance(st, SuffixState) else None
            prop = tree.chain(ks[b]) if tree is not None and ks[b] > 0 else []
            if prop:
                ids[b, :len(prop)] = torch.tensor(prop, dtype=torch.int32)
                st.source, st.depth = tree.source, len(prop)
            n.append(len(prop))
        return DraftProposal(ids.to(self.device), n, None, None,
                             DraftCost(time.perf_counter() - t0, forwards=0, tokens_fed=0))

    def _propose_tree(self, batch, budgets: list[int], shape) -> DraftProposal:
        B = len(batch)
        t0 = time.perf_counter()
        picked, parents, expected = [], [], []
        for b, r in enumerate(batch):
            st = r.drafter_state
            tree = st.tree if isinstance(st, SuffixState) else None
            if tree is None or budgets[b] <= 0:
                picked.append([]), parents.append([]), expected.append(0.0)
                continue
            toks, par, exp = tree.prune(budgets[b], shape)
            picked.append(toks), parents.append(par), expected.append(exp)
            st.source, st.depth = tree.source, max(node_depths(par), default=0)
        N = max((len(t) for t in picked), default=0)
        ids = torch.full((B, N), -1, dtype=torch.int32)
        for b, toks in enumerate(picked):
            if toks:
                ids[b, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        return DraftProposal(ids.to(self.device), [len(t) for t in picked], None, None,
                             DraftCost(time.perf_counter() - t0), node_parents=parents, expected_accepted=expected)

    def on_commit(self, request, row: int, proposal: DraftProposal):
        self.lookup.record(request, proposal.num_draft_tokens[row], request.target_cached - request.context_len)
        return None

    def on_finish(self, request) -> None:
        self.lookup.finished(request)

    def forget_outputs(self) -> None:
        self.lookup.forget_outputs()

    def source_stats(self) -> dict:
        return self.lookup.source_stats()
