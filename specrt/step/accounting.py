"""What one step cost, fed to the cost model and the statistics once its time is known.

The cost model learns the drafting time, the rest of the step as a verification sample, and a
steady plain step's whole time as an autoregressive sample. Each request's ``StepSample`` gets
its share of the step's time and, once plain steps were measured, what its emitted tokens
would have cost autoregressively as the machine runs now (the numerator of the speedup
estimate; specrt.observability.metrics, CostModel.plain_step_now).
"""
from __future__ import annotations

from specrt.drafters import DraftProposal
from specrt.observability.metrics import EngineMetrics, StepSample
from specrt.policy import CostModel
from specrt.step.scheduler import Request
from specrt.step.verify import VerifyBatch


def record_costs(costs: CostModel, vb: VerifyBatch, proposal: DraftProposal, step_s: float, total_s: float,
                 limit_s: float = 0.0) -> None:
    """The drafting, and everything else the step cost (planning, the verify forward, sampling,
    bookkeeping) as the verify sample, marked by whether anything was drafted (a multi-token
    verify can cost a jump over a plain decode step); ``total_s``: the whole step, admission
    included. A steady plain step less ``limit_s`` (the drafter's search for its max_ks, which an
    autoregressive engine never runs) is a sample of the autoregressive step time."""
    cost = proposal.cost
    draft_s = cost.measured_seconds() if cost.forwards else cost.seconds
    if cost.forwards:
        costs.add_draft(cost.forwards, cost.tokens_fed, cost.attended, draft_s)
    costs.add_verify(vb.num_query_tokens, vb.num_context_tokens, max(step_s - draft_s, 1e-9),
                     drafted=sum(proposal.num_draft_tokens) > 0, requests=len(vb.num_draft_tokens),
                     step_seconds=max(total_s - limit_s, 1e-9))


def record_samples(costs: CostModel, metrics: EngineMetrics, samples: list[tuple[Request, StepSample]],
                   vb: VerifyBatch, proposal: DraftProposal, step_s: float, speculative: bool,
                   limit_s: float = 0.0, untimed_s: float = 0.0) -> None:
    """Per request: its share of the step's time and, once plain decode steps were measured, its
    autoregressive estimate. A step that drafted nothing is a plain step: it costs what it
    measured (less ``limit_s``, the drafter's search for its max_ks). In a drafted step each token
    costs a share of one plain decode step over this batch as the machine runs now
    (``CostModel.plain_step_now``), and the first token of a request whose context the step fed
    the step's time besides drafting (the target's prefill is what autoregressive decoding pays
    too). ``untimed_s``: the engine's bookkeeping after the previous recorded step's time was
    taken; it counts in this step's measured time (the speculative engine spent it), not in a
    plain step's autoregressive cost."""
    n = len(vb.num_draft_tokens)
    drafted = sum(proposal.num_draft_tokens)
    t_next = costs.plain_step_now(n, vb.num_context_tokens) if speculative else None   # None: unmeasured
    if t_next is not None:
        if not drafted:
            t_next = max(step_s - limit_s, 1e-9)
        metrics.info["autoregressive_step_fit"] = costs.plain_fit_info()
        ar_tokens = vb.num_query_tokens - drafted                          # what a plain step feeds
        t_first = max(step_s - proposal.cost.seconds, 1e-9) if drafted and ar_tokens > n else t_next
    for r, sample in samples:
        sample.step_s = (step_s + untimed_s) / n
        if t_next is not None:
            sample.ar_est_s = (t_first + (sample.emitted - 1) * t_next) / n
        r.stats.add(sample)
        metrics.add(r.tag, sample)
