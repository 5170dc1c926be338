"""Drafters propose K tokens per request for the target to verify; one module per kind, one
interface (``base.Drafter``), one factory reading the ``draft=`` argument (``factory``).

- ``model``: a separate small model sharing the target's vocabulary (its own KV cache, same
  block tables as the target), including its catch-up and the overlap pre-draft;
- ``self_draft``: ``self:N``, the target's first N layers plus its final norm and head, reading
  and writing the target's own KV cache for those layers;
- ``ngram``: prompt lookup in the request's own context; no model;
- ``reduced``: a reduced-vocabulary DraftModel folder (a model draft whose head covers N of the
  target's tokens; the others get draft probability zero).
"""
from specrt.drafters.base import (DraftCost, Drafter, DraftLimits, DraftProposal, DraftSettings, PreDraft,
                                  PreLength, StopRule, no_drafts)
from specrt.drafters.factory import make_drafter
from specrt.drafters.model import ModelDrafter, module_bytes
from specrt.drafters.ngram import NgramDrafter, NgramProposer, NgramState
from specrt.drafters.reduced import ReducedDrafter
from specrt.drafters.self_draft import SelfDrafter

__all__ = ["DraftCost", "DraftLimits", "DraftProposal", "DraftSettings", "Drafter", "ModelDrafter", "NgramDrafter",
           "NgramProposer", "NgramState", "PreDraft", "PreLength", "ReducedDrafter", "SelfDrafter", "StopRule",
           "make_drafter", "module_bytes", "no_drafts"]
