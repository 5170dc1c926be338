"""The budget policy: across the batch, hand out draft tokens where the expected gain per unit
of measured cost is highest (maximise expected emitted tokens / predicted step time).

The pure part (prices, tables, the search) is specrt.policy.planner; this module holds what
the policy learns and remembers between steps:

- acceptance evidence (specrt.policy.acceptance) and the corrections of its predictions by
  what past planned steps of each kind delivered at similar batch sizes (a model that is
  optimistic about drafting is overruled by the measured outcome);
- the decision rule: the best allocation drafts only if it beats plain decoding by a margin
  (the fitted costs are noisy: a thin predicted gain is as likely a loss);
- the off verdict: when drafting does not pay (large batches where a verify is no longer almost
  free, a draft that costs too much of a target step, short requests with long prompts), K=0
  for everyone, and while it provably still holds planning is a lookup (``OffVerdict``), or is
  skipped altogether for a while (``dormant``);
- measuring: a short run of plain steps now and then keeps the plain cost measured; a request
  kept at K=0 produces no acceptance evidence, so every ``explore_every`` idle steps it drafts
  one token if an optimistic acceptance would pay for it and its catch-up.

Tuning constants: specrt.policy.tuning; why they are what they are: docs/policy.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from specrt.config import SpecConfig, clamp_k
from specrt.policy import planner
from specrt.policy.acceptance import AcceptanceEvidence, Corrections
from specrt.policy.base import DraftPolicy
from specrt.policy.cost_model import CostModel
from specrt.policy.planner import Prices, Row, SurplusRow
from specrt.policy.tuning import BudgetTuning


class Tracked(NamedTuple):
    """What this step's plan predicted (checked against the outcome by ``step_done``)."""

    kind: int               # 0 plain, 1 drafted
    tokens: float           # predicted emitted tokens
    seconds: float          # predicted step time
    num_requests: int


@dataclass
class OffVerdict:
    """The last full plan switched speculation off; what re-checking it needs (see _still_off)."""

    costs: CostModel        # the cost model it was priced with
    fit_version: int        # ... at this fit (a refit that moved predictions invalidates it)
    prices: Prices          # the prices of the plan that decided it
    margin: float           # the predicted gain drafting needed
    vetoed: bool            # held only by the measured corrections (re-checked every recheck_every)
    depths: int             # max_draft_length + 1: every max_k fits
    rows: dict[tuple, SurplusRow] = field(default_factory=dict)   # request key -> its verdict
    age: int = 1            # steps decided by it
    same: tuple | None = None     # (batch identity, max_ks) of the last step it decided
    plain: float = 0.0      # that step's plain throughput ...
    t_plain: float = 0.0    # ... and plain step time


class BudgetPolicy(DraftPolicy):
    name = "budget"

    def __init__(self, spec: SpecConfig, tune: BudgetTuning | None = None):
        super().__init__(spec)
        self.tune = tune or BudgetTuning()
        self.evidence = AcceptanceEvidence(spec.max_draft_length, self.tune)
        self.corrections = Corrections(self.tune)
        self.tracked: Tracked | None = None     # this step's prediction, None if not tracked
        self.last_prediction: tuple[float, float] | None = None   # (best drafted, plain) throughput of the last full plan
        self._off: OffVerdict | None = None
        self._plain_left = 0                # forced plain steps still to run
        self._since_drafted = 0             # steps since anything was drafted (see _explore)
        self._fruitless_looks = 0           # looks with a catch-up since a plan last drafted
        self._since_tracked_draft = 0       # steps since a tracked drafted step (see recheck_every)
        self._off_streak = 0                # checked steps in a row that kept speculation off
        self._sleep = 0                     # steps left that skip planning (see dormant)
        self._sleep_n = 0                   # the batch size when they were granted
        self._slept = 0                     # steps skipped since the last plan
        self._clock = 0                     # steps planned or slept

    # ------------------------------------------------------------------ evidence
    def observe(self, request, drafted: int, accepted: int) -> None:
        super().observe(request, drafted, accepted)
        self.evidence.observe(request, drafted, accepted)

    def depth_profile(self):
        return self.evidence.depth_profile()

    def correction(self, kind: int, n: int = 1) -> float:
        return self.corrections.factor(kind, n)

    def step_done(self, emitted: int, seconds: float) -> None:
        """Check the tracked prediction against the step's outcome. Exploration, forced plain
        and prefill steps are not tracked."""
        tracked, self.tracked = self.tracked, None
        if tracked is None or seconds <= 0:
            return
        if tracked.kind:
            self._since_tracked_draft = 0
        self.corrections.record(tracked.kind, tracked.tokens, tracked.seconds, tracked.num_requests, emitted, seconds)

    def price_request(self, r, max_k: int, lag: int, prior: float, per_token: float, d_tok: float) -> Row:
        """The planner's row for one request (its acceptance from the evidence)."""
        rate = self.evidence.rate(r, prior, self.spec.acceptance_window)
        left = float(max(r.params.max_tokens - r.num_generated, 1))
        return planner.price_row(rate, self.evidence.depth_profile(), max_k, self.evidence.fill_of(r), left, lag,
                                 per_token, d_tok, self.tune.max_position_rate)

    def k_ahead(self, request, k: int, drafted: int, max_k: int) -> int:
        """The K planned this step (plans rarely change from one step to the next; a smaller K
        next step uses the first of the tokens drafted ahead, a larger one drops them)."""
        return clamp_k(k, max_k)

    # ------------------------------------------------------------------ planning
    def dormant(self, num_requests: int) -> bool:
        """Whether this step may skip planning: K=0 for everyone without looking. An off verdict
        that held at s checked steps in a row lets the next min(s // 2, dormant_max) steps skip
        planning. A batch down by a quarter (a verify is cheaper per token) wakes it at once; a
        newcomer that would pay waits for the next check. Slept steps still count for
        exploration, the overdue look and the verdict's age. Only for drafters whose max_ks do not
        come and go (not n-gram: a match appearing is the news)."""
        if self._sleep <= 0:
            return False
        if num_requests < self._sleep_n and 4 * (self._sleep_n - num_requests) >= self._sleep_n:
            self._sleep = 0
            return False
        self._clock += 1
        self._sleep -= 1
        self._slept += 1
        self.tracked = None
        return True

    def plan(self, requests, max_ks, costs=None, catchup=None):
        slept, self._slept, self._sleep = self._slept, 0, 0
        self._since_tracked_draft += 1 + slept
        if slept:
            self._since_drafted += slept
            if self._off is not None:
                self._off.age += slept
            for r in requests:      # (a newcomer was not there for all of them)
                st = r.policy_state
                st.steps_without_draft += min(slept, self._clock - (self._clock if st.seen is None else st.seen))
        self._clock += 1
        for r in requests:
            if r.policy_state.seen is None:
                r.policy_state.seen = self._clock
        out = self._plan_step(requests, max_ks, costs or CostModel(), catchup)
        if self._off is not None:        # the verdict was off (a look may have been added)
            self._off_streak += 1
            # a look's outcome is news: the step after it plans
            self._sleep = 0 if any(out) else min(self._off_streak // 2, self.tune.dormant_max)
            self._sleep_n = len(requests)
        else:
            self._off_streak = 0
        return out

    def _verdict_valid(self, costs: CostModel) -> bool:
        off = self._off
        return (off is not None and off.costs is costs and off.fit_version == costs.fit_version
                and off.age < self.tune.replan_every and not self._recheck_due())

    def _plan_step(self, requests, max_ks, costs: CostModel, catchup):
        costs.refit()
        n = len(requests)
        if n == 0:
            return []
        off = self._off
        if not self._plain_left and costs.steps_since_plain == 0 and self._verdict_valid(costs):
            prev = off.same
            if prev is not None and self._identity(requests) == prev[0] and all(c <= p for c, p in zip(max_ks, prev[1])):
                # the very batch of the last off step, no max_k grew (max_ks shrink as requests near
                # their end, which only makes drafting dearer): only contexts grew, a few tokens
                # each, priced again at the next full plan (replan_every steps at most)
                off.age += 1
                return self._off_step(requests, max_ks, catchup or [0] * n, costs, off, off.plain, off.t_plain)
        lag = list(catchup) if catchup is not None else [0] * n
        max_ks = [clamp_k(self.spec.max_draft_length, m) for m in max_ks]
        if self.spec.min_draft_length == 0:
            # keep the cost of steady plain decoding measured: a run of plain steps, soon at first
            # (after plain_first, 2x, 4x ... steps without a plain sample), then every plain_every
            if costs.steps_since_plain >= min(self.tune.plain_every, self.tune.plain_first << costs.num_plain):
                self._plain_left = self.tune.plain_run
            if self._plain_left > 0:
                self._plain_left -= 1
                for r in requests:
                    r.policy_state.steps_without_draft += 1
                self.tracked = None
                return [0] * n
        # speculation off stays off while the verdict provably holds (see _still_off)
        if self._verdict_valid(costs):
            out = self._still_off(requests, max_ks, lag, costs, self._off)
            if out is not None:
                return out
        self._off = None
        return self._full_plan(requests, max_ks, lag, costs)

    def _full_plan(self, requests, max_ks, lag, costs: CostModel):
        n, spec, tune = len(requests), self.spec, self.tune
        floor = [clamp_k(spec.min_draft_length, m) for m in max_ks]
        prior = self.evidence.prior()
        prices = Prices.of(costs, n, float(sum(r.context_len for r in requests)))
        margin = self._margin(costs, prices, n)
        rows = [self.price_request(r, max_ks[b], lag[b], prior, prices.per_token(r.context_len), prices.d_tok)
                for b, r in enumerate(requests)]
        alloc = planner.search(rows, max_ks, floor, prices, tune.search_rounds)
        best, best_ks, plain = alloc.rate, alloc.ks, alloc.plain
        # vetoed: the costs predict the margin's gain, only what past drafted steps delivered says
        # no. Such a verdict would outlast its cause (a vetoed policy takes no drafted steps to
        # revise it), so every recheck_every steps one such plan runs and is tracked; never one
        # that needs a catch-up (a look at a lagging draft costs its whole context)
        vetoed = (best >= plain * (1.0 + margin) and any(best_ks)
                  and not any(lag[b] for b in range(n) if best_ks[b]))
        recheck = vetoed and self._since_tracked_draft >= tune.recheck_every
        self.last_prediction = (best, plain)
        if best < self._threshold(plain, n, margin) and not recheck:
            best, best_ks = plain, floor      # not worth the estimation error: stay plain
        out = [int(k) for k in best_ks]
        for r, k in zip(requests, out):
            r.policy_state.asked = k
        drafts = any(out)
        # a step that (re)computes a context (prefill, after preemption) is not what was priced;
        # before the verify fit the prediction is in made-up units
        if costs.has_verify_fit and not self._prefill(requests):
            self.tracked = Tracked(int(drafts), *planner.step_prediction(rows, out, prices), n)
        else:
            self.tracked = None
        if not drafts and spec.min_draft_length == 0:
            lam = self._threshold(plain, n, margin)
            depths = spec.max_draft_length + 1
            self._off = OffVerdict(costs, costs.fit_version, prices, margin, vetoed, depths,
                                   {self._key(r): planner.surplus_row(row, max_k, lam, depths)
                                    for r, row, max_k in zip(requests, rows, max_ks)})
        self._explore(requests, out, max_ks, lag, best, prices, costs.has_draft_fit)
        if any(out) != drafts:
            self.tracked = None              # an exploration step: not what was predicted
        return out

    def _recheck_due(self) -> bool:
        """An off verdict that only the measured corrections held is planned in full once
        recheck_every steps passed without a tracked drafted step."""
        return bool(self._off and self._off.vetoed) and self._since_tracked_draft >= self.tune.recheck_every

    def _threshold(self, plain: float, n: int, margin: float) -> float:
        """The predicted throughput a drafted plan must beat: plain decoding's, corrected by what
        past steps of each kind delivered, plus the margin."""
        return plain * self.correction(0, n) * (1.0 + margin) / self.correction(1, n)

    def _margin(self, costs: CostModel, prices: Prices, n: int) -> float:
        """min_gain covers what the fits get wrong about drafting (a draft model's forwards, its
        catch-ups, its cache pressure on the target); a drafter whose measured cost is negligible
        leaves only the verify side to misjudge: min_gain_free."""
        drafting = prices.d_fwd + prices.d_tok * self.spec.max_draft_length * n
        if costs.has_draft_fit and drafting < self.tune.free_draft_share * prices.t_plain:
            return self.tune.min_gain_free
        return self.tune.min_gain

    @staticmethod
    def _prefill(requests) -> bool:
        return any(r.context_len - r.target_cached > 1 for r in requests)

    @staticmethod
    def _key(r) -> tuple:
        return r.request_id, id(r), r.evidence_class

    @staticmethod
    def _identity(requests) -> tuple:
        """The batch as the off fast paths compare it: which requests, and each one's evidence
        class (a class that changed changes its expected acceptance: priced afresh)."""
        return (tuple(r.request_id for r in requests), tuple(map(id, requests)),
                tuple(r.evidence_class for r in requests))

    # ------------------------------------------------------------------ speculation off
    def _still_off(self, requests, max_ks, lag, costs: CostModel, off: OffVerdict):
        """K=0 for everyone without a full plan, if the last off verdict provably still holds for
        this batch; None if a full plan is needed.

        A plan at depth d drafts only if sum_b surplus_b(d) > lam * (t_plain + fixed(d)) - n, with
        lam the threshold throughput, surplus_b(d) = max over k <= min(d, cap_b) of (gain_b,k -
        lam * cost_b,k)+ and fixed(d) the step's drafting costs (d draft forwards, the drafted-step
        jump). A request seen before keeps its recorded surplus, raised by (lam_then - lam) times
        its cost where lam fell since (contexts grow, requests leave): an upper bound, since its
        gains cannot have grown while it did not draft. Only a newcomer, or a request whose max_k
        grew (an n-gram match appeared), is priced afresh, by the full plan's formulas."""
        n, D, p = len(requests), off.depths, off.prices
        t_ar = costs.verify_time(n, float(sum(r.context_len for r in requests)), drafted=False, requests=n)
        plain = n / t_ar
        lam = self._threshold(plain, n, off.margin)
        total = [0.0] * D
        rows: dict = {}
        prior = None
        for b, r in enumerate(requests):
            key = self._key(r)
            row = off.rows.get(key)
            if row is None or max_ks[b] > row.max_k:
                if max_ks[b] == 0:
                    row = planner.zero_row(lam, D)
                else:
                    prior = self.evidence.prior() if prior is None else prior
                    row = planner.surplus_row(self.price_request(r, max_ks[b], lag[b], prior, p.per_token(r.context_len),
                                                                 p.d_tok), max_ks[b], lam, D)
            rows[key] = row
            drop = max(row.lam - lam, 0.0)
            for d in range(D):
                total[d] += row.surplus[d] + drop * row.reach[d]
        for d in range(1, D):
            if total[d] > lam * (t_ar + p.d_fwd * d + p.d_jump) - n:
                return None
        off.rows = rows
        off.age += 1
        off.same = (self._identity(requests), tuple(max_ks))
        off.plain, off.t_plain = plain, t_ar
        return self._off_step(requests, max_ks, lag, costs, off, plain, t_ar)

    def _off_step(self, requests, max_ks, lag, costs: CostModel, off: OffVerdict, plain: float, t_ar: float):
        n = len(requests)
        out = [0] * n
        self._explore(requests, out, max_ks, lag, plain, off.prices, costs.has_draft_fit)
        if any(out):
            # what an explored request shows (its acceptance) is new evidence: price it afresh
            off.same = None
            for r, k in zip(requests, out):
                if k:
                    off.rows.pop(self._key(r), None)
        tracked = not any(out) and not self._prefill(requests) and costs.has_verify_fit
        self.tracked = Tracked(0, n, t_ar, n) if tracked else None
        return out

    def _explore(self, requests, ks, max_ks, lag, lam: float, prices: Prices, fitted: bool) -> None:
        """Look at idle requests: one draft token for a request kept at K=0 for explore_every
        steps, if an optimistic acceptance would pay for that token (and its catch-up)."""
        tune = self.tune
        someone_drafts = any(ks)
        prior = None
        n = len(requests)
        self._since_drafted = 0 if someone_drafts else self._since_drafted + 1
        if someone_drafts:
            self._fruitless_looks = 0
        # looks that cost a catch-up back off while they keep finding nothing: x2 the interval
        # per two fruitless looks, up to x2**explore_backoff_max
        backoff = 1 << min(self._fruitless_looks // 2, tune.explore_backoff_max)
        # the price check can be wrong (costs fitted on noise): with nothing drafted for
        # explore_max steps, a request whose draft needs no catch-up looks anyway
        overdue = self._since_drafted >= tune.explore_max
        d_fwd = prices.d_fwd + prices.d_jump
        pooled = len(self.evidence.pooled)
        for b, r in enumerate(requests):
            idle = r.policy_state.steps_without_draft
            left = max(r.params.max_tokens - r.num_generated, 1)
            if ks[b] == 0 and max_ks[b] > 0 and idle >= tune.explore_every * (backoff if lag[b] > 0 else 1):
                prior = self.evidence.prior() if prior is None else prior
                # optimism shrinks as pooled evidence grows when a look costs a catch-up
                opt = tune.optimism
                if lag[b] > 0 and pooled > tune.optimism_pool:
                    opt *= (tune.optimism_pool / pooled) ** 0.5
                r_opt = min(self.evidence.rate(r, prior, self.spec.acceptance_window) + opt, tune.optimism_cap)
                steps_left = max(left / (1.0 + r_opt), 1.0)
                price = (prices.per_token(r.context_len) + prices.d_tok * lag[b] / steps_left
                         + (0.0 if someone_drafts else d_fwd))
                if (not fitted or r_opt * self.correction(1, n) >= lam * price * self.correction(0, n)
                        or (overdue and lag[b] == 0)):
                    ks[b] = 1
                    overdue = False
                    self._since_drafted = 0
                    self._fruitless_looks += lag[b] > 0
                idle = -1          # explored, or not worth it: look again in explore_every steps
            r.policy_state.steps_without_draft = 0 if ks[b] > 0 else idle + 1
