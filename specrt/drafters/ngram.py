"""N-gram / prompt-lookup drafter: no model, proposes the continuation of the
latest earlier occurrence of the context's last n tokens (n from max_n down to
min_n). Deterministic, so its draft distribution is one-hot (draft_probs=None).

With a per-request ``NgramState``, ``propose`` keeps an index of the n-grams it has
seen (the latest start of each), extended by the tokens appended since the last call:
a proposal is then a few dict lookups instead of a scan of the whole context, which
the engine needs because it asks for every running request on every step.
"""
from __future__ import annotations

import time

import torch

from specrt.drafters.base import DraftAsk, DraftCost, Drafter, DrafterState, DraftLimits, DraftProposal


class _Index:
    __slots__ = ("tokens", "latest")

    def __init__(self, min_n: int, max_n: int):
        self.tokens: list[int] = []        # the indexed prefix (n-grams ending inside it)
        self.latest = {n: {} for n in range(min_n, max_n + 1)}   # n -> {n-gram: latest start}


class NgramState(DrafterState):
    """One request's n-gram index and what its last proposal matched."""

    __slots__ = ("index", "match_n")

    def __init__(self):
        self.index: _Index | None = None
        self.match_n: int | None = None    # suffix length the last proposal matched (0: none)


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not (1 <= min_n <= max_n):
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: list[int], k: int, state: NgramState | None = None) -> list[int]:
        """Up to k tokens following the latest earlier match of the last n tokens.
        ``state``: owned by the request whose growing context this is (kept between calls). The
        context must grow by appending; one that got shorter, or whose first, middle or last
        indexed token changed, rebuilds the index (spot checks, O(1): a full comparison would
        cost more than the proposal at long contexts). An unrelated context needs its own state."""
        if k <= 0:
            return []
        if state is None:
            return self._scan(context, k)
        length = len(context)
        idx = state.index
        if idx is None or not self._extends(context, idx.tokens):
            idx = state.index = _Index(self.min_n, self.max_n)
        # index every n-gram that ends before the last position (the suffix itself is not a match)
        end = length - 1
        done = len(idx.tokens)
        for e in range(done + 1, end + 1):    # n-grams ending at e (exclusive)
            for n, table in idx.latest.items():
                if e >= n:
                    table[tuple(context[e - n:e])] = e - n
        if end > done:
            idx.tokens.extend(context[done:end])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = idx.latest[n].get(tuple(context[length - n:]))
            if start is not None:
                state.match_n = n         # how long a suffix matched: the budget policy's evidence class
                return context[start + n:start + n + k]
        state.match_n = 0
        return []

    @staticmethod
    def _extends(context: list[int], tokens: list[int]) -> bool:
        n = len(tokens)
        if n == 0:
            return True
        if len(context) <= n:     # the index holds n-grams ending before len(tokens) + 1
            return False
        return context[0] == tokens[0] and context[n // 2] == tokens[n // 2] and context[n - 1] == tokens[n - 1]

    def _scan(self, context: list[int], k: int) -> list[int]:
        """The stateless reference: scan back for the latest earlier occurrence."""
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n:]
            # latest occurrence that ends before the suffix itself
            for start in range(length - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    return context[start + n:start + n + k]
        return []


class NgramDrafter(Drafter):
    """Drafts each request's n-gram proposal. A proposal costs microseconds, so ``limit`` makes
    it before planning: the policy then knows which requests have one and how long (their
    max_ks), and the drafts are its prefixes."""

    name = "ngram"
    limits_vary = True

    def __init__(self, proposer: NgramProposer, device):
        self.proposer = proposer
        self.device = device

    def _propose(self, r, k: int) -> list[int]:
        if r.drafter_state is None:
            r.drafter_state = NgramState()
        prop = self.proposer.propose(r.token_ids, k, r.drafter_state)
        r.evidence_class = r.drafter_state.match_n
        return prop

    def limit(self, batch, max_ks: list[int]) -> DraftLimits:
        t0 = time.perf_counter()
        known = {r.request_id: self._propose(r, c) for r, c in zip(batch, max_ks)}
        return DraftLimits([len(known[r.request_id]) for r in batch], known, time.perf_counter() - t0)

    def propose(self, batch, ask: DraftAsk) -> DraftProposal:
        B, ks, limits = len(batch), ask.ks, ask.limits
        K = max(ks) if ks else 0
        ids = torch.full((B, K), -1, dtype=torch.int32)
        if K == 0:
            return DraftProposal(ids.to(self.device), [0] * B, None, None)
        t0 = time.perf_counter()
        known = limits.known if limits is not None else {}
        n = []
        for b, r in enumerate(batch):
            prop = known.get(r.request_id)
            prop = self._propose(r, ks[b]) if prop is None else prop[:ks[b]]
            ids[b, :len(prop)] = torch.tensor(prop, dtype=torch.int32)
            n.append(len(prop))
        return DraftProposal(ids.to(self.device), n, None, None,
                             DraftCost(time.perf_counter() - t0, forwards=K, tokens_fed=sum(n)))
