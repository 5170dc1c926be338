"""Every tuning constant of the draft-length policies and the cost model, in one place.

Each is a knob whose value was set by measurement; the reasoning and the numbers behind
them are in docs/policy.md (not here). Changing one changes only which tokens are
drafted, never the output distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

# -- acceptance estimates (all policies)
PRIOR_RATE = 0.7              # acceptance assumed for a request (or a pool) without evidence
HISTORY_PRIOR_WEIGHT = 2.0    # outcomes' worth of PRIOR_RATE in recent_acceptance's default
MIN_POOLED_OUTCOMES = 32      # outcomes a pool (all requests, an evidence class) needs to replace the prior

# -- admission by acceptance (SpecConfig.admission = "acceptance")
TAG_GAIN_STEP = 0.02          # step size of a tag's moving average of accepted drafts per step
TAG_PRIOR_STEPS = 8.0         # steps' worth of its tag's average in a request's predicted acceptance

# -- confidence policy: threshold = base * (CONF_SLOPE - recent acceptance), clamped
CONF_SLOPE = 1.5
CONF_MIN, CONF_MAX = 0.02, 0.95

# -- cost model
COST_SAMPLES_KEPT = 512       # samples of each kind remembered
COST_SAMPLES_FITTED = 256     # the most recent ones a fit uses
REFIT_FIRST = 16              # new samples before the first refit (and the least between refits)
REFIT_FRACTION = 4            # later: refit after 1/REFIT_FRACTION of the samples seen (capped at the kept)
REFIT_CHANGE = 0.02           # a refit moving no prediction by more than this keeps the old fit
FIT_RESIDUAL_SLACK = 0.02     # a fit with fewer columns wins within this much of the best residual
FIT_MIN_SPREAD = 0.05         # a column varying less than this (std / |mean|) is left out of a fit
AR_MIN_SAMPLES = 8            # steady plain steps before the speedup estimate has an autoregressive cost
REF_NEAR_STEPS = 8            # drafted steps this close before a steady plain one share its machine state
REF_NEAR_S = 2.0              # ... if this close in time too
SLOWDOWN_DECAY = 0.98         # per drafted step, of the sums behind the machine's current slowdown (~50 steps)
UNMEASURED_VERIFY = (1.0, 0.01)   # (seconds, per token): unitless verify cost until measured
UNMEASURED_DRAFT_SHARE = 0.25     # an unmeasured draft forward costs this share of a verify


@dataclass
class BudgetTuning:
    """The budget policy's knobs (one instance per policy; tests may change fields)."""

    min_gain: float = 0.10        # predicted gain a drafted plan needs over plain decoding
    min_gain_free: float = 0.03   # the same for a drafter whose measured cost is negligible
    free_draft_share: float = 0.01   # "negligible": K tokens for every request under this share of a plain step
    explore_every: int = 16       # idle steps before a request kept at K=0 is looked at (one token)
    explore_max: int = 256        # steps without any draft after which one look is taken regardless of price
    explore_backoff_max: int = 4  # looks that cost a catch-up back off up to x2**this while fruitless
    optimism: float = 0.25        # acceptance added for a look's price check
    optimism_cap: float = 0.97    # the optimistic acceptance never exceeds this
    optimism_pool: int = 32       # with more pooled outcomes, a look costing a catch-up shrinks its optimism
    plain_every: int = 64         # steps between forced plain runs (keeps the plain cost measured)
    plain_first: int = 8          # the first plain runs come after 8, 16, 32 ... steps
    plain_run: int = 3            # plain steps per forced run
    replan_every: int = 64        # while off, a full plan at least this often (contexts grow)
    recheck_every: int = 32       # steps between drafted steps re-measuring a vetoing correction
    dormant_max: int = 16         # while off, at most this many steps in a row skip planning
    search_rounds: int = 6        # Dinkelbach rounds per depth
    max_position_rate: float = 0.99   # per-position acceptance never exceeds this in the prices
    pooled_window: int = 512      # recent acceptance outcomes pooled over all requests
    prior_weight: float = 8.0     # outcomes' worth of the pooled rate in a request's own estimate
    depth_decay: float = 0.998    # per drafted outcome, of the pooled per-position counts
    depth_clip: float = 4.0       # a position's factor over the overall rate stays in [1/clip, clip]
    class_decay: float = 0.998    # per outcome, of the pooled counts per evidence class
    fill_rate: float = 0.25       # step size of a request's fill estimate (share of asked tokens proposed)
    pooled_fill_rate: float = 0.05    # the same for the pooled fill
    track_decay: float = 0.95     # realized / predicted: weight of a step falls by this per later step of its kind
    track_forget: float = 0.998   # per step of the other kind (half-life ~350 steps)
    track_prior: float = 20.0     # steps' worth of 'as predicted' the measured ratio is shrunk towards
    track_clip: float = 4.0       # a correction stays within [1/clip, clip]
    track_buckets: int = 6        # batch-size buckets of the corrections: 1, 2-3, 4-7, ..., 2**(n-1)+
