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

import numpy as np

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
      + v4 * requests (per-request work: a CPU's attention gathers each request's blocks)
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
        self.verify_samples: list[tuple] = []    # (tokens, context, drafted, requests, seconds)
        self.steps_since_plain = 0   # steps since the last steady plain sample
        self.num_plain = 0           # steady plain samples so far
        self._prev_drafted = True
        self.draft_samples: list[tuple[float, float, float, float]] = []  # (depth, tokens fed, attended, seconds)
        self._added = [0, 0]        # verify / draft samples ever added
        self._fitted_at = [None, None]
        self.fit_version = 0        # bumped by every refit that changed a fit
        self._verify_coef = None
        self._draft_coef = None

    def add_verify(self, tokens: int, context: int, seconds: float, drafted: bool = False, requests: int = 1) -> None:
        steady_plain = not drafted and not self._prev_drafted
        self._prev_drafted = drafted
        self.steps_since_plain = 0 if steady_plain else self.steps_since_plain + 1
        if drafted or steady_plain:
            self.verify_samples.append((tokens, context, float(drafted), requests, seconds))
            self.num_plain += steady_plain
            self._added[0] += 1
            del self.verify_samples[:-512]

    def add_draft(self, depth: int, tokens_fed: int, attended: int, seconds: float) -> None:
        if depth > 0:
            self.draft_samples.append((depth, tokens_fed, attended, seconds))
            self._added[1] += 1
            del self.draft_samples[:-512]

    def _due(self, i: int) -> bool:
        """Refit model i after 16 new samples at first, every quarter of the samples seen so far
        up to 128 (half the fitted window of 256): a fit and the full plan it forces cost ~1.5 ms,
        a real share of a millisecond-scale step."""
        n, at = self._added[i], self._fitted_at[i]
        return n >= 4 and (at is None or n - at >= max(16, min(n, 512) // 4))

    def refit(self) -> None:
        """Refit whichever model has enough new samples (see ``_due``). ``fit_version`` moves
        only when a refit changed a prediction on the recent samples by more than 2% (plans
        built on the old fit stay valid otherwise: decisions need a 10% predicted gain)."""
        if self._due(0):
            self._fitted_at[0] = self._added[0]
            v = np.array(self.verify_samples[-256:], dtype=float)
            x = np.column_stack([np.ones(len(v)), v[:, :4]])
            self._verify_coef = self._bump(x, self._verify_coef, _nonneg_fit(x, v[:, 4], always=[0],
                                                                             optional=[1, 2, 3, 4]))
        if self._due(1):
            self._fitted_at[1] = self._added[1]
            d = np.array(self.draft_samples[-256:], dtype=float)
            self._draft_coef = self._bump(d[:, :3], self._draft_coef, _nonneg_fit(d[:, :3], d[:, 3], always=[0],
                                                                                  optional=[1, 2]))

    def _bump(self, x, old, new):
        if old is None or np.max(np.abs(x @ (new - old)) / np.maximum(x @ old, 1e-12)) > 0.02:
            self.fit_version += 1
            return new
        return old      # within 2% everywhere: keep the fit the plans were built on

    @property
    def has_draft_fit(self) -> bool:
        return self._draft_coef is not None

    def verify_time(self, tokens: int, context: int, drafted: bool = False, requests: int = 1) -> float:
        c = self._verify_coef
        if c is None:
            return 1.0 + 0.01 * tokens   # unitless until measured: drafting looks worthwhile, so it gets measured
        return max(float(c[0] + c[1] * tokens + c[2] * context + c[3] * drafted + c[4] * requests), 1e-9)

    def draft_coefs(self, batch: int, context: int) -> tuple[float, float, float]:
        """(seconds per draft forward, per token fed, per context token attended).
        Unmeasured: a forward costs a quarter of a verify, tokens nothing extra."""
        c = self._draft_coef
        if c is None:
            return 0.25 * self.verify_time(batch, context, requests=batch), 0.0, 0.0
        return float(c[0]), float(c[1]), float(c[2])

    def draft_time(self, depth: int, tokens_fed: int, attended: int) -> float:
        a, b, c = self.draft_coefs(tokens_fed, attended)
        return a * depth + b * tokens_fed + c * attended


class BudgetPolicy(DraftPolicy):
    """Across the batch, hand out draft tokens where the expected gain per unit of measured
    cost is highest: maximise expected emitted tokens / predicted step time.

    Prices (from the CostModel, fitted on this engine's own steps): draft token i of request b
    is worth fill_b * r_b^i expected tokens (r_b: its recent acceptance, shrunk towards the
    pooled rate of all requests; fill_b: the fraction of asked tokens its drafter proposes) and
    costs one more verified token, one more draft token fed and its attention over the context.
    A request that drafts at all also pays its draft's catch-up (the context its draft KV lags
    behind, e.g. the whole prompt the first time), spread over the steps it has left. The step
    pays one draft forward per depth, plus once whatever a drafted step costs over a plain one.

    Plan: for each depth the best allocation at throughput lambda maximises gain - lambda * cost
    per request; a few fixed-point rounds (Dinkelbach) find lambda; the best depth wins if it
    beats plain decoding by ``min_gain`` (the fitted costs are noisy: a thin predicted gain is as
    likely a loss). Both predictions are corrected by what past planned steps of their kind
    delivered against their prediction at similar batch sizes (``step_done``), so a model that is
    optimistic about drafting is overruled by the measured outcome. K=0 for everyone (speculation
    off) when drafting does not pay: large batches where a verify is no longer almost free, a
    draft that costs too much of a target step, short requests with long prompts. While off,
    planning is a lookup.

    Measuring: now and then a short run of plain steps keeps the plain cost measured while
    everything drafts. A request kept at K=0 produces no acceptance evidence, so every
    ``explore_every`` idle steps it drafts one token if an optimistic acceptance (+0.25) would pay
    for that token and its catch-up: a drafter too slow to ever pay never costs a catch-up; one
    that needs no catch-up is looked at once per ``explore_max`` steps regardless."""

    name = "budget"
    explore_every = 16
    plain_every = 64
    explore_max = 256   # steps without any draft after which one look is taken regardless of price
    plain_run = 3
    replan_every = 64   # while off, a full plan at least this often (contexts grow)
    min_gain = 0.10     # draft only for a predicted gain above the costs' estimation error
    min_gain_free = 0.03  # the same for a drafter whose measured cost is negligible (see _margin)
    track_decay = 0.95  # realized / predicted: weight of a step falls by this per later step of its kind
    track_prior = 20.0  # steps' worth of 'as predicted' the measured ratio is shrunk towards
    prior_weight = 8.0  # outcomes' worth of the pooled rate in a request's own acceptance estimate
    track_forget = 0.998  # per step of the other kind (half-life ~350 steps)
    optimism = 0.25
    depth_decay = 0.998  # per drafted outcome, of the pooled per-position acceptance counts
    class_decay = 0.998  # per outcome, of the pooled counts per evidence class (see _rate)
    small_batch = 8     # up to this many requests the plan's search runs in plain Python (faster there)
    dormant_max = 16    # while off, at most this many steps in a row skip planning (see dormant)
    recheck_every = 32  # steps between drafted steps taken to re-measure a vetoing correction

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self._off = None   # the last full plan, while it switched speculation off (see plan)
        self._plain_left = 0
        self._pooled = deque(maxlen=512)   # recent acceptance outcomes of every request
        # per kind (plain, drafted): decayed sums of realized tokens, seconds, predicted tokens,
        # seconds, and the steps' weight (see step_done)
        self._track: dict[int, list] = {}   # batch-size bucket -> [plain sums, drafted sums]
        self._since_drafted = 0             # steps since anything was drafted (see _explore)
        self._fruitless_looks = 0           # looks with a catch-up since a plan last drafted
        self._fill = 1.0                   # pooled fraction of asked draft tokens proposed
        self._tracked = None               # (kind, predicted tokens, predicted seconds) of this step
        # pooled acceptance by draft position, decayed: tried[i] / accepted[i] count position i
        # (1-based) reached / accepted; their ratio to the overall rate shapes every request's
        # per-position acceptance (an n-gram match that survives its first token tends to go on)
        self._depth_tried = np.zeros(spec.max_draft_length + 1)
        self._depth_acc = np.zeros(spec.max_draft_length + 1)
        self._depth_profile = None          # cached depth_profile(), reset by observe
        # pooled acceptance outcomes by the drafter's evidence class (the n-gram drafter's match
        # length: a 4-token suffix match is accepted far more often than a 1-token one), decayed
        self._class_counts: dict[int, list[float]] = {}   # class -> [outcomes, accepted]
        self._off_streak = 0                # checked steps in a row that kept speculation off
        self._sleep = 0                     # steps left that skip planning (see dormant)
        self._sleep_n = 0                   # the batch size when they were granted
        self._slept = 0                     # steps skipped since the last plan
        self._clock = 0                     # steps planned or slept ("seen": a request's first)
        self._since_tracked_draft = 0       # steps since a tracked drafted step (see recheck_every)

    def observe(self, request, drafted: int, accepted: int) -> None:
        super().observe(request, drafted, accepted)
        if drafted:
            self._pooled.extend([1] * accepted + ([0] if accepted < drafted else []))
            cls = request.drafter_state.get("match_n")
            if cls:
                counts = self._class_counts.setdefault(cls, [0.0, 0.0])
                outcomes = accepted + (accepted < drafted)
                decay = self.class_decay ** outcomes
                counts[0] = counts[0] * decay + outcomes
                counts[1] = counts[1] * decay + accepted
            reached = min(accepted + 1, drafted, len(self._depth_tried) - 1)
            self._depth_tried *= self.depth_decay
            self._depth_acc *= self.depth_decay
            self._depth_tried[1:reached + 1] += 1.0
            self._depth_acc[1:min(accepted, reached) + 1] += 1.0
            self._depth_profile = None
        asked = request.policy_state.pop("asked", 0)
        if asked > 0:
            # how much of what was asked the drafter proposed (an n-gram drafter proposes nothing
            # without a match; a model drafter always all of it)
            fill = request.policy_state.get("fill", self._fill)
            request.policy_state["fill"] = fill + 0.25 * (min(drafted / asked, 1.0) - fill)
            self._fill += 0.05 * (min(drafted / asked, 1.0) - self._fill)

    def depth_profile(self) -> np.ndarray:
        """factor[i] (i = 1..K; factor[0] = 1): pooled acceptance at draft position i given the
        positions before it were accepted, over the pooled overall rate, each position shrunk
        towards the overall rate by ``prior_weight`` outcomes (all ones without evidence). A
        request's acceptance at position i is then its own rate times factor[i]."""
        prof = self._depth_profile
        if prof is None:
            tried, acc = self._depth_tried, self._depth_acc
            total = float(tried[1:].sum())
            prof = np.ones(len(tried))
            if total > 0:
                mean = float(acc[1:].sum()) / total
                if mean > 0:
                    cond = (acc[1:] + mean * self.prior_weight) / (tried[1:] + self.prior_weight)
                    prof[1:] = np.clip(cond / mean, 0.25, 4.0)
            self._depth_profile = prof
        return prof

    @staticmethod
    def _identity(requests) -> tuple:
        """The batch as the off fast paths compare it: which requests, and each one's evidence
        class (a class that changed changes its expected acceptance: priced afresh)."""
        return (tuple(r.request_id for r in requests), tuple(map(id, requests)),
                tuple(r.drafter_state.get("match_n") for r in requests))

    def _prior(self) -> float:
        """What a request without history is expected to accept: the pooled recent rate of all
        requests (0.7 until 32 outcomes are known)."""
        return sum(self._pooled) / len(self._pooled) if len(self._pooled) >= 32 else 0.7

    def _rate(self, r, prior: float) -> float:
        """A request's expected acceptance: its recent history shrunk towards the pooled rate,
        or, when its drafter reports an evidence class with 32+ pooled outcomes (the n-gram
        match length), towards that class's rate with the weight of a whole window: a request's
        history mixes classes that differ by 3x (n-gram, batch 4: 0.22 accepted per drafted
        token after a 1-token match, 0.71 after a 4-token one), the class is this step's."""
        cls = r.drafter_state.get("match_n")
        counts = self._class_counts.get(cls) if cls else None
        if counts is not None and counts[0] >= 32:
            return recent_acceptance(r, self.spec.acceptance_window, counts[1] / counts[0],
                                     float(self.spec.acceptance_window))
        return recent_acceptance(r, self.spec.acceptance_window, prior, self.prior_weight)

    def dormant(self, num_requests: int) -> bool:
        """Whether this step may skip planning: K=0 for everyone without looking.

        While off, a plan is a few scalar sums, but at batch 1-16 on a CPU that was still ~1-1.5%
        of a step (50-170 us of 4-14 ms: newcomers priced, refits checked, idle counters), the
        whole gap between an off policy and autoregressive decoding. So an off verdict that held
        at s checked steps in a row lets the next min(s // 2, dormant_max) steps skip planning.
        What can make drafting pay while asleep: a batch down by a quarter (a verify is cheaper
        per token of throughput; one request less of 16 is no news, and under continuous
        batching a batch shrinks by ones all through its tail) wakes it at once; a newcomer that
        would pay waits for the next check, at most dormant_max steps. The steps slept still
        count for exploration (idle counters), the overdue look and the off verdict's age (see
        plan), so those keep their schedule in steps.
        Only for drafters whose caps do not come and go (not n-gram: a match appearing is the
        news, and finding it is the plan's own cost)."""
        if self._sleep <= 0:
            return False
        if num_requests < self._sleep_n and 4 * (self._sleep_n - num_requests) >= self._sleep_n:
            self._sleep = 0
            return False
        self._clock += 1
        self._sleep -= 1
        self._slept += 1
        self._tracked = None
        return True

    def plan(self, requests, k_caps, costs=None, catchup=None):
        slept, self._slept, self._sleep = self._slept, 0, 0
        self._since_tracked_draft += 1 + slept
        if slept:
            self._since_drafted += slept
            if self._off is not None:
                self._off["age"] += slept
            for r in requests:      # (a newcomer was not there for all of them)
                st = r.policy_state
                st["steps_without_draft"] = (st.get("steps_without_draft", 0)
                                             + min(slept, self._clock - st.get("seen", self._clock)))
        self._clock += 1
        for r in requests:
            r.policy_state.setdefault("seen", self._clock)
        out = self._plan_step(requests, k_caps, costs, catchup)
        if self._off is not None:        # the verdict was off (a look may have been added)
            self._off_streak += 1
            # a look's outcome is news: the step after it plans
            self._sleep = 0 if any(out) else min(self._off_streak // 2, self.dormant_max)
            self._sleep_n = len(requests)
        else:
            self._off_streak = 0
        return out

    def _plan_step(self, requests, k_caps, costs=None, catchup=None):
        costs = costs or CostModel()
        costs.refit()
        n = len(requests)
        if n == 0:
            return []
        off = self._off
        if (off is not None and not self._plain_left and off["costs"] is costs and off["fit"] == costs.fit_version
                and off["age"] < self.replan_every and costs.steps_since_plain == 0 and not self._recheck_due()):
            same, prev = self._identity(requests), off.get("same")
            if prev is not None and same == prev[:3] and all(c <= p for c, p in zip(k_caps, prev[3])):
                # the very batch of the last off step, no cap grew (caps shrink as requests near
                # their end, which only makes drafting dearer): only contexts grew, a few tokens
                # each, priced again at the next full plan (replan_every steps at most)
                off["age"] += 1
                return self._off_step(requests, k_caps, catchup or [0] * n, costs, off, off["plain"], off["t_ar"])
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
                self._tracked = None
                return [0] * n
        # Speculation off stays off while the verdict provably holds: planning is then a few
        # scalar sums, so an off policy costs next to nothing per step even while requests come
        # and go (see _still_off); a full plan after a refit or every replan_every steps.
        off = self._off
        if (off is not None and off["costs"] is costs and off["fit"] == costs.fit_version
                and off["age"] < self.replan_every and not self._recheck_due()):
            out = self._still_off(requests, caps, lag, costs, off)
            if out is not None:
                return out
        self._off = None

        floor = [min(self.spec.min_draft_length, c) for c in caps]
        prior = self._prior()
        ctx = float(sum(r.context_len for r in requests))
        t_ar = costs.verify_time(n, ctx, drafted=False, requests=n)
        t_drafted = costs.verify_time(n, ctx, drafted=True, requests=n)
        per_verify = max(costs.verify_time(n + 1, ctx, drafted=True, requests=n) - t_drafted, 0.0)
        d_fwd, d_tok, d_ctx = costs.draft_coefs(n, ctx)
        d_fwd1 = max(t_drafted - t_ar, 0.0)    # a step that drafts at all pays this once
        margin = self._margin(costs, d_fwd, d_tok, t_ar, n)

        if n <= self.small_batch:
            best, best_ks, plain, tokens_time, off_rows = self._search_small(
                requests, caps, floor, lag, prior, t_ar, per_verify, d_fwd, d_fwd1, d_tok, d_ctx)
        else:
            best, best_ks, plain, tokens_time, off_rows = self._search(
                requests, caps, floor, lag, prior, t_ar, per_verify, d_fwd, d_fwd1, d_tok, d_ctx)
        # what past steps delivered against what was predicted for them (log ratio, per kind)
        # corrects what the fit misses, e.g. acceptance that is not independent per position
        drafted_pred = best
        # vetoed: the costs predict the margin's gain, only what past drafted steps delivered
        # against their predictions says no. That verdict is formed from steps of other batches
        # and moments (on a shared host, a slow minute) and a vetoed policy takes no drafted
        # steps to revise it: without re-measuring it would last until the evidence fades
        # (hundreds of steps). So every recheck_every steps one such plan runs and is tracked;
        # only plans without a catch-up (a look at a lagging draft costs its whole context)
        vetoed = (best >= plain * (1.0 + margin) and any(best_ks)
                  and not any(lag[b] for b in range(n) if best_ks[b]))
        recheck = vetoed and self._since_tracked_draft >= self.recheck_every
        if best < self._threshold(plain, n, margin) and not recheck:
            best, best_ks = plain, floor      # not worth the estimation error: stay plain
        self.last_prediction = (drafted_pred, plain)
        out = [int(k) for k in best_ks]
        for r, k in zip(requests, out):
            r.policy_state["asked"] = k
        drafts = any(out)
        # a step that (re)computes a context (prefill, after preemption) is not what was priced
        prefill = any(r.context_len - r.target_cached > 1 for r in requests)
        measured = costs._verify_coef is not None     # else the prediction is in made-up units
        self._tracked = (int(drafts), *tokens_time(best_ks), n) if measured and not prefill else None
        prices = (per_verify, d_fwd + d_fwd1, d_tok, d_ctx)
        if not drafts and self.spec.min_draft_length == 0:
            # the verdict, per request: its best surplus over the threshold throughput at each
            # depth (sum_k gain - lam * cost, the step's fixed drafting costs aside) and the cost
            # of that depth; the step drafts only if the surplus of all requests beats those fixed
            # costs (see _still_off)
            lam = self._threshold(plain, n, margin)
            rows = off_rows(lam)
            self._off = {"costs": costs, "fit": costs.fit_version, "age": 1, "lam": best, "prices": prices,
                         "margin": margin, "vetoed": vetoed,
                         "coefs": (per_verify, d_fwd, d_fwd1, d_tok, d_ctx), "depths": self.spec.max_draft_length + 1,
                         "rows": {(r.request_id, id(r), r.drafter_state.get("match_n")): row
                                  for r, row in zip(requests, rows)}}
        self._explore(requests, out, caps, lag, best, prices, costs.has_draft_fit)
        if any(out) != drafts:
            self._tracked = None              # an exploration step: not what was predicted
        return out

    def _search(self, requests, caps, floor, lag, prior, t_ar, per_verify, d_fwd, d_fwd1, d_tok, d_ctx):
        """The plan's search: the allocation of draft tokens with the best predicted throughput,
        (n + expected accepted) / step time. Returns (best, its K per request, plain decoding's
        throughput, tokens_time(choice) -> (tokens, seconds), off_rows(lam) -> each request's
        (cap, lam, surplus, cost) rows for the off state). Every depth d at once ([D, n, K+1]):
        Dinkelbach rounds, each the best allocation per request at that depth's throughput
        lam_d, until no depth improves."""
        n = len(requests)
        caps_a, floor_a = np.array(caps), np.array(floor)
        kmax = int(caps_a.max())
        rates = np.array([self._rate(r, prior) for r in requests])
        ctxs = np.array([r.context_len for r in requests], dtype=float)
        left = np.array([max(r.params.max_tokens - r.num_generated, 1) for r in requests], dtype=float)
        fill = np.array([r.policy_state.get("fill", self._fill) for r in requests])
        ks = np.arange(self.spec.max_draft_length + 1)    # every depth: the off rows need them all
        gains, cost = self._tables(np.minimum(rates[:, None] * self.depth_profile()[None, :], 0.99), ks,
                                   per_verify + d_tok + d_ctx * ctxs, d_tok * np.array(lag, float), left, fill)
        rows = np.arange(n)

        def tokens_time(choice):
            choice = np.asarray(choice)
            depth = int(choice.max())
            g = n + gains[rows, choice].sum()
            return float(g), float(max(t_ar + cost[rows, choice].sum() + d_fwd * depth + (d_fwd1 if depth else 0.0),
                                       1e-12))

        best_ks = floor_a.copy()
        g0, t0 = tokens_time(best_ks)
        best = plain = g0 / t0
        lo = max(int(floor_a.max()), 1)
        if kmax >= lo:
            depths = np.arange(lo, kmax + 1)
            limit = np.minimum(caps_a[None, :], depths[:, None])
            allowed = (ks[None, None, :] >= floor_a[None, :, None]) & (ks[None, None, :] <= limit[:, :, None])
            lam = np.full(len(depths), best)
            live = np.ones(len(depths), dtype=bool)
            for _ in range(6):
                choice = np.where(allowed, gains[None] - lam[:, None, None] * cost[None], -np.inf).argmax(2)
                deep = choice.max(1)
                g = n + gains[rows, choice].sum(1)
                t = np.maximum(t_ar + cost[rows, choice].sum(1) + d_fwd * deep + np.where(deep > 0, d_fwd1, 0.0),
                               1e-12)
                val = g / t
                live &= val > lam * (1 + 1e-9)
                if not live.any():
                    break
                lam = np.where(live, val, lam)
                j = int(np.argmax(np.where(live, val, -np.inf)))
                if val[j] > best * (1 + 1e-9):
                    best, best_ks = float(val[j]), choice[j].copy()

        def off_rows(lam):
            within = ks[None, :] <= caps_a[:, None]
            surplus = np.maximum.accumulate(np.maximum(np.where(within, gains - lam * cost, -np.inf), 0.0), axis=1)
            reach = np.maximum.accumulate(np.where(within, cost, 0.0), axis=1)
            return [(caps[b], lam, surplus[b].tolist(), reach[b].tolist()) for b in range(n)]
        return best, [int(k) for k in best_ks], plain, tokens_time, off_rows

    def _search_small(self, requests, caps, floor, lag, prior, t_ar, per_verify, d_fwd, d_fwd1, d_tok, d_ctx):
        """``_search`` in plain Python, depth by depth, for a few requests: numpy's per-call
        overhead made a drafting plan ~180 us at batch 1 (~5% of a CPU step) for tables of a
        handful of values. Same prices (``_row_tables``), same result."""
        n = len(requests)
        tables = [self._row_tables(r, caps[b], lag[b], prior, per_verify + d_tok + d_ctx * r.context_len, d_tok)
                  for b, r in enumerate(requests)]

        def tokens_time(choice):
            depth = max(choice)
            g = n + sum(tables[b][0][k] for b, k in enumerate(choice))
            t = t_ar + sum(tables[b][1][k] for b, k in enumerate(choice)) + d_fwd * depth + (d_fwd1 if depth else 0.0)
            return float(g), float(max(t, 1e-12))

        best_ks = list(floor)
        g0, t0 = tokens_time(best_ks)
        best = plain = g0 / t0
        for depth in range(max(max(floor), 1), max(caps) + 1):
            lam = best
            for _ in range(6):
                choice = []
                for b in range(n):
                    gb, cb = tables[b]
                    kb = floor[b]
                    vb = gb[kb] - lam * cb[kb]
                    for k in range(kb + 1, min(caps[b], depth) + 1):
                        v = gb[k] - lam * cb[k]
                        if v > vb:
                            kb, vb = k, v
                    choice.append(kb)
                g, t = tokens_time(choice)
                val = g / t
                if val <= lam * (1 + 1e-9):
                    break
                lam = val
                if val > best * (1 + 1e-9):
                    best, best_ks = val, choice

        def off_rows(lam):
            depths = self.spec.max_draft_length + 1
            return [self._surplus_row(caps[b], lam, depths, *tables[b]) for b in range(n)]
        return best, best_ks, plain, tokens_time, off_rows

    def _recheck_due(self) -> bool:
        """An off verdict that only the measured corrections held (see plan) is planned in full
        once recheck_every steps passed without a tracked drafted step."""
        return bool(self._off and self._off.get("vetoed")) and self._since_tracked_draft >= self.recheck_every

    def _threshold(self, plain: float, n: int, margin: float) -> float:
        """The predicted throughput a drafted plan must beat: plain decoding's, corrected by what
        past steps of each kind delivered, plus a margin (see _margin)."""
        return plain * self.correction(0, n) * (1.0 + margin) / self.correction(1, n)

    def _margin(self, costs, d_fwd: float, d_tok: float, t_ar: float, n: int) -> float:
        """The predicted gain a drafted plan needs: min_gain covers what the fits get wrong about
        drafting (a draft model's forwards, its catch-ups, its cache pressure on the target).
        A drafter whose measured cost is negligible (n-gram: microseconds of host work, K
        tokens for each of n requests under 1% of a plain step) leaves only the verify side
        to misjudge, measured at every step, plain or drafted: min_gain_free. (With 10% the
        n-gram drafter skipped steps that fixed K=4 turned into a 1.2x speedup at batch 4.)"""
        if costs.has_draft_fit and d_fwd + d_tok * self.spec.max_draft_length * n < 0.01 * t_ar:
            return self.min_gain_free
        return self.min_gain

    def _still_off(self, requests, caps, lag, costs, off):
        """K=0 for everyone without a full plan, if the last off verdict provably still holds for
        this batch; None if a full plan is needed.

        A plan at depth d drafts only if sum_b surplus_b(d) > lam * (t_plain + fixed(d)) - n, with
        lam the threshold throughput, surplus_b(d) = max over k <= min(d, cap_b) of (gain_b,k -
        lam * cost_b,k)+ and fixed(d) the step's drafting costs (d draft forwards, the drafted-step
        jump). A request seen before keeps its recorded surplus, raised by (lam_then - lam) times
        its cost where lam fell since (contexts grow, requests leave): an upper bound, since its
        gains cannot have grown while it did not draft (no acceptance evidence; its lag, context
        and cost only grew; fewer steps left to amortise a catch-up). Only a newcomer, or a
        request whose cap grew (an n-gram match appeared), is priced afresh, by the same formulas
        as the full plan (``_tables``). Requests that left take their surplus with them."""
        n = len(requests)
        D = off["depths"]          # max_draft_length + 1: every cap fits
        per_verify, d_fwd, d_fwd1, d_tok, d_ctx = off["coefs"]
        ctx = float(sum(r.context_len for r in requests))
        t_ar = costs.verify_time(n, ctx, drafted=False, requests=n)
        plain = n / t_ar
        lam = self._threshold(plain, n, off["margin"])
        total = [0.0] * D
        rows, old = {}, off["rows"]
        prior = None
        for b, r in enumerate(requests):
            key = (r.request_id, id(r), r.drafter_state.get("match_n"))
            row = old.get(key)
            if row is None or caps[b] > row[0]:
                if caps[b] == 0:
                    row = (0, lam, [0.0] * D, [0.0] * D)
                else:
                    prior = self._prior() if prior is None else prior
                    row = self._row(r, caps[b], lag[b], lam, D, prior, per_verify + d_tok + d_ctx * r.context_len,
                                    d_tok)
            rows[key] = row
            _, lam_row, surplus, reach = row
            drop = max(lam_row - lam, 0.0)
            for d in range(D):
                total[d] += surplus[d] + drop * reach[d]
        for d in range(1, D):
            if total[d] > lam * (t_ar + d_fwd * d + d_fwd1) - n:
                return None
        off["rows"] = rows
        off["age"] += 1
        off["same"] = (*self._identity(requests), tuple(caps))
        off["plain"], off["t_ar"] = plain, t_ar
        return self._off_step(requests, caps, lag, costs, off, plain, t_ar)

    def _off_step(self, requests, caps, lag, costs, off, plain, t_ar):
        n = len(requests)
        out = [0] * n
        self._explore(requests, out, caps, lag, plain, off["prices"], costs.has_draft_fit)
        if any(out):
            # what an explored request shows (its acceptance) is new evidence: price it afresh
            off["same"] = None
            for r, k in zip(requests, out):
                if k:
                    off["rows"].pop((r.request_id, id(r), r.drafter_state.get("match_n")), None)
        prefill = any(r.context_len - r.target_cached > 1 for r in requests)
        measured = costs._verify_coef is not None
        self._tracked = None if any(out) or prefill or not measured else (0, n, t_ar, n)
        return out

    def _row_tables(self, r, cap: int, lag: int, prior: float, per_token: float, d_tok: float):
        """One request's gains[k] and cost[k], k = 0..cap: the numpy ``_tables`` for one row, in
        plain Python (microseconds for the few values of a newcomer or a small batch)."""
        rate = self._rate(r, prior)
        prof = self.depth_profile()
        fill = r.policy_state.get("fill", self._fill)
        left = float(max(r.params.max_tokens - r.num_generated, 1))
        gains, costs = [0.0], [0.0]
        total, power = 0.0, 1.0
        for k in range(1, cap + 1):
            power *= min(rate * float(prof[k]), 0.99)
            total += power
            gain = total * fill
            gains.append(gain)
            costs.append(k * per_token * fill + d_tok * lag / max(left / (1.0 + gain), 1.0))
        return gains, costs

    def _row(self, r, cap: int, lag: int, lam: float, depths: int, prior: float, per_token: float, d_tok: float):
        """One request's (cap, lam, surplus[d], cost[d]) for d < depths (see _still_off)."""
        return self._surplus_row(cap, lam, depths, *self._row_tables(r, cap, lag, prior, per_token, d_tok))

    @staticmethod
    def _surplus_row(cap: int, lam: float, depths: int, gains: list, costs: list):
        surplus, reach = [0.0], [0.0]
        best = worst = 0.0
        for k in range(1, depths):
            if k <= cap:
                best = max(best, gains[k] - lam * costs[k])
                worst = max(worst, costs[k])
            surplus.append(best)
            reach.append(worst)
        return cap, lam, surplus, reach

    def step_done(self, emitted: int, seconds: float) -> None:
        """Track what planned steps delivered against their prediction, per kind (plain,
        drafted): decayed sums of realized and predicted tokens and seconds, so a ratio of
        throughputs (single drafted steps are spiky: all rejected, or all accepted). Exploration,
        forced plain and prefill steps are not tracked. The other kind's evidence fades, so a
        pessimism formed under other conditions does not last forever."""
        tracked, self._tracked = self._tracked, None
        if tracked is None or seconds <= 0:
            return
        kind, tokens, secs, n = tracked
        if kind:
            self._since_tracked_draft = 0
        both = self._track.setdefault(self._bucket(n), [[0.0] * 5, [0.0] * 5])
        t = both[kind]
        for i, x in enumerate((emitted, seconds, tokens, secs, 1.0)):
            t[i] = self.track_decay * t[i] + x
        both[1 - kind] = [x * self.track_forget for x in both[1 - kind]]

    @staticmethod
    def _bucket(n: int) -> int:
        return min(int(n).bit_length(), 6)      # batch 1, 2-3, 4-7, 8-15, 16-31, 32+

    def correction(self, kind: int, n: int = 1) -> float:
        """Realized / predicted throughput of past planned steps of this kind at batch sizes like
        n (what the linear costs miss differs with batch size), shrunk towards 1 by the weight of
        the evidence (1 with none)."""
        both = self._track.get(self._bucket(n))
        if both is None:
            return 1.0
        r_tok, r_sec, p_tok, p_sec, w = both[kind]
        if w <= 0 or r_sec <= 0 or p_tok <= 0:
            return 1.0
        ratio = min(max((r_tok / r_sec) / (p_tok / p_sec), 0.25), 4.0)
        return ratio ** (w / (w + self.track_prior))

    @staticmethod
    def _tables(rates, ks, per_token, fixed_total, left, fill=None):
        """gains[b, k] = fill_b * sum_{i<=k} prod_{j<=i} r_b,j (rates [B] for r_b,j = r_b, or
        [B, K+1] per position, column 0 unused); cost[b, k] = fill_b * k * per_token[b] + (k > 0) *
        the catch-up fixed_total[b] spread over the request's remaining steps at that k. fill_b: the
        fraction of asked tokens the drafter proposes (what is not proposed is neither verified
        nor accepted)."""
        fill = np.ones(len(rates)) if fill is None else fill
        if rates.ndim == 1:                                         # the same rate at every position
            powers = rates[:, None] ** ks[None, :]                  # r^0 .. r^K
        else:                                                       # rates[b, i]: position i given 1..i-1
            powers = np.cumprod(np.where(ks[None, :] > 0, rates[:, :len(ks)], 1.0), 1)
        gains = (np.cumsum(powers, 1) - 1.0) * fill[:, None]        # fill * sum_{i=1..k} P(1..i accepted)
        steps_left = np.maximum(left[:, None] / (1.0 + gains), 1.0)
        cost = (ks[None, :] * (per_token * fill)[:, None]
                + np.where(ks[None, :] > 0, fixed_total[:, None] / steps_left, 0.0))
        return gains, cost

    @staticmethod
    def _count_idle(requests) -> None:
        for r in requests:
            r.policy_state["steps_without_draft"] = r.policy_state.get("steps_without_draft", 0) + 1

    def _explore(self, requests, ks, caps, lag, lam, prices, fitted) -> None:
        per_verify, d_fwd, d_tok, d_ctx = prices
        someone_drafts = any(ks)
        prior = None
        n = len(requests)
        self._since_drafted = 0 if someone_drafts else self._since_drafted + 1
        if someone_drafts:
            self._fruitless_looks = 0
        # looks that cost a catch-up back off while they keep finding nothing: x2 the interval
        # per two looks that did not turn drafting on, up to x16 (explore_every 16 -> 256 steps)
        backoff = 1 << min(self._fruitless_looks // 2, 4)
        # the price check can be wrong (costs fitted on noise): with nothing drafted for
        # explore_max steps, a request whose draft needs no catch-up looks anyway
        overdue = self._since_drafted >= self.explore_max
        for b, r in enumerate(requests):
            idle = r.policy_state.get("steps_without_draft", 0)
            left = max(r.params.max_tokens - r.num_generated, 1)
            # (what a look finds serves later requests too: the pooled rate, fill and corrections)
            if ks[b] == 0 and caps[b] > 0 and idle >= self.explore_every * (backoff if lag[b] > 0 else 1):
                # would one token pay at the current throughput if this request's drafts were
                # accepted more often than measured? (always, while draft costs are unmeasured)
                prior = self._prior() if prior is None else prior
                # optimism shrinks as pooled evidence grows when a look costs a catch-up (the
                # draft consumes the whole context first): with hundreds of outcomes known,
                # a hopeful +0.25 is no longer worth a prefill of the draft per request
                opt = self.optimism
                if lag[b] > 0 and len(self._pooled) > 32:
                    opt *= (32 / len(self._pooled)) ** 0.5
                r_opt = min(self._rate(r, prior) + opt, 0.97)
                steps_left = max(left / (1.0 + r_opt), 1.0)
                price = (per_verify + d_tok + d_ctx * r.context_len + d_tok * lag[b] / steps_left
                         + (0.0 if someone_drafts else d_fwd))
                if (not fitted or r_opt * self.correction(1, n) >= lam * price * self.correction(0, n)
                        or (overdue and lag[b] == 0)):
                    ks[b] = 1
                    overdue = False
                    self._since_drafted = 0
                    self._fruitless_looks += lag[b] > 0
                idle = -1          # explored, or not worth it: look again in explore_every steps
            r.policy_state["steps_without_draft"] = 0 if ks[b] > 0 else idle + 1


POLICY_CLASSES = {"fixed": FixedPolicy, "confidence": ConfidencePolicy, "head": HeadPolicy, "budget": BudgetPolicy}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICY_CLASSES[spec.policy](spec)
