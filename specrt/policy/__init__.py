"""Draft length: how many tokens each request drafts this step.

- ``base``: the interface and the fixed / confidence / head policies;
- ``budget``: the batch-wide budget policy (its state), ``planner`` (its pure search),
  ``acceptance`` (the evidence it learns from), ``cost_model`` (measured step costs);
- ``tuning``: every tuning constant (the reasoning behind them: docs/policy.md).
"""
from specrt.config import SpecConfig
from specrt.policy.base import (ConfidencePolicy, DraftPolicy, FixedPolicy, HeadPolicy, RequestPolicyState,
                                ThresholdPolicy, recent_acceptance)
from specrt.policy.budget import BudgetPolicy
from specrt.policy.cost_model import CostModel

POLICY_CLASSES = {"fixed": FixedPolicy, "confidence": ConfidencePolicy, "head": HeadPolicy, "budget": BudgetPolicy}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICY_CLASSES[spec.policy](spec)


__all__ = ["BudgetPolicy", "ConfidencePolicy", "CostModel", "DraftPolicy", "FixedPolicy", "HeadPolicy",
           "POLICY_CLASSES", "RequestPolicyState", "ThresholdPolicy", "make_policy", "recent_acceptance"]
