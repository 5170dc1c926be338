"""Health of speculative decoding: is a window of a tag's steps inside the healthy ranges, and if
not, what the engine can see that would explain it.

The ranges are the design's (HealthRanges' defaults): mean accepted length 2.5-4.0 drafts per
step, first-token acceptance 70-90%, end-to-end speedup 2.0-3.5x (the runtime's estimate, see
specrt.observability.metrics). Below 50% acceptance the design's troubleshooting applies: check that the draft
and the target sample alike, the temperature, and reduce K. The causes reported are those the
engine can observe: misaligned draft sampling parameters, a high temperature, long contexts, a
draft that costs too much of a step, and more draft tokens than get accepted (reduce K).

Pure functions over summary dicts (specrt.observability.metrics.RequestStats.summary); the rate-limited log
and the Prometheus series are built on them by specrt.observability.metrics.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("specrt.health")

METRICS = ("mean_accepted_length", "first_token_acceptance", "estimated_speedup")
CAUSES = ("misaligned_sampling", "high_temperature", "long_context", "costly_draft", "draft_too_long")
CAUSE_TEXT = {
    "misaligned_sampling": "the draft samples with other parameters than the target (draft_params hook): "
                           "align them",
    "high_temperature": "high sampling temperature (acceptance falls as T rises): expected, or lower T",
    "long_context": "long contexts: try a smaller K or a draft KV window (SpecConfig.draft_kv_window)",
    "costly_draft": "the draft costs a large share of each step: use a smaller or quantized draft",
    "draft_too_long": "most draft tokens are rejected: reduce K (max_draft_length) or use an adaptive policy",
}


@dataclass(frozen=True)
class HealthRanges:
    """Healthy ranges (inclusive) and the thresholds of the causes; all configurable."""

    mean_accepted_length: tuple[float, float] = (2.5, 4.0)
    first_token_acceptance: tuple[float, float] = (0.70, 0.90)
    estimated_speedup: tuple[float, float] = (2.0, 3.5)
    low_acceptance: float = 0.5        # draft hit rate below this: the troubleshooting checklist
    min_steps: int = 32                # drafted steps a window needs before it is judged
    warn_every_s: float = 300.0        # a tag's warning is logged at most this often
    high_temperature: float = 1.0      # mean sampling temperature at or above this is "high"
    long_context: int = 2048           # mean context tokens at or above this is "long"
    costly_draft_share: float = 0.33   # exposed draft time / step time at or above this is "costly"

    def __post_init__(self) -> None:
        for name in METRICS:
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"HealthRanges.{name} must be (low, high) with 0 <= low <= high, got {(lo, hi)}")
        if self.min_steps < 1 or self.warn_every_s < 0:
            raise ValueError("HealthRanges: min_steps must be >= 1 and warn_every_s >= 0")


@dataclass
class HealthCheck:
    metric: str
    value: float | None      # None: not measured (e.g. no autoregressive step time known yet)
    low: float
    high: float

    @property
    def status(self) -> str:
        """"ok", "low", "high" or "unknown"."""
        if self.value is None:
            return "unknown"
        return "low" if self.value < self.low else "high" if self.value > self.high else "ok"

    @property
    def direction(self) -> int:
        """-1 below the range, 1 above it, 0 inside (or unknown): the alert-ready series."""
        return {"low": -1, "high": 1}.get(self.status, 0)


@dataclass
class HealthReport:
    """One tag's window, judged."""

    tag: str
    steps: int                      # drafted steps in the window
    judged: bool                    # enough steps to judge (HealthRanges.min_steps)
    checks: list[HealthCheck] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)   # likely causes (CAUSES), when something is low

    @property
    def healthy(self) -> bool:
        return not self.judged or all(c.direction == 0 for c in self.checks)

    def describe(self) -> str:
        out = [f"{c.metric}={c.value:.2f} ({c.status}; healthy {c.low:g}-{c.high:g})"
               for c in self.checks if c.direction]
        why = "; ".join(CAUSE_TEXT[c] for c in self.causes) or "no cause the engine can see"
        return f"tag {self.tag!r} over its last {self.steps} drafted steps: {', '.join(out)}. Likely: {why}"


def judge(tag: str, window: dict, ranges: HealthRanges, misaligned: bool = False) -> HealthReport:
    """The report of one tag from its window summary (RequestStats.summary() plus the window's
    ``mean_temperature`` and ``mean_context_len``)."""
    steps = int(window.get("drafted_steps", 0))
    report = HealthReport(tag, steps, steps >= ranges.min_steps)
    if not report.judged:
        return report
    values = {"mean_accepted_length": window["mean_accepted_length_when_drafted"],
              "first_token_acceptance": window["first_token_acceptance_rate"],
              "estimated_speedup": window.get("estimated_speedup")}
    report.checks = [HealthCheck(m, values[m], *getattr(ranges, m)) for m in METRICS]
    if any(c.direction < 0 for c in report.checks) or window["draft_hit_rate"] < ranges.low_acceptance:
        report.causes = causes(window, ranges, misaligned)
    return report


def causes(window: dict, ranges: HealthRanges, misaligned: bool) -> list[str]:
    """What the engine can see that lowers acceptance or speedup."""
    out = []
    if misaligned:
        out.append("misaligned_sampling")
    if window.get("mean_temperature", 0.0) >= ranges.high_temperature:
        out.append("high_temperature")
    if window.get("mean_context_len", 0.0) >= ranges.long_context:
        out.append("long_context")
    if window.get("draft_share_of_step", 0.0) >= ranges.costly_draft_share:
        out.append("costly_draft")
    if (window["draft_hit_rate"] < ranges.low_acceptance
            and window["drafted_tokens_per_drafted_step"] > window["mean_accepted_length_when_drafted"] + 1.0):
        out.append("draft_too_long")
    return out


class HealthLog:
    """Rate-limited warnings: one per tag per ``warn_every_s`` while it stays unhealthy."""

    def __init__(self):
        self._last: dict[str, float] = {}

    def emit(self, reports: list[HealthReport], now: float, ranges: HealthRanges) -> list[HealthReport]:
        """Log the unhealthy reports not logged within warn_every_s; returns those logged."""
        logged = []
        for rep in reports:
            if rep.healthy:
                continue
            last = self._last.get(rep.tag)
            if last is not None and now - last < ranges.warn_every_s:
                continue
            self._last[rep.tag] = now
            logger.warning("speculative decoding outside its healthy range: %s", rep.describe())
            logged.append(rep)
        return logged
