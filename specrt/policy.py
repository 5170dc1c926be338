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
        self._dropped = 0   # samples aged out (keeps the refit counter monotonic)

    @staticmethod
    def _fit(samples):
        import numpy as np

        if len(samples) < 4:
            return None
        arr = np.array(samples[-256:], dtype=float)
        # a feature that barely varies cannot be told apart from the intercept: leave it out
        # (else the split between them is arbitrary and extrapolates badly)
        cols = [c for c in (0, 1) if arr[:, c].std() > 0.05 * max(abs(arr[:, c].mean()), 1.0)]
        x = np.column_stack([np.ones(len(arr))] + [arr[:, c] for c in cols])
        fit, *_ = np.linalg.lstsq(x, arr[:, 2], rcond=None)
        coef = np.zeros(3)
        coef[0] = fit[0]
        for j, c in enumerate(cols):
            coef[1 + c] = fit[1 + j]
        if coef[1] < 0 or coef[2] < 0:     # costs never fall with more work: refit without them
            coef = np.array([arr[:, 2].mean(), 0.0, 0.0])
        return coef

    def add_verify(self, tokens: int, context: int, seconds: float) -> None:
        self.verify_samples.append((tokens, context, seconds))
        self._trim(self.verify_samples)

    def add_draft(self, tokens: int, context: int, seconds: float) -> None:
        self.draft_samples.append((tokens, context, seconds))
        self._trim(self.draft_samples)

    def _trim(self, samples: list) -> None:
        if len(samples) > 512:
            self._dropped += len(samples) - 512
            del samples[:-512]

    def refit(self) -> None:
        """Least-squares fits of the recent samples. A fit costs ~0.5 ms (a real share of a
        millisecond-scale step), so it is redone only after 16 new samples."""
        seen = len(self.verify_samples) + len(self.draft_samples) + self._dropped
        if getattr(self, "_fitted_at", None) is not None and seen - self._fitted_at < 16:
            return
        self._fitted_at = seen
        self._verify_coef = self._fit(self.verify_samples)
        self._draft_coef = self._fit(self.draft_samples)

    def verify_time(self, tokens: int, context: int) -> float:
        c = getattr(self, "_verify_coef", None)
        if c is None:
            return 1.0 + 0.01 * tokens
        return float(c[0] + c[1] * tokens + c[2] * context) or 1e-6

    def draft_step_time(self, batch: int, context: int) -> float:
        c = getattr(self, "_draft_coef", None)
        if c is None:
            return 0.25
        return float(c[0] + c[1] * batch + c[2] * context) or 1e-6


class BudgetPolicy(DraftPolicy):
    """Across the batch, hand out draft tokens where the expected gain per unit of measured
    cost is highest, maximising expected emitted tokens / predicted step time.

    Token i of request b is worth r_b^i expected tokens (r_b: its recent acceptance rate) and
    costs the marginal verify time of one more token; the draft costs one batched forward per
    draft depth. For each depth D the best allocation at throughput lambda takes every token
    with r_b^i >= lambda * (marginal token cost); a few fixed-point rounds (Dinkelbach) find
    lambda, and the best depth wins. A request whose tokens do not pay gets K=0 (speculation
    off); longer contexts raise the measured costs and so shorten K."""

    name = "budget"
    explore_every = 16

    def plan(self, requests, k_caps, costs=None):
        costs = costs or CostModel()
        costs.refit()
        n = len(requests)
        if n == 0:
            return []
        rates = [recent_acceptance(r, self.spec.acceptance_window) for r in requests]
        ctx = sum(r.context_len for r in requests)
        caps = [min(c, self.spec.max_draft_length) for c in k_caps]
        floor = [min(self.spec.min_draft_length, c) for c in caps]
        base_tokens = n
        t_ar = costs.verify_time(base_tokens, ctx)
        per_token = max(costs.verify_time(base_tokens + 1, ctx) - t_ar, 1e-9)

        def evaluate(ks):
            expected = sum(1.0 + sum(rates[b] ** i for i in range(1, ks[b] + 1)) for b in range(n))
            depth = max(ks)
            t = costs.verify_time(base_tokens + sum(ks), ctx)
            if depth:
                t += depth * costs.draft_step_time(sum(1 for k in ks if k > 0), ctx)
            return expected / t

        best_ks = list(floor)
        best = evaluate(best_ks)
        for depth in range(1, max(caps, default=0) + 1):
            lam = best
            ks = list(floor)
            for _ in range(4):
                ks = [max(floor[b], min(caps[b], depth, self._take(rates[b], lam * per_token))) for b in range(n)]
                val = evaluate(ks)
                if val <= lam * (1 + 1e-9):
                    break
                lam = val
            val = evaluate(ks)
            if val > best * (1 + 1e-9):
                best, best_ks = val, ks
        # exploration: a request kept at K=0 stops producing acceptance evidence, so every
        # `explore_every` steps it drafts one token to refresh its estimate
        for b, r in enumerate(requests):
            idle = r.policy_state.get("steps_without_draft", 0)
            if best_ks[b] == 0 and caps[b] > 0 and idle >= self.explore_every:
                best_ks[b] = 1
            r.policy_state["steps_without_draft"] = 0 if best_ks[b] > 0 else idle + 1
        return best_ks

    @staticmethod
    def _take(rate: float, threshold: float) -> int:
        """How many leading draft tokens are worth at least `threshold` each (rate^i >= threshold)."""
        k, w = 0, 1.0
        while k < 64:
            w *= rate
            if w < threshold:
                break
            k += 1
        return k


POLICY_CLASSES = {"fixed": FixedPolicy, "confidence": ConfidencePolicy, "head": HeadPolicy, "budget": BudgetPolicy}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICY_CLASSES[spec.policy](spec)
