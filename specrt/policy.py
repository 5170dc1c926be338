"""Draft length: how many tokens each request drafts this step.

A policy answers three questions:
- ``plan(requests, k_caps, batch_context)`` -> K per request before drafting (the cap);
- ``should_stop(request, i, draft_prob, p_accept)`` -> stop drafting request early at depth i
  (confidence / head policies; they need per-draft-step host values);
- ``observe(request, drafted, accepted)`` after verification (acceptance history).

Every policy changes only which tokens are proposed, never the output distribution.
"""
from __future__ import annotations

from collections import deque
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

    def plan(self, requests, k_caps: list[int], costs: "CostModel | None" = None,
             catchup: list[int] | None = None) -> list[int]:
        """K per request (<= its cap). ``catchup``: tokens each request's draft must consume
        before it can draft (its draft KV's lag); only the budget policy prices it."""
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

    def plan(self, requests, k_caps, costs=None, catchup=None):
        for r in requests:
            r.policy_state["p_all"] = 1.0
        return super().plan(requests, k_caps, costs, catchup)


def _nonneg_fit(x, y, always: list[int], optional: list[int]):
    """Least squares with non-negative coefficients over a handful of columns, by trying every
    subset of the optional columns (exact for so few). Among the non-negative fits the one with
    the fewest columns whose residual is within 2% of the best wins: a column that explains
    nothing more (it barely varies, or it moves with another one) is left out, because its share
    would be arbitrary and extrapolate badly. Returns coefficients for every column (0 if out).

    Every subset is solved from one Gram matrix of the RMS-scaled columns (a few microseconds
    each), so a refit costs well under a millisecond."""
    import itertools

    import numpy as np

    # a column that barely varies cannot be told apart from the others' constant part
    optional = [c for c in optional if x[:, c].std() > 0.05 * max(abs(x[:, c].mean()), 1e-12)]
    scale = np.sqrt((x * x).mean(0))
    scale[scale == 0] = 1.0
    xs = x / scale
    gram, xty, yty = xs.T @ xs, xs.T @ y, float(y @ y)
    fits = []
    for size in range(len(optional) + 1):
        for extra in itertools.combinations(optional, size):
            cols = list(always) + list(extra)
            g = gram[np.ix_(cols, cols)]
            try:
                coef = np.linalg.solve(g + 1e-12 * np.trace(g) * np.eye(len(cols)), xty[cols])
            except np.linalg.LinAlgError:
                continue
            if (coef < 0).any():
                continue
            rss = yty - 2.0 * float(coef @ xty[cols]) + float(coef @ g @ coef)
            fits.append((size, max(rss, 0.0), cols, coef))
    out = np.zeros(x.shape[1])
    if not fits:   # even the always-columns alone went negative: their mean ratio
        out[always[0]] = max(float(y.sum() / x[:, always[0]].sum()), 0.0)
        return out
    best = min(f[1] for f in fits)
    size, rss, cols, coef = min((f for f in fits if f[1] <= best * 1.02 + 1e-18), key=lambda f: (f[0], f[1]))
    out[cols] = coef / scale[cols]
    return out


@dataclass
class CostModel:
    """Measured step costs, fitted by non-negative least squares over the recent steps.

    - verify (the step's time besides drafting: planning, the target forward, sampling,
      bookkeeping): seconds ~ v0 + v1 * tokens + v2 * context tokens + v3 * [anything drafted]
      (a multi-token verify may cost a jump over a plain decode step, e.g. another attention
      path, and on a CPU the draft's forwards evict the target's weights from the caches). Plain
      samples count only when the step before was plain too (steady autoregressive decoding);
      the first plain step after drafting is neither. ``steps_since_plain`` lets a policy force
      a short plain run now and then so that both regimes stay measured;
    - draft (the whole drafting phase of a step): seconds ~ d0 * depth + d1 * tokens fed +
      d2 * context attended, where depth is the number of draft forwards, tokens fed counts every
      token the draft consumed, catch-up included (the context a request's draft KV lags behind:
      its prompt the first time it drafts, every token emitted while it did not), and context
      attended sums each forward's rows' sequence lengths.
    """

    def __post_init__(self):
        self.verify_samples: list[tuple[float, float, float, float]] = []  # (tokens, context, drafted, seconds)
        self.steps_since_plain = 0   # steps since the last steady plain sample
        self.num_plain = 0           # steady plain samples so far
        self._prev_drafted = True
        self.draft_samples: list[tuple[float, float, float, float]] = []  # (depth, tokens fed, attended, seconds)
        self._added = [0, 0]        # verify / draft samples ever added
        self._fitted_at = [None, None]
        self.fit_version = 0        # bumped by every refit that changed a fit
        self._verify_coef = None
        self._draft_coef = None

    def add_verify(self, tokens: int, context: int, seconds: float, drafted: bool = False) -> None:
        steady_plain = not drafted and not self._prev_drafted
        self._prev_drafted = drafted
        self.steps_since_plain = 0 if steady_plain else self.steps_since_plain + 1
        if drafted or steady_plain:
            self.verify_samples.append((tokens, context, float(drafted), seconds))
            self.num_plain += steady_plain
            self._added[0] += 1
            del self.verify_samples[:-512]

    def add_draft(self, depth: int, tokens_fed: int, attended: int, seconds: float) -> None:
        if depth > 0:
            self.draft_samples.append((depth, tokens_fed, attended, seconds))
            self._added[1] += 1
            del self.draft_samples[:-512]

    def _due(self, i: int) -> bool:
        """Refit model i after 16 new samples, or a quarter of the fitted window once it is full
        (a fit costs ~0.3 ms, a real share of a millisecond-scale step)."""
        n, at = self._added[i], self._fitted_at[i]
        return n >= 4 and (at is None or n - at >= max(16, min(n, 256) // 4))

    def refit(self) -> None:
        """Refit whichever model has enough new samples (see ``_due``)."""
        import numpy as np

        if self._due(0):
            self._fitted_at[0] = self._added[0]
            v = np.array(self.verify_samples[-256:], dtype=float)
            x = np.column_stack([np.ones(len(v)), v[:, :3]])
            self._verify_coef = _nonneg_fit(x, v[:, 3], always=[0], optional=[1, 2, 3])
            self.fit_version += 1
        if self._due(1):
            self._fitted_at[1] = self._added[1]
            d = np.array(self.draft_samples[-256:], dtype=float)
            self._draft_coef = _nonneg_fit(d[:, :3], d[:, 3], always=[0], optional=[1, 2])
            self.fit_version += 1

    @property
    def has_draft_fit(self) -> bool:
        return self._draft_coef is not None

    def verify_time(self, tokens: int, context: int, drafted: bool = False) -> float:
        c = self._verify_coef
        if c is None:
            return 1.0 + 0.01 * tokens   # unitless until measured: drafting looks worthwhile, so it gets measured
        return max(float(c[0] + c[1] * tokens + c[2] * context + c[3] * drafted), 1e-9)

    def draft_coefs(self, batch: int, context: int) -> tuple[float, float, float]:
        """(seconds per draft forward, per token fed, per context token attended).
        Unmeasured: a forward costs a quarter of a verify, tokens nothing extra."""
        c = self._draft_coef
        if c is None:
            return 0.25 * self.verify_time(batch, context), 0.0, 0.0
        return float(c[0]), float(c[1]), float(c[2])

    def draft_time(self, depth: int, tokens_fed: int, attended: int) -> float:
        a, b, c = self.draft_coefs(tokens_fed, attended)
        return a * depth + b * tokens_fed + c * attended


class BudgetPolicy(DraftPolicy):
    """Across the batch, hand out draft tokens where the expected gain per unit of measured
    cost is highest: maximise expected emitted tokens / predicted step time.

    Draft token i of request b is worth r_b^i expected tokens (r_b: its recent acceptance rate)
    and costs one more verified token, one more draft token fed, and its attention over the
    context. A request that drafts at all also pays its draft's catch-up (the context its draft
    KV lags behind, e.g. the whole prompt the first time), spread over the steps it has left
    (max_tokens - generated over the tokens a step emits); the step pays one draft forward per
    depth, plus once whatever a drafted step costs over a plain one (measured: a multi-token
    verify may take another path; now and then a plain step keeps that measured). For each
    depth the best allocation at throughput lambda maximises
    gain - lambda * cost per request; a few fixed-point rounds (Dinkelbach) find lambda, and the
    best depth wins if it beats plain decoding by ``min_gain`` (5%: the fitted costs are noisy,
    and a thin predicted gain is as likely a loss). K=0 for everyone (speculation off) when drafting does not pay, e.g. large
    batches where a verify is no longer almost free, or short requests with long prompts.

    A request kept at K=0 produces no acceptance evidence, so every ``explore_every`` idle steps
    it drafts one token, but only if an optimistic acceptance (its estimate + 0.25) would pay for
    that token and its catch-up at the current throughput, and only with 2 x explore_every
    tokens left to use what it finds: a drafter too slow to ever pay here never costs a catch-up.
    A request without history is expected to accept what all requests recently did."""

    name = "budget"
    explore_every = 16
    plain_every = 64
    plain_run = 3
    min_gain = 0.05     # draft only for a predicted gain above the costs' estimation error
    optimism = 0.25

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self._off = None   # the last full plan, while it switched speculation off (see plan)
        self._plain_left = 0
        self._pooled = deque(maxlen=512)   # recent acceptance outcomes of every request

    def observe(self, request, drafted: int, accepted: int) -> None:
        super().observe(request, drafted, accepted)
        if drafted:
            self._pooled.extend([1] * accepted + ([0] if accepted < drafted else []))

    def _prior(self) -> float:
        """What a request without history is expected to accept: the pooled recent rate of all
        requests (0.7 until 32 outcomes are known)."""
        return sum(self._pooled) / len(self._pooled) if len(self._pooled) >= 32 else 0.7

    def plan(self, requests, k_caps, costs=None, catchup=None):
        import numpy as np

        costs = costs or CostModel()
        costs.refit()
        n = len(requests)
        if n == 0:
            return []
        lag = list(catchup) if catchup is not None else [0] * n
        caps = [max(min(c, self.spec.max_draft_length), 0) for c in k_caps]
        if self.spec.min_draft_length == 0:
            # keep the cost of steady plain decoding measured: a run of plain steps (the first
            # one only clears the caches of the draft's traces), soon at first (after 8, 16, 32
            # steps without a plain sample), then every plain_every
            if costs.steps_since_plain >= min(self.plain_every, 8 << costs.num_plain):
                self._plain_left = self.plain_run
            if self._plain_left > 0:
                self._plain_left -= 1
                self._count_idle(requests)
                return [0] * n
        # Speculation off stays off while nothing it depended on moved: the same batch, no refit,
        # under explore_every steps (no drafting means no new acceptance evidence; caps only shrink; the draft lags
        # and the steps left shrink, both of which only make drafting dearer). Planning is then
        # a lookup, so an off policy costs next to nothing per step.
        key = (tuple(id(r) for r in requests), tuple(c > 0 for c in caps), costs.fit_version)
        off = self._off
        if off is not None and off["key"] == key and off["age"] < self.explore_every:
            off["age"] += 1
            out = [0] * n
            self._explore(requests, out, caps, lag, off["lam"], off["prices"], costs.has_draft_fit)
            return out
        self._off = None

        caps_a = np.array(caps)
        floor = np.minimum(self.spec.min_draft_length, caps_a)
        kmax = int(caps_a.max())
        prior = self._prior()
        rates = np.array([recent_acceptance(r, self.spec.acceptance_window, prior) for r in requests])
        ctxs = np.array([r.context_len for r in requests], dtype=float)
        left = np.array([max(r.params.max_tokens - r.num_generated, 1) for r in requests], dtype=float)
        ctx = float(ctxs.sum())
        t_ar = costs.verify_time(n, ctx, drafted=False)
        t_drafted = costs.verify_time(n, ctx, drafted=True)
        per_verify = max(costs.verify_time(n + 1, ctx, drafted=True) - t_drafted, 0.0)
        d_fwd, d_tok, d_ctx = costs.draft_coefs(n, ctx)
        d_fwd1 = max(t_drafted - t_ar, 0.0)    # a step that drafts at all pays this once

        ks = np.arange(kmax + 1)
        gains, cost = self._tables(rates, ks, per_verify + d_tok + d_ctx * ctxs, d_tok * np.array(lag, float), left)
        rows = np.arange(n)

        def value(choice):
            g = n + gains[rows, choice].sum()
            depth = int(choice.max())
            t = t_ar + cost[rows, choice].sum() + d_fwd * depth + (d_fwd1 if depth else 0.0)
            return g / max(t, 1e-12)

        best_ks = floor.copy()
        best = value(best_ks)
        for depth in range(max(int(floor.max()), 1), kmax + 1):
            allowed = (ks[None, :] >= floor[:, None]) & (ks[None, :] <= np.minimum(caps_a, depth)[:, None])
            lam = best
            for _ in range(6):
                choice = np.where(allowed, gains - lam * cost, -np.inf).argmax(1)
                val = value(choice)
                if val <= lam * (1 + 1e-9):
                    break
                lam = val
                if val > best * (1 + 1e-9):
                    best, best_ks = val, choice.copy()
        plain = value(floor)
        if best < plain * (1.0 + self.min_gain):
            best, best_ks = plain, floor      # not worth the estimation error: stay plain
        self.last_prediction = (best, plain)
        out = [int(k) for k in best_ks]
        prices = (per_verify, d_fwd + d_fwd1, d_tok, d_ctx)
        if not any(out):
            self._off = {"key": key, "age": 1, "lam": best, "prices": prices}
        self._explore(requests, out, caps, lag, best, prices, costs.has_draft_fit)
        return out

    @staticmethod
    def _tables(rates, ks, per_token, fixed_total, left):
        """gains[b, k] = sum_{i<=k} r_b^i; cost[b, k] = k * per_token[b] + (k > 0) * the catch-up
        fixed_total[b] spread over the request's remaining steps at that k."""
        import numpy as np

        powers = rates[:, None] ** ks[None, :]                      # r^0 .. r^K
        gains = np.cumsum(powers, 1) - 1.0                          # sum_{i=1..k} r^i
        steps_left = np.maximum(left[:, None] / (1.0 + gains), 1.0)
        cost = ks[None, :] * per_token[:, None] + np.where(ks[None, :] > 0, fixed_total[:, None] / steps_left, 0.0)
        return gains, cost

    @staticmethod
    def _count_idle(requests) -> None:
        for r in requests:
            r.policy_state["steps_without_draft"] = r.policy_state.get("steps_without_draft", 0) + 1

    def _explore(self, requests, ks, caps, lag, lam, prices, fitted) -> None:
        per_verify, d_fwd, d_tok, d_ctx = prices
        someone_drafts = any(ks)
        prior = None
        for b, r in enumerate(requests):
            idle = r.policy_state.get("steps_without_draft", 0)
            left = max(r.params.max_tokens - r.num_generated, 1)
            # worth a look only with enough tokens left to use what it finds
            if ks[b] == 0 and caps[b] > 0 and idle >= self.explore_every and left >= 2 * self.explore_every:
                # would one token pay at the current throughput if this request's drafts were
                # accepted more often than measured? (always, while draft costs are unmeasured)
                prior = self._prior() if prior is None else prior
                r_opt = min(recent_acceptance(r, self.spec.acceptance_window, prior) + self.optimism, 0.97)
                steps_left = max(left / (1.0 + r_opt), 1.0)
                price = (per_verify + d_tok + d_ctx * r.context_len + d_tok * lag[b] / steps_left
                         + (0.0 if someone_drafts else d_fwd))
                if not fitted or r_opt >= lam * price:
                    ks[b] = 1
                idle = -1          # explored, or not worth it: look again in explore_every steps
            r.policy_state["steps_without_draft"] = 0 if ks[b] > 0 else idle + 1


POLICY_CLASSES = {"fixed": FixedPolicy, "confidence": ConfidencePolicy, "head": HeadPolicy, "budget": BudgetPolicy}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICY_CLASSES[spec.policy](spec)
