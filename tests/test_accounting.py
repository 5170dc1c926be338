"""What a step's accounting feeds the cost model: the autoregressive step time behind the runtime's
speedup estimate leaves out the drafter's search for its caps, which plain decoding never runs."""
from __future__ import annotations

from types import SimpleNamespace

from specrt.step.accounting import record_costs
from specrt.drafters import DraftCost, DraftProposal
from specrt.drafters.ngram import NgramDrafter, NgramProposer
from specrt.policy import CostModel


def _plain_step(costs: CostModel, total_s: float, limit_s: float) -> None:
    vb = SimpleNamespace(num_query_tokens=1, num_context_tokens=40, num_draft_tokens=[0])
    proposal = DraftProposal(None, [0], None, None, DraftCost())
    record_costs(costs, vb, proposal, step_s=total_s, total_s=total_s, limit_s=limit_s)


def test_plain_step_sample_leaves_out_the_drafters_search():
    costs = CostModel()
    for _ in range(3):                       # the first plain step after a drafted one is not steady
        _plain_step(costs, total_s=0.010, limit_s=0.002)
    assert [s[3] for s in costs.plain_samples] == [0.008, 0.008]
    assert all(abs(s[4] - 0.010) < 1e-12 for s in costs.verify_samples)   # the policy still sees the whole step


def test_ngram_limit_reports_its_search_time():
    drafter = NgramDrafter(NgramProposer(1, 4), "cpu")
    r = SimpleNamespace(request_id="a", token_ids=[5, 6, 7, 5, 6] * 50, drafter_state=None, evidence_class=None)
    limits = drafter.limit([r], [4])
    assert limits.max_ks == [4] and len(limits.known["a"]) == 4
    assert limits.seconds > 0
