"""Token trees: how many nodes each step verifies, and whether drafting pays at all.

Size (EAGLE-2's budget, from measured costs). A node's chance of acceptance is taken as the
product of the draft's probabilities on its path times a calibration factor, the ratio of
accepted to predicted nodes over recent tree steps. Each verify row has a price: the measured
verify time as a function of the rows a step feeds (``VerifyCurve``, an average per row count,
interpolated between counts), so the n-th extra row costs what the curve says it adds, not an
average slope: on a CPU the first few rows are nearly free and later ones are not. A request's
(n+1)-th node is priced at the average row of the block every request's (n+1)-th node adds; one
block past the largest count ever verified follows the last slope, later ones are not bought
until a step has verified them (trees grow a node per request at a time into the unknown). A
request keeps the N best nodes that maximise (1 + expected accepted) / (1 + cost of N rows), costs
relative to the step's time per request. A tree grows a level deeper only for requests whose
best newest node's calibrated probability repays a draft level and a verify row.

On/off, kept per load (``load_bucket``: 1, 2, 3-4, 5-8, ... requests in the step, since drafting
may pay for one request and not for eight). Drafting must beat plain decoding: a load never run
plain runs one plain step first (the baseline), then every tree step's speed is compared with the
cost model's autoregressive step time for the same batch (or, before it has one, the verify
curve's time of a step of as many rows as requests; a running average of the ratios). Below
``OFF_BELOW`` drafting stops for ``OFF_STEPS`` steps, then drafts for ``TRIAL_STEPS`` steps and
stays on only if they averaged above ``ON_ABOVE`` (a trial of several steps, since its first step
pays the draft's catch-up over everything decoded while it was off; one whose later steps are
clearly slower than plain ones, by their mean and its standard error, ends after ``TRIAL_CHECK``
of them: a batch's steps are steady, one request's swing with each step's acceptance). Each
failed trial doubles the off period (up to ``MAX_OFF_STEPS``); one that pays resets it: where
drafting never pays (a large batch on one core) the trials' cost falls to a few percent.
A trial's first step pays the draft's catch-up over every token its requests decoded (and, for
new requests, their prompts) while it was off: at a large batch that is several plain steps. A
trial, and the first drafted step at a load, therefore begins only when the catch-up's predicted
time is at most ``TRIAL_SHARE`` of the plain time spent at that load since the last trial, or of
the plain time the batch's remaining tokens will take: it never costs more than that share.
Every ``PROBE_EVERY`` steps ``PROBE_STEPS`` plain steps keep the autoregressive time measured on
this machine as it is now.
A step whose first node cannot repay its verify row and a draft level (their costs against the
drafts accepted per request per tree step so far) is plain without asking the draft at all: a
large batch on a compute-bound device, where each extra row costs nearly a request's whole share.
After an off period of such steps in a row a trial drafts again and measures that gain anew.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE_EVERY = 64          # steps between plain probes
PROBE_STEPS = 2           # a steady plain sample needs a plain step before it
OFF_STEPS = 48            # plain steps before a trial while drafting is off ...
MAX_OFF_STEPS = 768       # ... doubling after each failed trial up to this
TRIAL_STEPS = 16          # tree steps a trial averages ...
TRIAL_CHECK = 5           # ... unless the steps after its first (the catch-up) are this many
TRIAL_GIVE_UP = 1.0       # ... and average, plus two standard errors, below this: it ends there as failed
TRIAL_SHARE = 0.02        # a trial's catch-up costs at most this share of the plain time waited or ahead
FIRST_SHARE = 0.05        # the first drafted step's at a load: at most this share of the plain time ahead
OFF_BELOW = 0.97          # running speedup under which drafting switches off ...
ON_ABOVE = 1.02           # ... and the trial average (plus a standard error) over which it switches back on
AVERAGE = 0.1             # weight of the newest step in the calibration and verify-curve averages
SPEED_AVERAGE = 0.03      # ... in the speedup's (one step's ratio swings with its acceptance: slower)
PRIOR_ROW_COST = 0.05     # one verify row / one step, before anything was measured
MAX_ROWS = 512            # row counts the verify curve keeps


@dataclass
class TreeStep:
    """What the planner decided for one step."""

    draft: bool                # grow trees this step (else a plain step)
    row_costs: list[float]     # [n] cost of the n+1-th extra row over the step's time per request
    level_cost: float          # one more draft level's time over the step's
    calibration: float         # accepted nodes per predicted node

    @property
    def row_cost(self) -> float:
        """The first extra row's cost (the whole price of a one-node tree)."""
        return self.row_costs[0] if self.row_costs else PRIOR_ROW_COST


@dataclass
class VerifyCurve:
    """Seconds of a step besides drafting, by the rows it fed (decode and tree steps, no prefill)."""

    seconds: dict[int, float] = field(default_factory=dict)   # rows -> running average

    def add(self, rows: int, seconds: float) -> None:
        if 1 <= rows <= MAX_ROWS:
            old = self.seconds.get(rows)
            self.seconds[rows] = seconds if old is None else old + AVERAGE * (seconds - old)

    def at(self, rows: int) -> float | None:
        """The time of ``rows`` rows: measured, linear between the nearest measured counts, or along
        the last measured slope past them (flat before the first); None until two counts are known."""
        known = sorted(self.seconds)
        if len(known) < 2:
            return None
        if rows in self.seconds:
            return self.seconds[rows]
        lo = max((k for k in known if k < rows), default=None)
        hi = min((k for k in known if k > rows), default=None)
        if lo is None:
            return self.seconds[hi]
        if hi is None:
            a, b = known[-2], known[-1]
            slope = max((self.seconds[b] - self.seconds[a]) / (b - a), 0.0)
            return self.seconds[b] + slope * (rows - b)
        w = (rows - lo) / (hi - lo)
        return self.seconds[lo] + w * (self.seconds[hi] - self.seconds[lo])


def _mean_se(xs: list[float]) -> tuple[float, float]:
    """The mean of a trial's step ratios and its standard error (0 below two steps): one request's
    step ratio swings between ~0.65 (nothing accepted) and ~2 (two accepted), a batch's barely."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def load_bucket(batch_size: int) -> int:
    """The load a step's on/off decision is kept for: 1, 2, 3-4, 5-8, 9-16, ... requests."""
    return (max(1, batch_size) - 1).bit_length() + 1


@dataclass
class LoadSwitch:
    """Whether drafting pays at one load (a bucket of batch sizes): drafting may pay for one request
    and not for eight on the same machine, and the load moves faster than a running average."""

    speedup: float = 1.0              # running average of tree steps' speed over plain steps'
    on: bool = True
    off_left: int = 0                 # plain steps left before the next trial
    off_steps: int = OFF_STEPS        # the off period (doubles while trials fail)
    trial: list[float] | None = None  # a trial's step ratios so far (None: no trial)
    blocked: int = 0                  # steps in a row the first-node rule kept plain
    waited_s: float = 0.0             # plain step time at this load since the last trial began
    drafted: int = 0                  # drafted steps observed at this load


class TreePlanner:
    """Per engine; the engine calls ``plan`` before drafting and ``observe`` after the commit."""

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive          # False: every step drafts (tree="fixed")
        self.calibration = 1.0
        self.gain = 1.0                   # running average of drafts accepted per request per tree step
        self.curve = VerifyCurve()
        self.switches: dict[int, LoadSwitch] = {}   # load_bucket -> its on/off state
        self._load = 1                    # the bucket of the step planned last
        self._since_probe = 0
        self._probe_left = 0

    def switch(self, batch_size: int | None = None) -> LoadSwitch:
        """The on/off state at ``batch_size``'s load (None: the last planned step's)."""
        key = self._load if batch_size is None else load_bucket(batch_size)
        return self.switches.setdefault(key, LoadSwitch())

    @property
    def on(self) -> bool:
        """Whether drafting is on at the last planned step's load."""
        return self.switch().on

    @property
    def speedup(self) -> float:
        """The running speedup of tree steps at the last planned step's load."""
        return self.switch().speedup

    def plan(self, costs, batch_size: int, tokens: int, context: int, depth: int, max_nodes: int,
             catchup_s: float = 0.0, ahead_s: float = 0.0) -> TreeStep:
        """``tokens`` / ``context``: what a plain step over the batch would feed and attend;
        ``catchup_s``: the predicted time of the draft's catch-up a drafted step would pay first;
        ``ahead_s``: the predicted plain time of the batch's remaining tokens."""
        self._load = load_bucket(batch_size)
        sw = self.switch()
        rows, level = self._costs(costs, batch_size, tokens, context, depth, max_nodes)
        may_try = catchup_s <= TRIAL_SHARE * max(sw.waited_s, ahead_s)
        may_start = may_try or catchup_s <= FIRST_SHARE * ahead_s
        draft = self._draft_now(costs, sw, may_try)
        if draft and self.adaptive and costs is not None and batch_size not in self.curve.seconds:
            draft = False  # a load never run plain: measure its plain step first (the baseline drafting must beat)
        if draft and self.adaptive and sw.trial is None and rows and rows[0] + level >= self.gain:
            # not even the first node repays its row and a draft level (a large batch on a compute-bound
            # device): no draft forward at all. The gain is measured on drafted steps only, so after
            # an off period of such steps a trial drafts again (else one bad stretch would stop drafting for good)
            sw.blocked += 1
            if sw.blocked < sw.off_steps or not may_try:
                draft = False
            else:
                sw.blocked, sw.trial, sw.waited_s = 0, [], 0.0
        elif draft and self.adaptive and sw.drafted == 0 and sw.trial is None and not may_start:
            draft = False  # the first drafted step at a load is a trial too: its catch-up must be affordable
        elif draft:
            sw.blocked = 0
        return TreeStep(draft, rows, level, self.calibration)

    def _draft_now(self, costs, sw: LoadSwitch, may_try: bool = True) -> bool:
        if not self.adaptive:
            return True
        self._since_probe += 1
        if self._probe_left > 0 or (self._since_probe >= PROBE_EVERY and costs is not None and sw.on):
            if self._probe_left == 0:
                self._probe_left = PROBE_STEPS
            self._probe_left -= 1
            self._since_probe = 0
            return False
        if sw.on or sw.trial is not None:
            return True
        sw.off_left -= 1
        if sw.off_left <= 0 and may_try:
            sw.trial, sw.waited_s = [], 0.0
        return sw.trial is not None

    def _costs(self, costs, batch_size: int, tokens: int, context: int, depth: int,
               max_nodes: int) -> tuple[list[float], float]:
        """(the cost of each extra row over the step's time per request, one draft level's time over
        the step's): the verify curve's increments (the cost model's per-token slope until the curve
        has two row counts) against a drafted step's verify plus drafting time."""
        if costs is None or not costs.has_verify_fit:
            return [PRIOR_ROW_COST] * max_nodes, 0.0
        step = costs.verify_time(tokens, context, drafted=True, requests=batch_size)
        step = max(step + costs.draft_time(depth, tokens, context), 1e-9)
        level = costs.draft_coefs(batch_size, context)[0] if costs.has_draft_fit else 0.0
        base = self.curve.at(batch_size)
        if base is None:
            slope = max(float(costs.verify_coef[1]), 0.0)
            rows = [slope] * max_nodes
        else:
            known = max(self.curve.seconds)
            rows = [self._node_row(batch_size, n, known) for n in range(max_nodes)]
        return [r * batch_size / step for r in rows], level / step

    def _node_row(self, b: int, n: int, known: int) -> float:
        """Seconds one verify row adds when each of ``b`` requests gets its (n+1)-th node: the curve's
        average increment over rows b(n+1) .. b(n+2). Measured (or between measured counts); the first
        block past the largest measured count along the last slope (one node more per request than
        ever verified at this load: exploration); blocks past that unpriced (inf), since on a CPU rows
        grow dearer as a step turns compute-bound and the last slope would underprice them.
        ``known``: the largest row count the curve has measured."""
        lo, hi = b * (n + 1), b * (n + 2)
        if lo > known:
            return math.inf
        return max(self.curve.at(hi) - self.curve.at(lo), 0.0) / b

    def observe(self, predicted: float, accepted: int, emitted: int, step_s: float, verify_s: float, rows: int,
                plain_s: float | None, batch_size: int, drafted: bool, fed_context: bool) -> None:
        """After a step: the nodes it predicted accepted and those that were (tree steps), the
        tokens it emitted, its time and its time besides drafting over ``rows`` fed rows, and the
        cost model's plain step time for its batch. ``fed_context``: it prefilled (no curve sample)."""
        if not fed_context:
            self.curve.add(rows, verify_s)
        if not drafted:
            self.switch(batch_size).waited_s += step_s
            return
        self.switch(batch_size).drafted += 1
        if predicted > 0:
            ratio = min(accepted / predicted, 4.0)
            self.calibration += AVERAGE * (ratio - self.calibration)
        self.gain += AVERAGE * (accepted / max(batch_size, 1) - self.gain)
        if plain_s is None:              # no steady plain fit yet: the curve's step of as many rows
            plain_s = self.curve.at(batch_size)
        if plain_s is None or step_s <= 0:
            return
        ratio = emitted * plain_s / (batch_size * step_s)
        sw = self.switch(batch_size)
        if sw.trial is not None:
            sw.trial.append(ratio)
            later = sw.trial[1:]
            m, se = _mean_se(later)
            hopeless = len(later) >= TRIAL_CHECK and m + 2 * se < TRIAL_GIVE_UP
            if len(sw.trial) >= TRIAL_STEPS or hopeless:
                mean, se = _mean_se(sw.trial)
                sw.trial = None
                sw.on, sw.speedup = not hopeless and mean + se > ON_ABOVE, mean
                sw.off_steps = OFF_STEPS if sw.on else min(2 * sw.off_steps, MAX_OFF_STEPS)
                sw.off_left = 0 if sw.on else sw.off_steps
            return
        sw.speedup += SPEED_AVERAGE * (ratio - sw.speedup)
        if sw.on and sw.speedup < OFF_BELOW:
            sw.on, sw.off_left = False, sw.off_steps
