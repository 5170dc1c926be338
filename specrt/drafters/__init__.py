"""Drafters propose k tokens per request for the target to verify; one module per kind, one
interface (``base.Drafter``, with the optional capabilities ``base.ReadsTarget``,
``base.History`` and ``predraft.PreDrafting``); the ``draft=`` argument is parsed once
(``spec.parse_draft`` -> ``DraftSpec``) and the factory builds the drafter with the function
registered for its kind (``spec.register_drafter``: a new drafter is its module and that one line).

- ``model``: a separate small model sharing the target's vocabulary (its own KV cache, same
  block tables as the target), including its catch-up;
- ``predraft``: pre-drafting the next round while this one verifies (model, reduced, self:N);
- ``self_draft``: ``self:N``, the target's first N layers plus its final norm and head, reading
  and writing the target's own KV cache for those layers;
- ``ngram``: prompt lookup in the request's own context; no model;
- ``reduced``: a reduced-vocabulary DraftModel folder (a model draft whose head covers N of the
  target's tokens; the others get draft probability zero);
- ``feature``: an EAGLE-style feature DraftModel folder (reduced head too), fed the target's own
  final-normed hidden states from the verify forward (``ReadsTarget.observe_target``);
- ``size``: model sizes in bytes, and the start-up warning for a draft over ~1/3 of the target's weight bytes.
"""
from specrt.drafters.base import (DraftAsk, DraftCost, Drafter, DrafterState, DraftLimits, DraftProposal,
                                  DraftSettings, History, ReadsTarget, StopRule, no_drafts)
from specrt.drafters.factory import DraftContext, make_drafter
from specrt.drafters.feature import FeatureDrafter, TargetFeatures
from specrt.drafters.model import ModelDrafter
from specrt.drafters.ngram import NgramDrafter, NgramProposer, NgramState
from specrt.drafters.reduced import ReducedDrafter
from specrt.drafters.self_draft import SelfDrafter
from specrt.drafters.spec import DraftSpec, parse_draft, register_drafter
from specrt.drafters.size import DRAFT_SIZE_LIMIT, check_draft_size, module_bytes

__all__ = ["DRAFT_SIZE_LIMIT", "DraftAsk", "DraftContext", "DraftCost", "DraftLimits", "DraftProposal",
           "DraftSettings", "DraftSpec", "Drafter", "DrafterState", "FeatureDrafter", "History", "ModelDrafter",
           "NgramDrafter", "NgramProposer", "NgramState", "ReadsTarget", "ReducedDrafter", "SelfDrafter", "StopRule",
           "TargetFeatures", "check_draft_size", "make_drafter", "module_bytes", "no_drafts", "parse_draft",
           "register_drafter"]
