"""Draft-length policies: the interface and the simple ones (fixed, confidence, head).

A policy answers three questions:
- ``plan(requests, k_caps, costs, catchup)`` -> K per request before drafting (the cap);
- ``should_stop(request, depth, draft_prob, p_accept)`` -> stop drafting a request early at
  ``depth`` (only asked when ``stops_early``: it needs per-draft-step host values);
- ``observe(request, drafted, accepted)`` after verification (acceptance history).

Every policy changes only which tokens are proposed, never the output distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

from specrt.config import SpecConfig
from specrt.policy import tuning


@dataclass
class RequestPolicyState:
    """What the policies keep per request (lives on the request: it dies with it)."""

    asked: int = 0                # K the budget plan asked this step (its fill evidence)
    fill: float | None = None     # the request's share of asked tokens its drafter proposed (None: pooled)
    steps_without_draft: int = 0  # budget: idle steps since it last drafted (exploration)
    seen: int | None = None       # budget: the planner's clock when the request was first planned
    p_all: float = 1.0            # head: P(every token drafted so far this step is accepted)


def recent_acceptance(request, window: int, prior: float = tuning.PRIOR_RATE,
                      prior_weight: float = tuning.HISTORY_PRIOR_WEIGHT) -> float:
    """Acceptance rate over the request's last ``window`` drafted positions, shrunk towards a prior."""
    hist = list(request.accept_history)[-window:]
    return (sum(hist) + prior * prior_weight) / (len(hist) + prior_weight)


class DraftPolicy:
    name = "fixed"
    stops_early = False      # should_stop is asked after every draft token (one host sync per draft step)
    k_known_ahead = False    # the next step's K is known before this step's outcome (overlap may pre-draft)

    def __init__(self, spec: SpecConfig):
        self.spec = spec

    def plan(self, requests, k_caps: list[int], costs=None, catchup: list[int] | None = None) -> list[int]:
        """K per request (<= its cap). ``catchup``: tokens each request's draft must consume
        before it can draft (its draft KV's lag); only the budget policy prices it."""
        return [max(min(self.spec.max_draft_length, cap), 0) for cap in k_caps]

    def dormant(self, num_requests: int) -> bool:
        """True: this step drafts nothing and the engine need not plan it at all (see
        BudgetPolicy.dormant); the policies that always draft never are."""
        return False

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        return False

    def observe(self, request, drafted: int, accepted: int) -> None:
        request.accept_history.extend([1] * accepted + ([0] if accepted < drafted else []))

    def step_done(self, emitted: int, seconds: float) -> None:
        """After each step: the tokens it emitted over all requests and its wall time."""


class FixedPolicy(DraftPolicy):
    name = "fixed"
    k_known_ahead = True


class ConfidencePolicy(DraftPolicy):
    """Stop when q(x) < threshold; the threshold adapts per request: a request whose recent
    acceptance is high drafts deeper (lower threshold), a low one stops earlier."""

    name = "confidence"
    stops_early = True

    def threshold(self, request) -> float:
        base = self.spec.confidence_threshold
        if not self.spec.adaptive_enabled:
            return base
        rate = recent_acceptance(request, self.spec.acceptance_window)
        return min(tuning.CONF_MAX, max(tuning.CONF_MIN, base * (tuning.CONF_SLOPE - rate)))

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        if depth < self.spec.min_draft_length:
            return False
        return draft_prob < self.threshold(request)


class HeadPolicy(DraftPolicy):
    """A learned acceptance head estimates P(accept) of each draft token from the draft's hidden
    state; stop when P(all drafted so far accepted) < threshold."""

    name = "head"
    stops_early = True

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        state = request.policy_state
        state.p_all *= p_accept if p_accept is not None else draft_prob
        if depth < self.spec.min_draft_length:
            return False
        return state.p_all < self.spec.confidence_threshold

    def plan(self, requests, k_caps, costs=None, catchup=None):
        for r in requests:
            r.policy_state.p_all = 1.0
        return super().plan(requests, k_caps, costs, catchup)
