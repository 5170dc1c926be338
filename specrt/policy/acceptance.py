"""What the budget policy knows about acceptance: pooled outcomes of every request, their
shape by draft position, by the drafter's evidence class, and the share of asked tokens
drafters propose. Fed by ``observe`` after every verification."""
from __future__ import annotations

from collections import deque

import numpy as np

from specrt.policy import tuning
from specrt.policy.base import recent_acceptance
from specrt.policy.tuning import BudgetTuning


class AcceptanceEvidence:
    def __init__(self, max_draft_length: int, tune: BudgetTuning):
        self.tune = tune
        self.pooled: deque = deque(maxlen=tune.pooled_window)   # recent outcomes (1 accepted, 0 rejected)
        # decayed counts of draft position i (1-based) reached / accepted: their ratio to the overall
        # rate shapes every request's per-position acceptance
        self.depth_tried = np.zeros(max_draft_length + 1)
        self.depth_accepted = np.zeros(max_draft_length + 1)
        self._profile = None                                 # cached depth_profile(), reset by observe
        self.class_counts: dict[int, list[float]] = {}       # evidence class -> decayed [outcomes, accepted]
        self.fill = 1.0                                      # pooled share of asked draft tokens proposed

    def observe(self, request, drafted: int, accepted: int) -> None:
        t = self.tune
        if drafted:
            self.pooled.extend([1] * accepted + ([0] if accepted < drafted else []))
            cls = request.evidence_class
            if cls:
                counts = self.class_counts.setdefault(cls, [0.0, 0.0])
                outcomes = accepted + (accepted < drafted)
                decay = t.class_decay ** outcomes
                counts[0] = counts[0] * decay + outcomes
                counts[1] = counts[1] * decay + accepted
            reached = min(accepted + 1, drafted, len(self.depth_tried) - 1)
            self.depth_tried *= t.depth_decay
            self.depth_accepted *= t.depth_decay
            self.depth_tried[1:reached + 1] += 1.0
            self.depth_accepted[1:min(accepted, reached) + 1] += 1.0
            self._profile = None
        state = request.policy_state
        asked, state.asked = state.asked, 0
        if asked > 0:
            # how much of what was asked the drafter proposed (an n-gram drafter proposes nothing
            # without a match; a model drafter always all of it)
            share = min(drafted / asked, 1.0)
            fill = self.fill_of(request)
            state.fill = fill + t.fill_rate * (share - fill)
            self.fill += t.pooled_fill_rate * (share - self.fill)

    def fill_of(self, request) -> float:
        return self.fill if request.policy_state.fill is None else request.policy_state.fill

    def depth_profile(self) -> np.ndarray:
        """factor[i] (i = 1..K; factor[0] = 1): pooled acceptance at draft position i given the
        positions before it were accepted, over the pooled overall rate, each position shrunk
        towards the overall rate by ``prior_weight`` outcomes (all ones without evidence). A
        request's acceptance at position i is then its own rate times factor[i]."""
        prof = self._profile
        if prof is None:
            tried, acc = self.depth_tried, self.depth_accepted
            total = float(tried[1:].sum())
            prof = np.ones(len(tried))
            if total > 0:
                mean = float(acc[1:].sum()) / total
                if mean > 0:
                    w = self.tune.prior_weight
                    cond = (acc[1:] + mean * w) / (tried[1:] + w)
                    prof[1:] = np.clip(cond / mean, 1.0 / self.tune.depth_clip, self.tune.depth_clip)
            self._profile = prof
        return prof

    def prior(self) -> float:
        """What a request without history is expected to accept: the pooled recent rate of all
        requests (PRIOR_RATE until MIN_POOLED_OUTCOMES are known)."""
        n = len(self.pooled)
        return sum(self.pooled) / n if n >= tuning.MIN_POOLED_OUTCOMES else tuning.PRIOR_RATE

    def rate(self, request, prior: float, window: int) -> float:
        """A request's expected acceptance: its recent history shrunk towards the pooled rate, or,
        when its drafter reports an evidence class with enough pooled outcomes (the n-gram match
        length), towards that class's rate with the weight of a whole window (a request's history
        mixes classes that differ a lot; the class is this step's)."""
        cls = request.evidence_class
        counts = self.class_counts.get(cls) if cls else None
        if counts is not None and counts[0] >= tuning.MIN_POOLED_OUTCOMES:
            return recent_acceptance(request, window, counts[1] / counts[0], float(window))
        return recent_acceptance(request, window, prior, self.tune.prior_weight)


class Corrections:
    """Realized / predicted throughput of past planned steps, per kind (0 plain, 1 drafted) and
    batch-size bucket: decayed sums of realized and predicted tokens and seconds (a ratio of
    throughputs: single drafted steps are spiky). The other kind's evidence fades, so a
    pessimism formed under other conditions does not last forever."""

    def __init__(self, tune: BudgetTuning):
        self.tune = tune
        self._sums: dict[int, list[list[float]]] = {}   # bucket -> [plain, drafted] x [r_tok, r_sec, p_tok, p_sec, w]

    def bucket(self, n: int) -> int:
        return min(int(n).bit_length(), self.tune.track_buckets)      # batch 1, 2-3, 4-7, ...

    def record(self, kind: int, predicted_tokens: float, predicted_s: float, n: int,
               emitted: float, seconds: float) -> None:
        t = self.tune
        both = self._sums.setdefault(self.bucket(n), [[0.0] * 5, [0.0] * 5])
        sums = both[kind]
        for i, x in enumerate((emitted, seconds, predicted_tokens, predicted_s, 1.0)):
            sums[i] = t.track_decay * sums[i] + x
        both[1 - kind] = [x * t.track_forget for x in both[1 - kind]]

    def factor(self, kind: int, n: int = 1) -> float:
        """Realized / predicted throughput of this kind at batch sizes like n, shrunk towards 1 by
        the weight of the evidence (1 with none)."""
        both = self._sums.get(self.bucket(n))
        if both is None:
            return 1.0
        r_tok, r_sec, p_tok, p_sec, w = both[kind]
        if w <= 0 or r_sec <= 0 or p_tok <= 0:
            return 1.0
        clip = self.tune.track_clip
        ratio = min(max((r_tok / r_sec) / (p_tok / p_sec), 1.0 / clip), clip)
        return ratio ** (w / (w + self.tune.track_prior))
