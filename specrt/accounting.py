"""What one step cost, fed to the cost model and the statistics once its time is known.

The cost model learns the drafting time, the rest of the step as a verification sample, and a
steady plain step's whole time as an autoregressive sample. Each request's ``StepSample`` gets
its share of the step's time and, once plain steps were measured, what its emitted tokens
would have cost autoregressively (the numerator of the speedup estimate).
"""
from __future__ import annotations

from specrt.drafters import DraftProposal
from specrt.metrics import EngineMetrics, StepSample
from specrt.policy import CostModel
from specrt.scheduler import Request
from specrt.verify import VerifyBatch


def record_costs(costs: CostModel, vb: VerifyBatch, proposal: DraftProposal, step_s: float, total_s: float,
                 limit_s: float = 0.0) -> None:
    """The drafting, and everything else the step cost (planning, the verify forward, sampling,
    bookkeeping) as the verify sample, marked by whether anything was drafted (a multi-token
    verify can cost a jump over a plain decode step); ``total_s``: the whole step, admission
    included. A steady plain step less ``limit_s`` (the drafter's search for its caps, which an
    autoregressive engine never runs) is a sample of the autoregressive step time."""
    cost = proposal.cost
    draft_s = cost.measured_seconds() if cost.forwards else cost.seconds
    if cost.forwards:
        costs.add_draft(cost.forwards, cost.tokens_fed, cost.attended, draft_s)
    costs.add_verify(vb.num_query_tokens, vb.num_context_tokens, max(step_s - draft_s, 1e-9),
                     drafted=sum(proposal.num_draft_tokens) > 0, requests=len(vb.num_draft_tokens),
                     step_seconds=max(total_s - limit_s, 1e-9))


def record_samples(costs: CostModel, metrics: EngineMetrics, samples: list[tuple[Request, StepSample]],
                   vb: VerifyBatch, proposal: DraftProposal, step_s: float, speculative: bool) -> None:
    """Per request: its share of the step's time and its autoregressive estimate: each further
    token a plain decode step's share by the fit; the first token one plain step over this batch
    by the fit, or, in a step that prefills, this step's time besides drafting (the target's
    prefill is what autoregressive decoding pays too)."""
    n = len(vb.num_draft_tokens)
    t_next = costs.ar_step_time(n, vb.num_context_tokens, n) if speculative else None
    if t_next is not None:
        metrics.info["autoregressive_step_fit"] = costs.plain_fit_info()
        ar_tokens = vb.num_query_tokens - sum(proposal.num_draft_tokens)   # what a plain step feeds
        t_first = (max(step_s - proposal.cost.seconds, 1e-9) if ar_tokens > n
                   else costs.ar_step_time(ar_tokens, vb.num_context_tokens, n))
    for r, sample in samples:
        sample.step_s = step_s / n
        if t_next is not None:
            sample.ar_est_s = (t_first + (sample.emitted - 1) * t_next) / n
        r.stats.add(sample)
        metrics.add(r.tag, sample)
