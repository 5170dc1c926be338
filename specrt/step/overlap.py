"""Overlap: draft round N+1 while round N verifies, for a drafter that can (PreDrafting,
specrt.drafters.predraft; the engine checks it once, when it is built).

The next round's k per request is planned as the policy would plan it if every draft of this
round is accepted; its KV slots are reserved before the verification (copy-on-write copies
then precede it), and the pre-draft runs right after the verify forward was launched. On a
CPU nothing runs concurrently: the pre-draft only moves draft work earlier, and its host
time is reported so the step's accounting can take it out of the verification's. At the
commit each pre-draft is kept if all of round N was accepted and the bonus token is the one it
assumed (``settler``), else dropped; it never affects the output.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specrt.drafters import Drafter, DraftProposal, ReadsTarget
from specrt.drafters.predraft import PreDraft, PreDrafting
from specrt.observability.metrics import EngineMetrics
from specrt.policy import DraftPolicy
from specrt.step.scheduler import Request
from specrt.step.verify import VerifyResult

logger = logging.getLogger("specrt.engine")


@dataclass
class OverlapStatus:
    """Whether pre-drafting runs, and why not when it was asked for and cannot (shown in stats)."""
    requested: bool
    active: bool = False
    note: str = ""

    def as_dict(self) -> dict:
        return {"requested": self.requested, "active": self.active, "note": self.note}


@dataclass
class PrePlan:
    """The next round's pre-draft plan for one step's batch (rows as in the batch)."""
    ks_ahead: list[int]                # [B] the next round's k; 0: no pre-draft for that row
    stops: list | None                 # [B] the policy's early-stop rule per pre-draft, or None


def overlap_status(requested: bool, drafter: Drafter | None, device: torch.device) -> OverlapStatus:
    """Logs once (a warning) when overlap was asked for and does nothing."""
    status = OverlapStatus(requested)
    if not requested:
        return status
    if drafter is None:
        status.note = "no drafter: nothing to pre-draft"
    elif isinstance(drafter, ReadsTarget) and not isinstance(drafter, PreDrafting):
        status.note = (f"the {drafter.name} drafter reads the verification's hidden states, so it cannot draft "
                       f"the next round before the verification: overlap does nothing")
    elif not isinstance(drafter, PreDrafting):
        status.note = (f"the {drafter.name} drafter has no model to run ahead (its proposals cost "
                       f"microseconds): overlap does nothing")
    else:
        status.active = True
        if device.type != "cuda":
            status.note = "on a CPU nothing runs concurrently: pre-drafting only moves draft work earlier"
        elif drafter.reads_target_kv:
            status.note = ("self:N pre-drafts read the target's KV: on CUDA they run after the "
                           "verification (the guess is ready with it; only the rest overlaps the host)")
    if not status.active:
        logger.warning("overlap=True has no effect: %s", status.note)
    return status


class Overlap:
    """Plans, runs and settles one step's pre-drafts for an engine whose overlap is active."""

    def __init__(self, drafter: PreDrafting, policy: DraftPolicy, device: torch.device,
                 max_k: Callable[[Request, int], int]):
        self.drafter, self.policy, self.device, self.max_k = drafter, policy, device, max_k

    def fence(self) -> None:
        """Before the step's first KV write: it waits for a pre-draft still running (CUDA)."""
        self.drafter.fence()

    def mark_verify(self) -> None:
        """Right before the verification is enqueued: what the pre-draft will wait for."""
        self.drafter.mark_verify()

    def plan(self, batch: list[Request], ks: list[int], proposal: DraftProposal) -> PrePlan:
        """The next K per request (0: none) if all of this round's drafts are accepted, the stop
        rules the policy would apply, and their KV slots (reserved now, before the verify)."""
        ks_ahead, stops = [], []
        for r, n, k in zip(batch, proposal.num_draft_tokens, ks):
            ahead = self.policy.k_ahead(r, k, n, self.max_k(r, n + 1)) if n > 0 else 0
            ks_ahead.append(ahead)
            stops.append(self.policy.stop_rule_ahead(r, n) if ahead else None)
        if not any(ks_ahead):
            return PrePlan(ks_ahead, None)
        return PrePlan(self.drafter.reserve_pre_draft(batch, proposal, ks_ahead), stops)

    def run(self, batch: list[Request], proposal: DraftProposal,
            plan: PrePlan) -> tuple[dict[int, PreDraft], float]:
        """Draft the next round for the planned rows, assuming every draft is accepted. Returns
        ({row: PreDraft}, the host seconds it added on a CPU, where nothing overlaps)."""
        if not any(plan.ks_ahead):
            return {}, 0.0
        t0 = time.perf_counter()
        pre = self.drafter.pre_draft(batch, proposal, plan.ks_ahead, plan.stops, self.policy.replayed_length)
        return pre, (time.perf_counter() - t0 if self.device.type == "cpu" else 0.0)

    def settler(self, pre: dict[int, PreDraft], proposal: DraftProposal, result: VerifyResult,
                metrics: EngineMetrics) -> Callable[[Request, int, int | None], tuple[int | None, float, float]]:
        """The commit's per-request hook (specrt.step.commit.commit_step ``settle``): keeps or drops row
        b's pre-draft and returns (positions its draft KV holds, the pre-draft's host seconds, of
        which hidden behind the verification). Records the pre-drafts made, and those this step's
        proposal used."""
        for _ in range(proposal.reused):
            metrics.record_overlap(used=True)
        cuda = self.device.type == "cuda"

        def settle(r: Request, b: int, held: int | None) -> tuple[int | None, float, float]:
            p = pre.get(b)
            if p is None:
                return held, 0.0, 0.0
            a = result.num_accepted[b]
            kept = a == proposal.num_draft_tokens[b] and result.output_token_ids[b][a] == result.guesses[b]
            metrics.record_overlap(used=False)
            return self.drafter.settle(r, p, kept, held), p.seconds, (p.seconds if kept and cuda else 0.0)
        return settle
