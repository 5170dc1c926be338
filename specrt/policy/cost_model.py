"""Measured step costs: what the budget policy plans with.

Two linear models fitted by non-negative least squares over the recent steps:

- verify (the step's time besides drafting: planning, the target forward, sampling,
  bookkeeping): seconds ~ v0 + v1 * tokens + v2 * context tokens + v3 * [anything drafted]
  + v4 * requests. A multi-token verify may cost a jump over a plain decode step (v3). Plain
  samples count only when the step before was plain too (steady autoregressive decoding);
  ``steps_since_plain`` lets a policy force a short plain run so both regimes stay measured.
- draft (the whole drafting phase of a step): seconds ~ d0 * depth + d1 * tokens fed + d2 *
  context attended, where depth is the number of draft forwards, tokens fed counts every token
  the draft consumed (catch-up included) and context attended sums each forward's rows'
  sequence lengths.

The speedup estimate's reference (``plain_step_now``, specrt.observability.metrics): what one plain decode step
costs the machine NOW. Steady plain steps feeding one token per request are fitted (seconds ~ p0
+ p1 * context + p2 * requests: ``ref_plain``), and so are the verify parts of the drafted steps
measured within REF_NEAR_STEPS steps and REF_NEAR_S seconds before one (``ref_drafted``: seconds
~ r0 + r1 * tokens + r2 * context + r3 * requests): both in the same machine state (calibration
interleaves runs of each; a budget policy's plain runs and a tree planner's plain steps do too).
The later drafted steps' measured verify time over the second fit's prediction for them (a ratio
of decayed sums: ``slowdown``) says how much slower or faster the machine runs now than when
the reference was measured; a plain step now costs the first fit's time times that. A plain-step
time measured once (at calibration, on a busy machine, or at a server's start next to another
one) and compared with steps measured later in another machine state was off by 3-5x (issue 39,
item 8); the ratio of two fits measured together is not. What it assumes: a change of machine
state slows a plain step and a drafted step's verify part alike (true of a slower clock or a
fair share of the cores; not quite of contention in bursts shorter than a step, such as another
thread holding the interpreter lock); ``LLMEngine.calibrate()`` measures the reference afresh.
"""
from __future__ import annotations

import itertools
import time

import numpy as np

from specrt.policy import tuning


def nonneg_fit(x, y, always: list[int], optional: list[int]):
    """Least squares with non-negative coefficients over a handful of columns, by trying every
    subset of the optional columns (exact for so few). Among the non-negative fits the one with
    the fewest columns whose residual is within FIT_RESIDUAL_SLACK of the best wins: a column
    that explains nothing more (it barely varies, or it moves with another one) is left out,
    because its share would be arbitrary and extrapolate badly. Returns coefficients for every
    column (0 if out). Every subset is solved from one Gram matrix of the RMS-scaled columns."""
    # a column that barely varies cannot be told apart from the others' constant part
    optional = [c for c in optional if x[:, c].std() > tuning.FIT_MIN_SPREAD * max(abs(x[:, c].mean()), 1e-12)]
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
    size, rss, cols, coef = min((f for f in fits if f[1] <= best * (1 + tuning.FIT_RESIDUAL_SLACK) + 1e-18),
                                key=lambda f: (f[0], f[1]))
    out[cols] = coef / scale[cols]
    return out


class CostModel:
    """Measured step costs (see the module docstring); ``refit`` before reading predictions."""

    def __init__(self):
        self.verify_samples: list[tuple] = []    # (tokens, context, drafted, requests, seconds)
        self.draft_samples: list[tuple] = []     # (depth, tokens fed, attended, seconds)
        self.steps_since_plain = 0   # steps since the last steady plain sample
        self.num_plain = 0           # steady plain samples so far
        self.fit_version = 0         # bumped by every refit that changed a fit
        self._prev_drafted = True
        self._added = [0, 0]         # verify / draft samples ever added
        self._fitted_at = [None, None]
        self._verify_coef = None     # [5] v0..v4, None until fitted
        self._draft_coef = None      # [3] d0..d2
        # steady plain steps, kept apart (drafted steps never push them out): the autoregressive
        # step time the runtime's speedup estimate divides by
        self.plain_samples: list[tuple] = []     # (tokens, context, requests, seconds)
        self._plain_coef = None      # [4] p0..p3 (1, tokens, context, requests), None until fitted
        self._plain_added = 0        # plain samples ever added
        self.last_plain_at: float | None = None   # time.monotonic() of the last one
        self._plain_fitted_at = 0
        # the speedup estimate's reference (module docstring): steady plain decode steps and the
        # verify parts of the drafted steps measured right before them
        self.ref_plain: list[tuple] = []         # (context, requests, seconds)
        self.ref_drafted: list[tuple] = []       # (tokens, context, requests, seconds)
        self._ref_added = [0, 0]
        self._ref_fitted_at = [0, 0]
        self._ref_coef = [None, None]            # [3] p0..p2 (1, context, requests); [4] r0..r3 (1, tokens, ...)
        self._steps = 0                          # add_verify calls
        self._before_plain: list[tuple] = []     # (step, time.monotonic(), drafted sample): ref_drafted if a
                                                 # steady plain decode step follows soon
        self._since_ref_plain: int | None = None    # steps since the last ref_plain sample (None: none yet)
        self.slowdown: float | None = None       # recent drafted steps' verify time / ref_drafted's prediction
        self._slowdown_sums = [0.0, 0.0]         # ... its decayed numerator and denominator

    def add_verify(self, tokens: int, context: int, seconds: float, drafted: bool = False, requests: int = 1,
                   step_seconds: float | None = None) -> bool:
        """A step's verify sample (``seconds``: the step besides drafting). A steady plain step is
        also a sample of the autoregressive step time (``step_seconds``: the whole step, default
        ``seconds``). Returns whether it was one."""
        steady_plain = not drafted and not self._prev_drafted
        self._prev_drafted = drafted
        self.steps_since_plain = 0 if steady_plain else self.steps_since_plain + 1
        if steady_plain:
            self.plain_samples.append((tokens, context, requests, seconds if step_seconds is None else step_seconds))
            self._plain_added += 1
            self.last_plain_at = time.monotonic()
            del self.plain_samples[:-tuning.COST_SAMPLES_KEPT]
        if drafted or steady_plain:
            self.verify_samples.append((tokens, context, float(drafted), requests, seconds))
            self.num_plain += steady_plain
            self._added[0] += 1
            del self.verify_samples[:-tuning.COST_SAMPLES_KEPT]
        self._add_reference(tokens, context, drafted, requests, seconds, steady_plain,
                            seconds if step_seconds is None else step_seconds)
        return steady_plain

    def _add_reference(self, tokens: int, context: int, drafted: bool, requests: int, seconds: float,
                       steady_plain: bool, step_seconds: float) -> None:
        """The speedup estimate's reference samples, and ``slowdown``: the recent drafted steps'
        verify time over the reference's prediction for them (steps outside the reference), a
        ratio of decayed sums (a per-step ratio would follow each step's own acceptance: a step
        that accepted more commits more, and would price its extra tokens dearer)."""
        self._steps += 1
        now = time.monotonic()
        if steady_plain and tokens == requests:         # a decode step: one token per request
            self.ref_plain.append((context, requests, step_seconds))
            self._ref_added[0] += 1
            del self.ref_plain[:-tuning.COST_SAMPLES_KEPT]
            near = [d for step, t, d in self._before_plain
                    if self._steps - step <= tuning.REF_NEAR_STEPS and now - t <= tuning.REF_NEAR_S]
            self.ref_drafted.extend(near)
            self._ref_added[1] += len(near)
            del self.ref_drafted[:-tuning.COST_SAMPLES_KEPT]
            self._before_plain = []
            self._since_ref_plain = 0
            return
        if self._since_ref_plain is not None:
            self._since_ref_plain += 1
        if not drafted:
            return
        self._before_plain.append((self._steps, now, (tokens, context, requests, seconds)))
        del self._before_plain[:-tuning.REF_NEAR_STEPS]
        if self._since_ref_plain is not None and self._since_ref_plain <= tuning.REF_NEAR_STEPS:
            return            # just after the reference was measured (calibration's last drafted run): not news
        predicted = self._ref_predict(1, (1.0, tokens, context, requests))
        if predicted is not None:
            d = tuning.SLOWDOWN_DECAY
            num, den = self._slowdown_sums
            self._slowdown_sums = [num * d + seconds, den * d + predicted]
            self.slowdown = self._slowdown_sums[0] / self._slowdown_sums[1]

    def _ref_predict(self, i: int, row: tuple) -> float | None:
        """Reference fit i (0: plain decode steps, 1: drafted steps' verify parts) at ``row`` (its
        columns, the constant first); None with fewer than AR_MIN_SAMPLES samples."""
        samples = (self.ref_plain, self.ref_drafted)[i]
        if len(samples) < tuning.AR_MIN_SAMPLES:
            return None
        added = self._ref_added[i]
        due = max(1, min(added, tuning.COST_SAMPLES_KEPT) // tuning.REFIT_FRACTION)
        if self._ref_coef[i] is None or added - self._ref_fitted_at[i] >= due:
            a = np.array(samples[-tuning.COST_SAMPLES_FITTED:], dtype=float)
            x = np.column_stack([np.ones(len(a)), a[:, :-1]])
            self._ref_coef[i] = nonneg_fit(x, a[:, -1], always=[0], optional=list(range(1, x.shape[1])))
            self._ref_fitted_at[i] = added
        return max(float(np.dot(self._ref_coef[i], row)), 1e-9)

    def plain_step_now(self, requests: int, context: int) -> float | None:
        """Seconds one plain decode step over ``requests`` requests with ``context`` context tokens
        in all costs the machine now (the module docstring): the reference plain fit times
        ``slowdown`` (1 until drafted steps were measured after the reference). Before
        AR_MIN_SAMPLES steady plain decode steps, ``ar_step_time``'s fit (None before any)."""
        plain = self._ref_predict(0, (1.0, context, requests))
        if plain is None:
            return self.ar_step_time(requests, context, requests)
        return plain * (self.slowdown if self.slowdown is not None else 1.0)

    def ar_step_time(self, tokens: int, context: int, requests: int) -> float | None:
        """Seconds of one plain (autoregressive) step over ``requests`` requests feeding ``tokens``
        tokens with ``context`` context tokens in all, by a fit of this engine's MEASURED steady plain
        steps (the last COST_SAMPLES_FITTED); None with fewer than AR_MIN_SAMPLES of them."""
        n = len(self.plain_samples)
        if n < tuning.AR_MIN_SAMPLES:
            return None
        due = max(1, min(self._plain_added, tuning.COST_SAMPLES_KEPT) // tuning.REFIT_FRACTION)
        if self._plain_coef is None or self._plain_added - self._plain_fitted_at >= due:
            p = np.array(self.plain_samples[-tuning.COST_SAMPLES_FITTED:], dtype=float)
            x = np.column_stack([np.ones(len(p)), p[:, :3]])
            self._plain_coef = nonneg_fit(x, p[:, 3], always=[0], optional=[1, 2, 3])
            self._plain_fitted_at = self._plain_added
        c = self._plain_coef
        return max(float(c[0] + c[1] * tokens + c[2] * context + c[3] * requests), 1e-9)

    def plain_fit_info(self) -> dict:
        """What the speedup estimate's autoregressive step time rests on (for stats())."""
        c, p, r = self._plain_coef, self._ref_coef[0], self._ref_coef[1]
        return {"plain_samples": len(self.plain_samples),
                "seconds_per": None if c is None else dict(zip(("step", "token", "context_token", "request"),
                                                                 map(float, c))),
                "last_sample_age_s": None if self.last_plain_at is None else time.monotonic() - self.last_plain_at,
                "reference_plain_decode_steps": len(self.ref_plain),
                "reference_plain_seconds_per": None if p is None else dict(zip(("step", "context_token", "request"),
                                                                               map(float, p))),
                "reference_drafted_steps": len(self.ref_drafted),
                "reference_verify_seconds_per": None if r is None else dict(
                    zip(("step", "token", "context_token", "request"), map(float, r))),
                "slowdown": self.slowdown}

    @property
    def plain_coef(self):
        """The plain-step fit (p0..p3 for 1, tokens, context, requests), None until fitted."""
        return None if self._plain_coef is None else self._plain_coef.copy()

    def add_draft(self, depth: int, tokens_fed: int, attended: int, seconds: float) -> None:
        if depth > 0:
            self.draft_samples.append((depth, tokens_fed, attended, seconds))
            self._added[1] += 1
            del self.draft_samples[:-tuning.COST_SAMPLES_KEPT]

    def _due(self, i: int) -> bool:
        """Refit model i after REFIT_FIRST new samples at first, then every 1/REFIT_FRACTION of
        the samples seen so far (a fit and the full plan it forces cost a real share of a step)."""
        n, at = self._added[i], self._fitted_at[i]
        return n >= 4 and (at is None or n - at >= max(tuning.REFIT_FIRST,
                                                       min(n, tuning.COST_SAMPLES_KEPT) // tuning.REFIT_FRACTION))

    def refit(self) -> None:
        """Refit whichever model has enough new samples. ``fit_version`` moves only when a refit
        changed a prediction on the recent samples by more than REFIT_CHANGE (plans built on the
        old fit stay valid otherwise)."""
        window = tuning.COST_SAMPLES_FITTED
        if self._due(0):
            self._fitted_at[0] = self._added[0]
            v = np.array(self.verify_samples[-window:], dtype=float)
            x = np.column_stack([np.ones(len(v)), v[:, :4]])
            self._verify_coef = self._bump(x, self._verify_coef, nonneg_fit(x, v[:, 4], always=[0],
                                                                            optional=[1, 2, 3, 4]))
        if self._due(1):
            self._fitted_at[1] = self._added[1]
            d = np.array(self.draft_samples[-window:], dtype=float)
            self._draft_coef = self._bump(d[:, :3], self._draft_coef, nonneg_fit(d[:, :3], d[:, 3], always=[0],
                                                                                 optional=[1, 2]))

    def _bump(self, x, old, new):
        if old is None or np.max(np.abs(x @ (new - old)) / np.maximum(x @ old, 1e-12)) > tuning.REFIT_CHANGE:
            self.fit_version += 1
            return new
        return old      # close everywhere: keep the fit the plans were built on

    @property
    def verify_coef(self):
        """The verify fit's coefficients (v0..v4), None until measured."""
        return None if self._verify_coef is None else self._verify_coef.copy()

    @property
    def draft_coef(self):
        """The draft fit's coefficients (d0..d2), None until measured."""
        return None if self._draft_coef is None else self._draft_coef.copy()

    @property
    def has_verify_fit(self) -> bool:
        return self._verify_coef is not None

    @property
    def has_draft_fit(self) -> bool:
        return self._draft_coef is not None

    def verify_time(self, tokens: int, context: int, drafted: bool = False, requests: int = 1) -> float:
        c = self._verify_coef
        if c is None:   # unitless until measured: drafting looks worthwhile, so it gets measured
            return UNMEASURED[0] + UNMEASURED[1] * tokens
        return max(float(c[0] + c[1] * tokens + c[2] * context + c[3] * drafted + c[4] * requests), 1e-9)

    def draft_coefs(self, batch: int, context: int) -> tuple[float, float, float]:
        """(seconds per draft forward, per token fed, per context token attended). Unmeasured: a
        forward costs UNMEASURED_DRAFT_SHARE of a verify, tokens nothing extra."""
        c = self._draft_coef
        if c is None:
            return tuning.UNMEASURED_DRAFT_SHARE * self.verify_time(batch, context, requests=batch), 0.0, 0.0
        return float(c[0]), float(c[1]), float(c[2])

    def catchup_time(self, lag: list[int] | None, batch) -> float:
        """The predicted time of a draft catch-up over ``lag`` [B] tokens per request (its KV lag),
        each token attending about its request's context less half the lag; 0 while unmeasured."""
        if not lag or not any(lag) or not self.has_draft_fit:
            return 0.0
        fed = sum(lag)
        attended = sum(g * max(r.context_len - g / 2, 0) for g, r in zip(lag, batch))
        _, per_token, per_attended = self.draft_coefs(fed, attended)
        return max(per_token * fed + per_attended * attended, 0.0)

    def draft_time(self, depth: int, tokens_fed: int, attended: int) -> float:
        a, b, c = self.draft_coefs(tokens_fed, attended)
        return a * depth + b * tokens_fed + c * attended


UNMEASURED = tuning.UNMEASURED_VERIFY
