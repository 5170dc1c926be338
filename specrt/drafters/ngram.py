"""N-gram / prompt-lookup drafter: no model, proposes the continuation of the
latest earlier occurrence of the context's last n tokens (n from max_n down to
min_n). Deterministic, so its draft distribution is one-hot (draft_probs=None).
"""
from __future__ import annotations


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not (1 <= min_n <= max_n):
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the last n tokens."""
        if k <= 0:
            return []
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n:]
            # latest occurrence that ends before the suffix itself
            for start in range(length - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return follow
                    break
        return []
