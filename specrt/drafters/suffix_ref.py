"""The suffix index's semantics, written naively: specrt._C.SuffixIndex (csrc/suffix_index.cpp) is
the fast implementation, and tests/test_suffix_index.py checks that the two answer identically.

The index holds token sequences keyed by a caller-chosen ``seq_id`` (>= 0). ``draft`` finds the
longest suffix of the context (``min_match`` .. ``max_match`` tokens) that occurs in some sequence
with at least one token after it, then grows a tree over the continuations of its occurrences:
a node is a continuation prefix, its count the number of occurrences that continue with it, its
probability its parent's times ``count / parent's count``. Nodes are taken best first (higher
probability, then shallower, then the smaller token path) until ``max_nodes``, or until the best
left is below ``min_prob``; nodes deeper than ``max_depth`` are never made.
"""
from __future__ import annotations

import heapq
import operator
from typing import Sequence

MAX_SPAN = 4096
TOKEN_LIMIT = 2**31  # tokens are int32


def check_draft_args(max_span: int, max_match: int, min_match: int, max_nodes: int, max_depth: int,
                     min_prob: float) -> None:
    """The argument checks ``draft`` makes (the same, in the same order, in csrc/suffix_index.cpp)."""
    if min_match < 1:
        raise ValueError(f"min_match must be >= 1, got {min_match}")
    if max_match < min_match:
        raise ValueError(f"max_match must be >= min_match ({min_match}), got {max_match}")
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
    if max_match + max_depth > max_span:
        raise ValueError(f"max_match + max_depth ({max_match} + {max_depth}) must be <= max_span ({max_span})")


class ReferenceSuffixIndex:
    """Same API as specrt._C.SuffixIndex; every query scans every sequence."""

    def __init__(self, max_span: int = 64, max_tokens: int = 0):
        if not 2 <= max_span <= MAX_SPAN:
            raise ValueError(f"max_span must be in [2, {MAX_SPAN}], got {max_span}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0: unbounded), got {max_tokens}")
        self.max_span = max_span
        self.max_tokens = max_tokens
        self._seqs: dict[int, list[int]] = {}  # in first-append order: eviction takes the oldest

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        if seq_id < 0:
            raise ValueError(f"seq_id must be >= 0, got {seq_id}")
        toks = [operator.index(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < TOKEN_LIMIT]
        if bad:
            raise ValueError(f"tokens must be in [0, 2**31), got {bad[0]}")
        self._seqs.setdefault(seq_id, []).extend(toks)
        if self.max_tokens:  # evict whole sequences, oldest first, never the one just appended to
            for old in list(self._seqs):
                if self.num_tokens <= self.max_tokens:
                    break
                if old != seq_id:
                    del self._seqs[old]

    def remove(self, seq_id: int) -> bool:
        return self._seqs.pop(seq_id, None) is not None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self._seqs.values())

    def memory_bytes(self) -> int:
        return 0

    def sequence(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id])

    def draft(self, context: Sequence[int], max_match: int, min_match: int, max_nodes: int, max_depth: int,
              min_prob: float, exclude: int = -1) -> tuple[int, list[int], list[int], list[float], list[int]]:
        check_draft_args(self.max_span, max_match, min_match, max_nodes, max_depth, min_prob)
        ctx = list(context)
        seqs = [s for sid, s in self._seqs.items() if sid != exclude]
        # the longest pattern with an occurrence that has a continuation; conts: where each continues
        for m in range(min(max_match, len(ctx)), min_match - 1, -1):
            pattern = ctx[len(ctx) - m:]
            conts = [(s, p + m) for s in seqs for p in range(len(s) - m) if s[p:p + m] == pattern]
            if conts:
                break
        else:
            return 0, [], [], [], []

        heap: list = []  # (-prob, depth, path, its occurrences, parent's output index)

        def push_children(path: tuple, occ: list, prob: float, out_index: int) -> None:
            groups: dict[int, list] = {}
            for s, c in occ:
                if c + len(path) < len(s):
                    groups.setdefault(s[c + len(path)], []).append((s, c))
            for t, g in groups.items():
                child_prob = prob * (len(g) / len(occ))
                heapq.heappush(heap, (-child_prob, len(path) + 1, path + (t,), g, out_index))

        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        counts: list[int] = []
        push_children((), conts, 1.0, -1)
        while heap and len(tokens) < max_nodes:
            neg_prob, depth, path, occ, parent = heapq.heappop(heap)
            if -neg_prob < min_prob:
                break
            tokens.append(path[-1])
            parents.append(parent)
            probs.append(-neg_prob)
            counts.append(len(occ))
            if depth < max_depth:
                push_children(path, occ, -neg_prob, len(tokens) - 1)
        return m, tokens, parents, probs, counts
