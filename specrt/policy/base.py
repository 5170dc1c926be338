"""Draft-length policies: the interface and the simple ones (fixed, confidence, head).

A policy answers three questions:
- ``plan(requests, max_ks, costs, catchup)`` -> K per request before drafting (the max_k);
- ``should_stop(request, depth, draft_prob, p_accept)`` -> stop drafting a request early at
  ``depth`` (only asked when ``stops_early``: it needs per-draft-step host values);
- ``observe(request, drafted, accepted)`` after verification (acceptance history);
and, ahead of time (what the next step will decide if every draft of this one is accepted:
pre-drafting, specrt.step.overlap), ``k_ahead``, ``stop_rule_ahead`` and ``replayed_length``.

Every policy changes only which tokens are proposed, never the output distribution.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from specrt.config import SpecConfig, clamp_k
from specrt.policy import tuning


@dataclass
class RequestPolicyState:
    """What the policies keep per request (lives on the request: it dies with it)."""

    asked: int = 0                # K the budget plan asked this step (its fill evidence)
    fill: float | None = None     # the request's share of asked tokens its drafter proposed (None: pooled)
    steps_without_draft: int = 0  # budget: idle steps since it last drafted (exploration)
    seen: int | None = None       # budget: the planner's clock when the request was first planned
    p_all: float = 1.0            # head: P(every token drafted so far this step is accepted)
    threshold: float | None = None   # confidence / head: this step's stop threshold (set by plan)


def recent_acceptance(request, window: int, prior: float = tuning.PRIOR_RATE,
                      prior_weight: float = tuning.HISTORY_PRIOR_WEIGHT, pending: int = 0) -> float:
    """Acceptance rate over the request's last ``window`` drafted positions, shrunk towards a prior.
    ``pending``: that many accepted outcomes not observed yet (an overlap pre-draft's premise)."""
    hist = request.accept_history
    n = len(hist)
    if pending:
        keep = max(min(window - pending, n), 0)
        hits = (sum(itertools.islice(hist, n - keep, n)) if keep else 0) + min(pending, window)
        seen = keep + min(pending, window)
    elif window >= n:
        hits, seen = sum(hist), n
    else:
        hits, seen = sum(itertools.islice(hist, n - window, n)), window
    return (hits + prior * prior_weight) / (seen + prior_weight)


def keep_history(request, window: int) -> deque:
    """The request's acceptance history, holding at least its last ``window`` outcomes."""
    hist = request.accept_history
    if hist.maxlen is not None and hist.maxlen < window:
        hist = request.accept_history = deque(hist, maxlen=window)
    return hist


class DraftPolicy:
    name = "fixed"
    stops_early = False      # should_stop is asked after every draft token (one host sync per draft step)

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self._gain: dict = {}      # tag -> moving average of accepted drafts per step (None key: all tags)

    def plan(self, requests, max_ks: list[int], costs=None, catchup: list[int] | None = None) -> list[int]:
        """K per request (<= its max_k). ``catchup``: tokens each request's draft must consume
        before it can draft (its draft KV's lag); only the budget policy prices it."""
        return [clamp_k(self.spec.max_draft_length, m) for m in max_ks]

    def dormant(self, num_requests: int) -> bool:
        """True: this step drafts nothing and the engine need not plan it at all (see
        BudgetPolicy.dormant); the policies that always draft never are."""
        return False

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        return False

    def observe(self, request, drafted: int, accepted: int) -> None:
        if drafted:
            keep_history(request, self.spec.acceptance_window or 0).extend(
                [1] * accepted + ([0] if accepted < drafted else []))
        for key in (request.tag, None):
            g = self._gain.get(key)
            self._gain[key] = float(accepted) if g is None else g + tuning.TAG_GAIN_STEP * (accepted - g)

    def predicted_acceptance(self, request) -> float:
        """Expected accepted drafts per step as a share of max_draft_length (0..1), for admission by
        acceptance: the request's own steps so far (a preempted or running one), shrunk towards its
        tag's recent average (all tags' for a new tag; PRIOR_RATE before any step)."""
        K = max(self.spec.max_draft_length, 1)
        g = self._gain.get(request.tag, self._gain.get(None))
        prior = tuning.PRIOR_RATE if g is None else min(g / K, 1.0)
        st, w = request.stats, tuning.TAG_PRIOR_STEPS
        return (st.accepted / K + prior * w) / (st.steps + w)

    def k_ahead(self, request, k: int, drafted: int, max_k: int) -> int:
        """The K the next step drafts for a request that drafted ``drafted`` of the ``k`` asked
        this step, if all are accepted (its next max_k: ``max_k``). The policies that plan the max_k
        (fixed, confidence, head) ask for the max_k; the drafting stops early where
        ``stop_rule_ahead`` says."""
        return max_k

    def stop_rule_ahead(self, request, drafted: int):
        """The stop rule the next step will apply to a request whose ``drafted`` tokens of this
        step are all accepted (None: the policy does not stop early). The rule answers as
        ``should_stop`` will after that outcome is observed, without changing any state."""
        return None

    def replayed_length(self, request, k: int, made) -> int | None:
        """How many tokens of drafts made ahead of this step (``made``: num_tokens and the values
        its stop rule saw, confidence and p_accept; specrt.drafters.predraft.PreDraft) the request
        proposes, where it was asked for ``k``: the decision drafting afresh would take (the first
        tokens are what drafting afresh would propose), or None when that decision cannot be read
        off them (too few tokens): they are dropped and drafted afresh."""
        return k if k <= made.num_tokens else None

    def step_done(self, emitted: int, seconds: float) -> None:
        """After each step: the tokens it emitted over all requests and its wall time."""


class FixedPolicy(DraftPolicy):
    name = "fixed"


class ThresholdPolicy(DraftPolicy):
    """A stop threshold per request: ``confidence_threshold``, adapted (when adaptive_enabled) to
    the request's recent acceptance: a request whose recent acceptance is high drafts deeper
    (lower threshold), a low one stops earlier. Computed once per step, in ``plan``."""

    stops_early = True

    def threshold(self, request, pending: int = 0) -> float:
        base = self.spec.confidence_threshold
        if not self.spec.adaptive_enabled:
            return base
        rate = recent_acceptance(request, self.spec.acceptance_window, pending=pending)
        return min(tuning.CONF_MAX, max(tuning.CONF_MIN, base * (tuning.CONF_SLOPE - rate)))

    def plan(self, requests, max_ks, costs=None, catchup=None):
        for r in requests:
            st = r.policy_state
            st.p_all, st.threshold = 1.0, self.threshold(r)
        return super().plan(requests, max_ks, costs, catchup)

    def _threshold_of(self, request) -> float:
        t = request.policy_state.threshold
        return self.threshold(request) if t is None else t

    def replayed_length(self, request, k: int, made) -> int | None:
        """Replays ``should_stop`` on the values recorded at each depth (no state changes)."""
        conf = made.confidence or []
        if made.confidence is not None:
            threshold, p_all = self._threshold_of(request), [1.0]
            for j in range(min(k, len(conf))):
                pa = made.p_accept[j] if made.p_accept else None
                if self._decide(j, conf[j], pa, threshold, p_all):
                    return j
        return k if k <= made.num_tokens and (made.confidence is None or len(conf) >= k) else None

    def stop_rule_ahead(self, request, drafted: int):
        threshold = self.threshold(request, pending=drafted)
        p_all = [1.0]

        def stop(depth: int, draft_prob: float, p_accept: float | None) -> bool:
            return self._decide(depth, draft_prob, p_accept, threshold, p_all)
        return stop

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        st = request.policy_state
        box = [st.p_all]
        out = self._decide(depth, draft_prob, p_accept, self._threshold_of(request), box)
        st.p_all = box[0]
        return out

    def _decide(self, depth: int, draft_prob: float, p_accept: float | None, threshold: float,
                p_all: list[float]) -> bool:
        raise NotImplementedError


class ConfidencePolicy(ThresholdPolicy):
    """Stop when the draft's own probability of its token q(x) < the threshold."""

    name = "confidence"

    def _decide(self, depth, draft_prob, p_accept, threshold, p_all) -> bool:
        if depth < self.spec.min_draft_length:
            return False
        return draft_prob < threshold


class HeadPolicy(ThresholdPolicy):
    """A learned acceptance head estimates P(accept) of each draft token from the draft's hidden
    state; stop when P(all drafted so far accepted) < the threshold."""

    name = "head"

    def _decide(self, depth, draft_prob, p_accept, threshold, p_all) -> bool:
        p_all[0] *= p_accept if p_accept is not None else draft_prob
        if depth < self.spec.min_draft_length:
            return False
        return p_all[0] < threshold
