"""Speculative-decoding statistics: per request, in aggregate, grouped by request tag,
by sequence-length bucket and by time window; Prometheus text exposition.

Definitions (per step = one target verification of one request):
- drafted: draft tokens proposed (K of that step); accepted: how many were kept.
- mean accepted length: accepted drafts per step; tokens per target forward:
  (accepted + 1) per step, the "tau" of the speculative-decoding papers.
- acceptance rate at position i: among steps that drafted at least i+1 tokens, the
  share whose drafts 0..i were ALL accepted (cumulative, so it falls with i; the
  conditional rate at i is rate[i] / rate[i-1]).
- draft hit rate: accepted / drafted.
- hidden draft time: draft time that ran on the draft stream while the target
  verified (overlap); exposed draft time = draft time - hidden.
- estimated speedup over autoregressive decoding: tokens per target forward /
  (1 + exposed draft time / verify time), i.e. taking a verify pass to cost
  about one autoregressive step (bench/ measures the real ratio).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

LENGTH_BUCKETS = (256, 1024, 4096)


def length_bucket(context_len: int) -> str:
    lo = 0
    for hi in LENGTH_BUCKETS:
        if context_len < hi:
            return f"{lo}-{hi}"
        lo = hi
    return f"{lo}+"


@dataclass
class RequestStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    target_forwards: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    hidden_draft_time_s: float = 0.0

    def record(self, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float,
               hidden_s: float) -> None:
        self.steps += 1
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        for i in range(drafted):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s
        self.hidden_draft_time_s += hidden_s

    def merge(self, other: "RequestStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.target_forwards += other.target_forwards
        for i in range(len(other.drafted_at)):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += other.drafted_at[i]
            self.accepted_at[i] += other.accepted_at[i]
        self.draft_time_s += other.draft_time_s
        self.verify_time_s += other.verify_time_s
        self.hidden_draft_time_s += other.hidden_draft_time_s

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        exposed = self.draft_time_s - self.hidden_draft_time_s
        tau = self.emitted / steps if self.steps else 0.0
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "emitted_tokens": self.emitted,
            "mean_accepted_length": self.accepted / steps if self.steps else 0.0,
            "tokens_per_target_forward": tau,
            "target_forwards_per_token": self.target_forwards / self.emitted if self.emitted else 0.0,
            "first_token_acceptance_rate": (self.accepted_at[0] / self.drafted_at[0]) if self.drafted_at else 0.0,
            "acceptance_rate_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "draft_hit_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "drafted_tokens_per_step": self.drafted / steps if self.steps else 0.0,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "hidden_draft_time_s": self.hidden_draft_time_s,
            "hidden_draft_fraction": self.hidden_draft_time_s / self.draft_time_s if self.draft_time_s else 0.0,
            "estimated_speedup": (tau / (1.0 + exposed / self.verify_time_s)) if self.verify_time_s else 0.0,
        }


class EngineMetrics:
    """Aggregates step records; thread-safe (the server reads while the engine steps)."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self._lock = threading.Lock()
        self.total = RequestStats()
        self.by_tag: dict[str, RequestStats] = {}
        self.by_length: dict[str, RequestStats] = {}
        self.by_group: dict[tuple[str, str], RequestStats] = {}   # (tag, length bucket): Prometheus series
        self._recent: deque[tuple[float, RequestStats]] = deque()
        self.finished: dict[str, int] = {}
        self.preemptions = 0
        self.prompt_tokens = 0
        self.pre_drafts_made = 0
        self.pre_drafts_used = 0
        self.plan_time_s = 0.0        # host time the draft-length policy spent planning

    def record_step(self, tag: str, context_len: int, drafted: int, accepted: int, emitted: int,
                    draft_s: float, verify_s: float, hidden_s: float) -> None:
        one = RequestStats()
        one.record(drafted, accepted, emitted, draft_s, verify_s, hidden_s)
        now = time.monotonic()
        with self._lock:
            self.total.merge(one)
            self.by_tag.setdefault(tag, RequestStats()).merge(one)
            self.by_length.setdefault(length_bucket(context_len), RequestStats()).merge(one)
            self.by_group.setdefault((tag, length_bucket(context_len)), RequestStats()).merge(one)
            self._recent.append((now, one))
            while self._recent and now - self._recent[0][0] > self.window_s:
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

    def window(self) -> RequestStats:
        now = time.monotonic()
        out = RequestStats()
        with self._lock:
            for t, s in self._recent:
                if now - t <= self.window_s:
                    out.merge(s)
        return out

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
            }
        snap["window"] = {"seconds": self.window_s, **self.window().summary()}
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
        for name, attr, help_ in (("spec_steps_total", "steps", "Speculative steps (target verifications)"),
                                  ("draft_tokens_total", "drafted", "Draft tokens proposed"),
                                  ("accepted_tokens_total", "accepted", "Draft tokens accepted"),
                                  ("emitted_tokens_total", "emitted", "Tokens emitted")):
            metric(name, "counter", help_, [(lab, getattr(s, attr)) for lab, s in groups])
        for name, key, help_ in (("mean_accepted_length", "mean_accepted_length", "Accepted drafts per step"),
                                 ("acceptance_rate", "draft_hit_rate", "Accepted / drafted"),
                                 ("tokens_per_target_forward", "tokens_per_target_forward",
                                  "Emitted tokens per target forward"),
                                 ("estimated_speedup", "estimated_speedup",
                                  "Estimated speedup over autoregressive decoding")):
            metric(name, "gauge", help_, [(lab, s.summary()[key]) for lab, s in groups])
        metric("position_acceptance_rate", "gauge", "Acceptance rate at each draft position",
               [({"position": str(i)}, a / d if d else 0.0)
                for i, (a, d) in enumerate(zip(total.accepted_at, total.drafted_at))])
        for name, attr, help_ in (("draft_seconds_total", "draft_time_s", "Time spent drafting"),
                                  ("verify_seconds_total", "verify_time_s", "Time spent in target verification"),
                                  ("hidden_draft_seconds_total", "hidden_draft_time_s",
                                   "Draft time hidden behind verification")):
            metric(name, "counter", help_, [({}, getattr(total, attr))])
        win = self.window().summary()
        metric("window_acceptance_rate", "gauge", f"Acceptance rate over the last {self.window_s:g}s",
               [({}, win["draft_hit_rate"])])
        metric("requests_finished_total", "counter", "Finished requests by reason",
               [({"reason": r}, n) for r, n in sorted(finished.items())])
        metric("preemptions_total", "counter", "Requests preempted when the KV cache ran out", [({}, preemptions)])
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
