"""A reduced-vocabulary draft (specrt.models.draft_model.DraftModel, kind "layers"): a few
decoder layers on the target's own token embeddings, whose head covers only N of the target's
V tokens (FR-Spec, Zhao et al. 2025; the head is the target's tied embedding rows of those ids).

It drafts exactly like a separate draft model (ModelDrafter: its own paged KV cache on the
target's block tables, catch-up, pre-drafting); only its logits differ: they cover the N
mapped ids, and every other target token gets logit -inf, so its draft probability is exactly
zero. Rejection sampling stays exact: a token the draft cannot propose is still emitted through
the residual max(p - q, 0), which then carries all of its target probability. Greedy output
equals autoregressive decoding (the verification decides every token).
"""
from __future__ import annotations

import torch

from specrt.drafters.base import DraftSettings
from specrt.drafters.lookup import PromptLookup
from specrt.drafters.model import ModelDrafter
from specrt.drafters.size import module_bytes


class ReducedVocab:
    """A DraftModel's reduced head over the target's vocabulary, mixed into a network drafter
    (specrt.drafters.model.ModelDrafterBase): ReducedDrafter here, FeatureDrafter."""

    kind = "layers"           # the DraftModel kind it drafts with (a feature draft: FeatureDrafter)

    def __init__(self, draft, settings: DraftSettings, lookup: PromptLookup | None = None):
        """``draft``: a DraftModel bound to the target (``load_draft_for_target``); ``lookup``: see ModelDrafter."""
        cfg = draft.config
        if cfg.kind != self.kind:
            raise ValueError(f"{type(self).__name__} drafts with a {self.kind!r} draft, got kind {cfg.kind!r} "
                             f"(specrt.drafters.make_drafter picks the drafter for a draft folder)")
        if cfg.target_vocab_size != settings.vocab_size:
            raise ValueError(f"the draft maps into a vocabulary of {cfg.target_vocab_size} tokens, the target has "
                             f"{settings.vocab_size}")
        super().__init__(draft.causal_lm(), settings, lookup=lookup)
        self.draft = draft
        self._ids = draft.draft_to_target.to(settings.device)   # [N] target id of each draft logit

    def size_bytes(self) -> int | None:
        """Its layers, norm and reduced head (the embedding rows it reads are the target's, one per token)."""
        lm = self.model
        return module_bytes(*lm.model.layers, lm.model.norm, lm.lm_head)

    def draft_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self._ids[index]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, N] draft-vocabulary logits -> [rows, V]: -inf on every id the head does not cover."""
        out = logits.new_full((logits.shape[0], self.settings.vocab_size), float("-inf"))
        return out.index_copy_(1, self._ids, logits)


class ReducedDrafter(ReducedVocab, ModelDrafter):
    name = "reduced"

