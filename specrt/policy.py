"""Draft length: how many tokens each request drafts this step.

A policy answers three questions:
- ``plan(requests, k_caps, batch_context)`` -> K per request before drafting (the cap);
- ``should_stop(request, i, draft_prob, p_accept)`` -> stop drafting request early at depth i
  (confidence / head policies; they need per-draft-step host values);
- ``observe(request, drafted, accepted)`` after verification (acceptance history).

Every policy changes only which tokens are proposed, never the output distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

from specrt.config import SpecConfig


def recent_acceptance(request, window: int, prior: float = 0.7, prior_weight: float = 2.0) -> float:
    """Acceptance rate over the request's last ``window`` drafted positions, shrunk towards a prior."""
    hist = list(request.accept_history)[-window:]
    return (sum(hist) + prior * prior_weight) / (len(hist) + prior_weight)


class DraftPolicy:
    name = "fixed"
    needs_draft_probs_on_host = False
    needs_hidden = False

    def __init__(self, spec: SpecConfig):
        self.spec = spec

    def plan(self, requests, k_caps: list[int], costs: "CostModel | None" = None) -> list[int]:
        return [max(min(self.spec.max_draft_length, cap), 0) for cap in k_caps]

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        return False

    def observe(self, request, drafted: int, accepted: int) -> None:
        request.accept_history.extend([1] * accepted + ([0] if accepted < drafted else []))


class FixedPolicy(DraftPolicy):
    name = "fixed"


class ConfidencePolicy(DraftPolicy):
    """Stop when q(x) < threshold; the threshold adapts per request: a request whose recent
    acceptance is high drafts deeper (lower threshold), a low one stops earlier."""

    name = "confidence"
    needs_draft_probs_on_host = True

    def threshold(self, request) -> float:
        base = self.spec.confidence_threshold
        if not self.spec.adaptive_enabled:
            return base
        rate = recent_acceptance(request, self.spec.acceptance_window)
        return min(0.95, max(0.02, base * (1.5 - rate)))

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        if depth < self.spec.min_draft_length:
            return False
        return draft_prob < self.threshold(request)


class HeadPolicy(DraftPolicy):
    """A learned acceptance head estimates P(accept) of each draft token from the draft's hidden
    state; stop when P(all drafted so far accepted) < threshold."""

    name = "head"
    needs_draft_probs_on_host = True
    needs_hidden = True

    def should_stop(self, request, depth: int, draft_prob: float, p_accept: float | None) -> bool:
        cum = request.policy_state.get("p_all", 1.0) * (p_accept if p_accept is not None else draft_prob)
        request.policy_state["p_all"] = cum
        if depth < self.spec.min_draft_length:
            return False
        return cum < self.spec.confidence_threshold

    def plan(self, requests, k_caps, costs=None):
        for r in requests:
            r.policy_state["p_all"] = 1.0
        return super().plan(requests, k_caps, costs)


@dataclass
class CostModel:
    """Measured step costs. Verify time of a target forward ~ a + b * tokens + c * context tokens
    (least squares over recent steps); a draft step (one batched draft forward) likewise."""

    def __post_init__(self):
        self.verify_samples: list[tuple[float, float, float]] = []   # (tokens, context, seconds)
        self.draft_samples: list[tuple[float, float, float]] = []

    @staticmethod
    def _fit(samples):
        import numpy as np

        if len(samples) < 4:
            return None
        arr = np.array(samples[-256:], dtype=float)
        x = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
        coef, *_ = np.linalg.lstsq(x, arr[:, 2], rcond=None)
        return np.maximum(coef, 0.0)

    def add_verify(self, tokens: int, context: int, seconds: float) -> None:
        self.verify_samples.append((tokens, context, seconds))
        del self.verify_samples[:-512]

    def add_draft(self, tokens: int, context: int, seconds: float) -> None:
        self.draft_samples.append((tokens, context, seconds))
        del self.draft_samples[:-512]

    def verify_time(self, tokens: int, context: int) -> float:
        c = self._fit(self.verify_samples)
        if c is None:
            return 1.0 + 0.01 * tokens
        return float(c[0] + c[1] * tokens + c[2] * context) or 1e-6

    def draft_step_time(self, batch: int, context: int) -> float:
        c = self._fit(self.draft_samples)
        if c is None:
            return 0.25
        return float(c[0] + c[1] * batch + c[2] * context) or 1e-6


class BudgetPolicy(DraftPolicy):
    """Across the batch, hand out draft tokens where the expected gain per unit of measured
    cost is highest: greedily add the draft token with the best marginal effect on expected
    emitted tokens / predicted step time; stop when no addition raises that throughput.
    A request whose expected gain does not pay for its cost gets K=0 (speculation off)."""

    name = "budget"
    explore_every = 16

    def plan(self, requests, k_caps, costs=None):
        costs = costs or CostModel()
        n = len(requests)
        if n == 0:
            return []
        rates = [recent_acceptance(r, self.spec.acceptance_window) for r in requests]
        contexts = [r.context_len for r in requests]
        ctx_total = sum(contexts)
        ks = [min(self.spec.min_draft_length, cap) for cap in k_caps]

        def throughput(kk):
            expected = sum(1.0 + sum(rates[b] ** i for i in range(1, kk[b] + 1)) for b in range(n))
            t = costs.verify_time(sum(k + 1 for k in kk), ctx_total)
            steps = max(kk) if kk else 0
            t += steps * costs.draft_step_time(sum(1 for k in kk if k > 0), ctx_total)
            return expected / t

        best = throughput(ks)
        while True:
            choice, choice_val = None, best
            # moves raise one request to any deeper K: the first draft token of a step costs
            # a whole draft forward, so single-token increments alone could stall
            for b in range(n):
                old = ks[b]
                for k in range(old + 1, min(k_caps[b], self.spec.max_draft_length) + 1):
                    ks[b] = k
                    val = throughput(ks)
                    if val > choice_val * (1 + 1e-9):
                        choice, choice_val = (b, k), val
                ks[b] = old
            if choice is None:
                break
            ks[choice[0]] = choice[1]
            best = choice_val
        # exploration: a request kept at K=0 stops producing acceptance evidence, so every
        # `explore_every` steps it drafts one token to refresh its estimate
        for b, r in enumerate(requests):
            idle = r.policy_state.get("steps_without_draft", 0)
            if ks[b] == 0 and k_caps[b] > 0 and idle >= self.explore_every:
                ks[b] = 1
            r.policy_state["steps_without_draft"] = 0 if ks[b] > 0 else idle + 1
        return ks


POLICY_CLASSES = {"fixed": FixedPolicy, "confidence": ConfidencePolicy, "head": HeadPolicy, "budget": BudgetPolicy}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICY_CLASSES[spec.policy](spec)
