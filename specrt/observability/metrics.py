"""Speculative-decoding statistics: per request, in aggregate, grouped by request tag,
by sequence-length bucket and by time window; health against the design's ranges
(specrt.observability.health); Prometheus text exposition.

Definitions (per step = one target verification of one request):
- drafted: draft tokens proposed (K of that step); accepted: how many were kept.
- mean accepted length: accepted drafts per step; tokens per target forward:
  (accepted + 1) per step, the "tau" of the speculative-decoding papers.
- acceptance rate at position i (cumulative): among steps that drafted at least i+1
  tokens, the share whose drafts 0..i were ALL accepted.
- conditional acceptance at position i: among steps that drafted position i and
  accepted every draft before it, the share that accepted position i too
  (accepted-at-i / reached-at-i: never above 1, unlike a ratio of two cumulative
  rates measured over different steps).
- draft hit rate: accepted / drafted.
- hidden draft time: draft time that ran on the draft stream while the target
  verified (overlap); exposed draft time = draft time - hidden. Draft share of the
  step: exposed draft time / (exposed draft time + verify time).
- estimated speedup (an ESTIMATE, with its inputs reported beside it): the time
  autoregressive decoding would have taken for the same emitted tokens over the measured
  time of the speculative steps (tokens per second emitted / plain decoding's tokens per
  second at the same batch size and context). The measured time is each step's whole wall
  time: admission, planning, drafting, verification, commit and the engine's bookkeeping
  after it (counted in the next step). The autoregressive time: a step that drafted nothing
  costs what it measured; in a drafted step each token costs a share of one plain decode step
  over its batch as the machine runs NOW (``CostModel.plain_step_now``: this engine's MEASURED
  steady plain decode steps, fitted, times how much faster or slower the drafted steps' verify
  parts run now than the ones measured together with those plain steps), the first token of a
  request whose prompt the step fed the step's time besides drafting. A plain-step time
  measured once at calibration, in another machine state than the steps it was divided by,
  read 3-5x too high (issue 39, item 8). None until steady plain decode steps were measured
  (calibration, warm-up, the budget policy's plain runs, a tree planner's plain steps). How
  close it comes to a measured A/B: tests/test_hostile_estimate_speedup.py (within 1.5x on a
  noisy shared machine) and ``python -m bench --sections speedup_estimate`` (the 15% goal).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specrt.observability.health import CAUSES, METRICS, HealthLog, HealthRanges, HealthReport, judge

LENGTH_BUCKETS = (256, 1024, 4096)


def length_bucket(context_len: int) -> str:
    lo = 0
    for hi in LENGTH_BUCKETS:
        if context_len < hi:
            return f"{lo}-{hi}"
        lo = hi
    return f"{lo}+"


@dataclass
class StepSample:
    """One request's share of one speculative step."""

    drafted: int
    accepted: int
    emitted: int
    draft_s: float = 0.0              # its share of the drafting time (its pre-draft included)
    verify_s: float = 0.0             # its share of the rest of the step
    hidden_s: float = 0.0             # draft time hidden behind the verification (overlap on CUDA)
    step_s: float = 0.0               # its share of the step's wall time
    ar_est_s: float | None = None     # what its emitted tokens would cost autoregressively (cost model)
    context_len: int = 0
    temperature: float = 0.0
    depth: int | None = None          # a tree's depth: the positions it drafted (None: a chain's, ``drafted``)


@dataclass
class RequestStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    target_forwards: int = 0
    drafted_steps: int = 0            # steps that drafted at least one token
    accepted_when_drafted: int = 0    # accepted drafts over those steps
    drafted_at: list[int] = field(default_factory=list)    # [i] steps that drafted position i
    accepted_at: list[int] = field(default_factory=list)   # [i] ... and accepted drafts 0..i
    reached_at: list[int] = field(default_factory=list)    # [i] ... and accepted drafts 0..i-1
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    hidden_draft_time_s: float = 0.0
    step_time_s: float = 0.0
    estimated_steps: int = 0          # steps with an autoregressive-cost estimate
    ar_time_est_s: float = 0.0        # ... what their tokens would cost autoregressively
    estimated_step_time_s: float = 0.0   # ... and what they cost
    context_tokens: int = 0           # sum of context lengths (mean context = / steps)
    temperature_sum: float = 0.0

    def record(self, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float,
               hidden_s: float) -> None:
        self.add(StepSample(drafted, accepted, emitted, draft_s, verify_s, hidden_s, draft_s + verify_s))

    def add(self, s: StepSample) -> None:
        self.steps += 1
        self.target_forwards += 1
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.emitted += s.emitted
        if s.drafted:
            self.drafted_steps += 1
            self.accepted_when_drafted += s.accepted
        positions = s.drafted if s.depth is None else s.depth
        self._grow(positions)
        for i in range(positions):
            self.drafted_at[i] += 1
            if i <= s.accepted:
                self.reached_at[i] += 1
            if i < s.accepted:
                self.accepted_at[i] += 1
        self.draft_time_s += s.draft_s
        self.verify_time_s += s.verify_s
        self.hidden_draft_time_s += s.hidden_s
        self.step_time_s += s.step_s
        if s.ar_est_s is not None:
            self.estimated_steps += 1
            self.ar_time_est_s += s.ar_est_s
            self.estimated_step_time_s += s.step_s
        self.context_tokens += s.context_len
        self.temperature_sum += s.temperature

    def _grow(self, n: int) -> None:
        while len(self.drafted_at) < n:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
            self.reached_at.append(0)

    def merge(self, other: "RequestStats") -> None:
        for name in ("steps", "drafted", "accepted", "emitted", "target_forwards", "drafted_steps",
                     "accepted_when_drafted", "draft_time_s", "verify_time_s", "hidden_draft_time_s", "step_time_s",
                     "estimated_steps", "ar_time_est_s", "estimated_step_time_s", "context_tokens",
                     "temperature_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._grow(len(other.drafted_at))
        for i in range(len(other.drafted_at)):
            self.drafted_at[i] += other.drafted_at[i]
            self.accepted_at[i] += other.accepted_at[i]
            self.reached_at[i] += other.reached_at[i]

    def speedup_estimate(self) -> float | None:
        """Estimated autoregressive time / measured time over the steps with an estimate."""
        if not self.estimated_steps or self.estimated_step_time_s <= 0:
            return None
        return self.ar_time_est_s / self.estimated_step_time_s

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        exposed = self.draft_time_s - self.hidden_draft_time_s
        busy = exposed + self.verify_time_s
        ds = self.drafted_steps
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "emitted_tokens": self.emitted,
            "mean_accepted_length": self.accepted / steps if self.steps else 0.0,
            "drafted_steps": ds,
            "mean_accepted_length_when_drafted": self.accepted_when_drafted / ds if ds else 0.0,
            "drafted_tokens_per_drafted_step": self.drafted / ds if ds else 0.0,
            "tokens_per_target_forward": self.emitted / steps if self.steps else 0.0,
            "target_forwards_per_token": self.target_forwards / self.emitted if self.emitted else 0.0,
            "first_token_acceptance_rate": (self.accepted_at[0] / self.drafted_at[0]) if self.drafted_at else 0.0,
            "acceptance_rate_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "conditional_acceptance_per_position": [a / r if r else 0.0
                                                    for a, r in zip(self.accepted_at, self.reached_at)],
            "draft_hit_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "drafted_tokens_per_step": self.drafted / steps if self.steps else 0.0,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "hidden_draft_time_s": self.hidden_draft_time_s,
            "hidden_draft_fraction": self.hidden_draft_time_s / self.draft_time_s if self.draft_time_s else 0.0,
            "draft_share_of_step": exposed / busy if busy > 0 else 0.0,
            "step_time_s": self.step_time_s,
            "estimated_speedup": self.speedup_estimate(),
            "estimated_speedup_inputs": {
                "basis": "autoregressive time (a plain step's own measured time; for a drafted step's tokens, "
                         "the fit of measured steady plain decode steps at its batch size and context, scaled by "
                         "the machine's current speed from the drafted steps' verify times) over the measured "
                         "whole step time",
                "steps": self.estimated_steps, "autoregressive_time_s": self.ar_time_est_s,
                "measured_time_s": self.estimated_step_time_s},
            "mean_context_len": self.context_tokens / steps if self.steps else 0.0,
            "mean_temperature": self.temperature_sum / steps if self.steps else 0.0,
        }


class EngineMetrics:
    """Aggregates step records; thread-safe (the server reads while the engine steps).

    ``labels``: constant labels of the health series (the engine sets model / draft);
    ``info``: engine facts shown in snapshot() (overlap status, draft size, KV tokens);
    ``draft_misaligned``: the draft rows sample with other parameters than the target's (the
    drafter's draft_params hook; a likely cause in the health reports), as ``check_health`` last heard."""

    BUCKET_S = 1.0          # the time window is kept in buckets of this many seconds

    def __init__(self, window_s: float = 60.0, health: HealthRanges | None = None, labels: dict | None = None,
                 info: dict | None = None, sources: Callable[[], dict | None] | None = None,
                 draft_misaligned: bool = False):
        self.window_s = window_s
        self.health = health or HealthRanges()
        self.labels = dict(labels or {})
        self.info = dict(info or {})
        self.draft_misaligned = draft_misaligned   # draft rows sample with other parameters (check_health)
        self.sources = sources             # () -> per draft source counts (suffix drafting), or None
        self._lock = threading.Lock()
        self.total = RequestStats()
        self.by_tag: dict[str, RequestStats] = {}
        self.by_length: dict[str, RequestStats] = {}
        self.by_group: dict[tuple[str, str], RequestStats] = {}   # (tag, length bucket): Prometheus series
        self._recent: deque[tuple[float, dict[str, RequestStats]]] = deque()   # (bucket start, tag -> stats)
        self._health_log = HealthLog()
        self.finished: dict[str, int] = {}
        self.preemptions = 0
        self.prompt_tokens = 0
        self.pre_drafts_made = 0
        self.pre_drafts_used = 0
        self.plan_time_s = 0.0        # host time the draft-length policy spent planning

    def fresh(self) -> "EngineMetrics":
        """New, empty statistics with the same settings (reset_metrics)."""
        return EngineMetrics(self.window_s, self.health, self.labels, self.info, self.sources, self.draft_misaligned)

    def record_step(self, tag: str, context_len: int, drafted: int, accepted: int, emitted: int,
                    draft_s: float, verify_s: float, hidden_s: float) -> None:
        self.add(tag, StepSample(drafted, accepted, emitted, draft_s, verify_s, hidden_s, draft_s + verify_s,
                                 context_len=context_len))

    def add(self, tag: str, sample: StepSample) -> None:
        now = time.monotonic()
        bucket = now - now % self.BUCKET_S
        b = length_bucket(sample.context_len)
        with self._lock:
            if not self._recent or self._recent[-1][0] != bucket:
                self._recent.append((bucket, {}))
            for stats in (self.total, self.by_tag.setdefault(tag, RequestStats()),
                          self.by_length.setdefault(b, RequestStats()),
                          self.by_group.setdefault((tag, b), RequestStats()),
                          self._recent[-1][1].setdefault(tag, RequestStats())):
                stats.add(sample)
            while self._recent and now - self._recent[0][0] > self.window_s + self.BUCKET_S:
                self._recent.popleft()

    def record_finish(self, reason: str, prompt_tokens: int) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens

    def record_overlap(self, used: bool) -> None:
        """Overlap: a pre-draft was made (used=False) or consumed by the next round (used=True)."""
        with self._lock:
            if used:
                self.pre_drafts_used += 1
            else:
                self.pre_drafts_made += 1

    def record_plan(self, seconds: float) -> None:
        with self._lock:
            self.plan_time_s += seconds

    def record_preemption(self) -> None:
        with self._lock:
            self.preemptions += 1

    def tag_windows(self) -> dict[str, RequestStats]:
        """Each tag's statistics over the last ``window_s`` seconds."""
        now = time.monotonic()
        out: dict[str, RequestStats] = {}
        with self._lock:
            for t, tags in self._recent:
                if now - t <= self.window_s:
                    for tag, s in tags.items():
                        out.setdefault(tag, RequestStats()).merge(s)
        return out

    def window(self) -> RequestStats:
        out = RequestStats()
        for s in self.tag_windows().values():
            out.merge(s)
        return out

    def health_reports(self) -> list[HealthReport]:
        """Every tag's last window judged against ``health`` (tags with too few steps are not judged)."""
        return [judge(tag, s.summary(), self.health, self.draft_misaligned)
                for tag, s in sorted(self.tag_windows().items())]

    def check_health(self, draft_misaligned: bool | None = None) -> list[HealthReport]:
        """Judge every tag's window and log (rate-limited) those outside the ranges; returns them.
        ``draft_misaligned``: whether the draft rows now sample with other parameters (kept for
        later reports; None: as last heard)."""
        if draft_misaligned is not None:
            self.draft_misaligned = draft_misaligned
        return self._health_log.emit(self.health_reports(), time.monotonic(), self.health)

    def snapshot(self) -> dict:
        with self._lock:
            snap = {
                "total": self.total.summary(),
                "by_tag": {k: v.summary() for k, v in self.by_tag.items()},
                "by_length_bucket": {k: v.summary() for k, v in self.by_length.items()},
                "finished_requests": dict(self.finished),
                "preemptions": self.preemptions,
                "prompt_tokens": self.prompt_tokens,
                "overlap_pre_drafts": self.pre_drafts_made,
                "overlap_pre_drafts_used": self.pre_drafts_used,
                "plan_time_s": self.plan_time_s,
                **self.info,
            }
        sources = self.sources() if self.sources is not None else None
        if sources:                        # since the engine started (reset_metrics keeps them)
            snap["draft_sources"] = sources
        snap["window"] = {"seconds": self.window_s, **self.window().summary()}
        snap["health"] = {rep.tag: {"healthy": rep.healthy, "judged": rep.judged, "drafted_steps": rep.steps,
                                    "checks": {c.metric: {"value": c.value, "status": c.status,
                                                          "range": [c.low, c.high]} for c in rep.checks},
                                    "likely_causes": rep.causes}
                          for rep in self.health_reports()}
        return snap

    def prometheus(self, prefix: str = "specrt") -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
            lines.append(f"# HELP {prefix}_{name} {help_}")
            lines.append(f"# TYPE {prefix}_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                lines.append(f"{prefix}_{name}{{{lab}}} {value}" if lab else f"{prefix}_{name} {value}")

        with self._lock:
            # one series per (tag, length bucket): summing a family over its series counts each step once
            groups = [({"tag": t, "length_bucket": b}, s) for (t, b), s in sorted(self.by_group.items())]
            total = self.total
            finished = dict(self.finished)
            preemptions = self.preemptions
        sources = (self.sources() if self.sources is not None else None) or {}
        for name, help_ in (("lookups", "Requests a draft source looked up"),
                            ("matches", "Drafts a source supplied"), ("drafted", "Draft tokens a source proposed"),
                            ("accepted", "Draft tokens of a source accepted")):
            if sources:
                metric(f"draft_source_{name}_total", "counter", help_,
                       [({"source": k}, v[name]) for k, v in sorted(sources.items())])
        if "global" in sources:
            metric("suffix_index_tokens", "gauge", "Tokens the global suffix index holds",
                   [({}, sources["global"]["index_tokens"])])
            metric("suffix_index_bytes", "gauge", "Bytes the global suffix index holds",
                   [({}, sources["global"]["index_bytes"])])
        for name, attr, help_ in (("spec_steps_total", "steps", "Speculative steps (target verifications)"),
                                  ("draft_tokens_total", "drafted", "Draft tokens proposed"),
                                  ("accepted_tokens_total", "accepted", "Draft tokens accepted"),
                                  ("emitted_tokens_total", "emitted", "Tokens emitted")):
            metric(name, "counter", help_, [(lab, getattr(s, attr)) for lab, s in groups])
        for name, key, help_ in (("mean_accepted_length", "mean_accepted_length", "Accepted drafts per step"),
                                 ("acceptance_rate", "draft_hit_rate", "Accepted / drafted"),
                                 ("tokens_per_target_forward", "tokens_per_target_forward",
                                  "Emitted tokens per target forward"),
                                 ("draft_share_of_step", "draft_share_of_step",
                                  "Exposed draft time / step time")):
            metric(name, "gauge", help_, [(lab, s.summary()[key]) for lab, s in groups])
        metric("estimated_speedup", "gauge", "ESTIMATED speedup over autoregressive decoding: the measured "
               "plain decode step time for the same tokens, scaled to the machine's current speed / the measured "
               "step time (absent until plain steps were measured)",
               [(lab, est) for lab, s in groups if (est := s.speedup_estimate()) is not None])
        metric("position_acceptance_rate", "gauge", "P(drafts 0..i all accepted | position i drafted)",
               [({"position": str(i)}, a / d if d else 0.0)
                for i, (a, d) in enumerate(zip(total.accepted_at, total.drafted_at))])
        metric("position_conditional_acceptance_rate", "gauge",
               "P(draft i accepted | drafts 0..i-1 accepted, position i drafted)",
               [({"position": str(i)}, a / r if r else 0.0)
                for i, (a, r) in enumerate(zip(total.accepted_at, total.reached_at))])
        for name, attr, help_ in (("draft_seconds_total", "draft_time_s", "Time spent drafting"),
                                  ("verify_seconds_total", "verify_time_s", "Time spent in target verification"),
                                  ("hidden_draft_seconds_total", "hidden_draft_time_s",
                                   "Draft time hidden behind verification")):
            metric(name, "counter", help_, [({}, getattr(total, attr))])
        win = self.window().summary()
        metric("window_acceptance_rate", "gauge", f"Acceptance rate over the last {self.window_s:g}s",
               [({}, win["draft_hit_rate"])])
        self._health_series(metric)
        metric("requests_finished_total", "counter", "Finished requests by reason",
               [({"reason": r}, n) for r, n in sorted(finished.items())])
        metric("preemptions_total", "counter", "Requests preempted when the KV cache ran out", [({}, preemptions)])
        return "\n".join(lines) + "\n"

    def _health_series(self, metric) -> None:
        """Per (model labels, tag): the windowed values, -1/0/1 against the ranges, 0/1 per cause."""
        reports = [r for r in self.health_reports() if r.judged]
        base = self.labels
        metric("health_ok", "gauge", f"1 if the tag's last {self.window_s:g}s of speculative decoding is inside "
               "the healthy ranges (or has too few drafted steps to judge), else 0",
               [({**base, "tag": r.tag}, int(r.healthy)) for r in self.health_reports()])
        metric("health_value", "gauge", "Windowed value of each health metric",
               [({**base, "tag": r.tag, "metric": c.metric}, c.value) for r in reports for c in r.checks
                if c.value is not None])
        metric("health_out_of_range", "gauge", "-1 below the healthy range, 1 above it, 0 inside or unknown",
               [({**base, "tag": r.tag, "metric": c.metric}, c.direction) for r in reports for c in r.checks])
        metric("health_cause", "gauge", "1 for each likely cause of a window below its healthy range",
               [({**base, "tag": r.tag, "cause": c}, int(c in r.causes)) for r in reports for c in CAUSES])
        metric("health_range_low", "gauge", "Low end of each healthy range",
               [({"metric": m}, getattr(self.health, m)[0]) for m in METRICS])
        metric("health_range_high", "gauge", "High end of each healthy range",
               [({"metric": m}, getattr(self.health, m)[1]) for m in METRICS])


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
