"""Token trees: how many nodes each step verifies, and whether drafting pays at all.

Size (EAGLE-2's budget, from measured costs). A node's chance of acceptance is taken as the
product of the draft's probabilities on its path times a calibration factor, the ratio of
accepted to predicted nodes over recent tree steps. A request keeps the N best nodes that
maximise (1 + expected accepted) / (1 + row_cost * N), where ``row_cost`` is one more verify
row's time over the step's time per request (the cost model's fit), so cheap rows make big
trees and a compute-bound verify small ones.

On/off. Drafting must beat plain decoding: every tree step's speed is compared with the cost
model's autoregressive step time for the same batch (an average of the ratios). Below
``OFF_BELOW`` the planner stops drafting and tries a tree step again every ``RETRY_EVERY``
steps; every ``PROBE_EVERY`` steps it runs ``PROBE_STEPS`` plain steps, so the autoregressive
time stays measured on this machine as it is now.
"""
from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 64          # steps between plain probes
PROBE_STEPS = 2           # a steady plain sample needs a plain step before it
RETRY_EVERY = 16          # steps between tree steps while drafting is off
OFF_BELOW = 0.98          # average speedup under which drafting switches off ...
ON_ABOVE = 1.02           # ... and over which it switches back on
AVERAGE = 0.1             # weight of the newest step in the running averages
PRIOR_ROW_COST = 0.05     # one verify row / one step, before the cost model has a fit


@dataclass
class TreeStep:
    """What the planner decided for one step."""

    draft: bool               # grow trees this step (else a plain step)
    row_cost: float           # one verify row's time over the step's time per request
    calibration: float        # accepted nodes per predicted node


class TreePlanner:
    """Per engine; the engine calls ``plan`` before drafting and ``observe`` after the commit."""

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive          # False: every step drafts (tree="fixed")
        self.calibration = 1.0
        self.speedup = 1.0                # running average of tree steps' speed over plain steps'
        self.on = True
        self._since_probe = 0
        self._probe_left = 0
        self._since_tree = 0

    def plan(self, costs, batch_size: int, tokens: int, context: int, depth: int) -> TreeStep:
        """``tokens`` / ``context``: what a plain step over the batch would feed and attend."""
        return TreeStep(self._draft_now(costs, batch_size, tokens, context), self._row_cost(
            costs, batch_size, tokens, context, depth), self.calibration)

    def _draft_now(self, costs, batch_size: int, tokens: int, context: int) -> bool:
        if not self.adaptive:
            return True
        self._since_probe += 1
        if self._probe_left > 0 or (self._since_probe >= PROBE_EVERY and costs is not None):
            if self._probe_left == 0:
                self._probe_left = PROBE_STEPS
            self._probe_left -= 1
            self._since_probe = 0
            return False
        if self.on:
            return True
        self._since_tree += 1
        if self._since_tree < RETRY_EVERY:
            return False
        self._since_tree = 0
        return True

    @staticmethod
    def _row_cost(costs, batch_size: int, tokens: int, context: int, depth: int) -> float:
        """One verify row over the step's time per request (the verify fit's per-token slope over
        a drafted step's verify plus drafting time, shared by the batch)."""
        if costs is None or not costs.has_verify_fit:
            return PRIOR_ROW_COST
        slope = float(costs.verify_coef[1])
        step = costs.verify_time(tokens, context, drafted=True, requests=batch_size)
        step += costs.draft_time(depth, tokens, context)
        return max(slope, 0.0) * batch_size / max(step, 1e-9)

    def observe(self, predicted: float, accepted: int, emitted: int, step_s: float, plain_s: float | None,
                batch_size: int, drafted: bool) -> None:
        """After a step: the nodes it predicted accepted and those that were (tree steps), the
        tokens it emitted, its time, and the cost model's plain step time for its batch."""
        if not drafted:
            return
        if predicted > 0:
            ratio = min(accepted / predicted, 4.0)
            self.calibration += AVERAGE * (ratio - self.calibration)
        if plain_s is None or step_s <= 0:
            return
        self.speedup += AVERAGE * (emitted * plain_s / (batch_size * step_s) - self.speedup)
        if self.on and self.speedup < OFF_BELOW:
            self.on = False
        elif not self.on and self.speedup > ON_ABOVE:
            self.on = True
