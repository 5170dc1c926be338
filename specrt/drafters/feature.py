"""An EAGLE-style feature draft (Li et al. 2024; specrt.models.draft_model.DraftModel, kind
"feature"): one decoder layer fed ``fc(concat(embed(x_p), f_{p-1}))``, where f is the target's
final-normed hidden state, with a reduced-vocabulary head as ReducedDrafter's.

No extra target forward: the engine asks the target's verify forward for every fed row's
final-normed state (the drafter is a ``ReadsTarget``) and hands it over (``observe_target``). Per request
the drafter keeps the features of positions it has not consumed yet (``TargetFeatures`` in
``request.drafter_state``: views of those hidden tensors, trimmed at every commit to what the
target accepted and the draft still needs, so memory stays bounded by the draft's lag).

A proposal (the ModelDrafterBase loop) for a request whose draft KV holds [0, c), context length L+1
(the pending token at position L):

* catch-up: ONE forward over positions c..L fed the features of positions c-1..L-1 (position -1,
  and any position whose feature this request never saw, reads zeros), logits at L;
* K-1 one-token forwards, each fed the draft's OWN final-normed state of the previous position.

Only the catch-up's keys came from true features, so its DraftProposal.draft_cached is L+1
(not L+1+j): the next catch-up rewrites the keys the own-feature steps wrote. A position whose
true feature is unknown (a prefix-shared block whose prompt rows this request did not compute,
a preempted request's recomputed context, ...) reads a zero feature: acceptance may drop there,
the output stays exact (the verification decides every token).

No pre-drafting (it is no specrt.drafters.predraft.PreDrafting): the next round's catch-up needs
this round's verified features, which exist only after the verification.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specrt.drafters.base import DraftProposal, DrafterState, DraftSettings, ReadsTarget
from specrt.drafters.size import module_bytes
from specrt.drafters.lookup import PromptLookup
from specrt.drafters.model import ModelDrafterBase
from specrt.drafters.reduced import ReducedVocab

MAX_SPANS = 16     # spans a request keeps before they are merged into one (one copy of its lag)


@dataclass(frozen=True)
class FeatureSpan:
    """The target's features of consecutive positions."""

    first: int                  # position of row 0
    states: torch.Tensor        # [n, H] final-normed target states at positions first .. first + n - 1

    @property
    def end(self) -> int:
        return self.first + self.states.shape[0]


@dataclass(frozen=True)
class TargetFeatures(DrafterState):
    """A FeatureDrafter's ``request.drafter_state``: the features of positions it has not consumed
    yet (immutable: every change makes a new record, so Scheduler.restore puts back the old one)."""

    spans: tuple[FeatureSpan, ...] = ()   # ascending, non-overlapping; gaps are unknown positions

    def add(self, span: FeatureSpan) -> "TargetFeatures":
        """The newest features win: positions from ``span.first`` on are replaced."""
        if not self.spans or span.first >= self.spans[-1].end:   # new positions only (a plain step)
            return TargetFeatures(self.spans + (span,))
        kept = tuple(FeatureSpan(s.first, s.states[:span.first - s.first]) for s in self.spans if s.first < span.first)
        return TargetFeatures(tuple(s for s in kept if s.states.shape[0]) + (span,))

    def keep(self, lo: int, hi: int) -> "TargetFeatures":
        """Only positions [lo, hi) (merged into one span when there are many)."""
        if self.spans and self.spans[0].first >= lo and self.spans[-1].end <= hi and len(self.spans) <= MAX_SPANS:
            return self   # nothing outside [lo, hi): the common case while drafting is off
        spans = tuple(FeatureSpan(max(s.first, lo), s.states[max(lo - s.first, 0):hi - s.first])
                      for s in self.spans if s.end > lo and s.first < hi)
        if len(spans) > MAX_SPANS:
            first = spans[0].first
            spans = (FeatureSpan(first, self.gather(first, spans[-1].end)),)
        return TargetFeatures(spans)

    def gather(self, lo: int, hi: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """[hi - lo, H] the features of positions lo..hi-1, zeros where unknown (``like``: a tensor
        of the dtype and device the zeros take when no span has any)."""
        ref = self.spans[0].states if self.spans else like
        parts, at = [], lo
        for s in self.spans:
            a, b = max(at, s.first), min(hi, s.end)
            if a >= b:
                continue
            if a > at:
                parts.append(ref.new_zeros(a - at, ref.shape[-1]))
            parts.append(s.states[a - s.first:b - s.first])
            at = b
        if at < hi:
            parts.append(ref.new_zeros(hi - at, ref.shape[-1]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class FeatureDrafter(ReducedVocab, ModelDrafterBase, ReadsTarget):
    name = "feature"
    kind = "feature"

    def __init__(self, draft, settings: DraftSettings, lookup: PromptLookup | None = None):
        """``draft``: a feature DraftModel bound to the target (``load_draft_for_target``); ``lookup``: see ModelDrafter."""
        super().__init__(draft, settings, lookup=lookup)
        H = draft.config.feature_size
        self.target_hidden_layers = draft.config.feature_layers  # EAGLE-3: the layers the verify returns
        # the zeros of unknown features before any verify was seen (later: the target's dtype)
        self._blank = torch.zeros(0, H, dtype=draft.norm.weight.dtype, device=settings.device)

    def size_bytes(self) -> int | None:
        """fc, its layers, norm and reduced head (the embedding rows it reads are the target's)."""
        lm = self.model
        extra = (self.draft.fuse,) if self.draft.fuse is not None else ()
        return module_bytes(self.draft.fc, *extra, *lm.model.layers, lm.model.norm, lm.lm_head)

    def step_model(self) -> tuple[nn.Module, int | None]:
        return FeatureStep(self.draft), None

    # -- the target's features
    def observe_target(self, batch, vb, hidden: torch.Tensor) -> None:
        """Keep every fed row's state [n_b, H] (views of ``hidden`` [T, H]) per request."""
        if self._blank.dtype != hidden.dtype or self._blank.device != hidden.device:
            self._blank = hidden.new_zeros(0, hidden.shape[1])
        for b, r in enumerate(batch):
            start, n = vb.query_start[b], vb.attn_metadata.query_lens_host[b]
            span = FeatureSpan(vb.query_position[b], hidden[start:start + n])
            r.drafter_state = _features(r).add(span)

    def kept(self, request, row: int, proposal: DraftProposal) -> int | None:
        """The draft KV holds true-feature keys below ``held``; the next catch-up reads the features
        of positions held-1 .. target_cached-1 (the verified ones): keep only those."""
        held = min(proposal.draft_cached[row], request.target_cached)
        request.drafter_state = _features(request).keep(held - 1, request.target_cached)
        return held

    # -- the drafting loop's hooks (ModelDrafterBase._draft)
    def _step_features(self, reqs, starts: list[int] | None, prev_hidden, sel) -> torch.Tensor:
        if starts is None:           # one token past the last forward: the draft's own state there
            return prev_hidden.index_select(0, sel)
        parts = [_features(r).gather(c - 1, r.context_len - 1, self._blank) for r, c in zip(reqs, starts)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)   # [catch-up rows, H]

    def _run_model(self, input_ids, positions, meta, last, features):
        return self.draft(input_ids, positions, meta, self.kv[self.cache_name], features=features,
                          logits_indices=last)

    def _draft(self, batch, ks: list[int], K: int, stop_rule) -> DraftProposal:
        proposal = super()._draft(batch, ks, K, stop_rule)
        # keys at context_len and later came from the draft's own features: not kept past the commit
        proposal.draft_cached = [min(d, r.context_len) for d, r in zip(proposal.draft_cached, batch)]
        return proposal


def _features(r) -> TargetFeatures:
    state = r.drafter_state
    return state if isinstance(state, TargetFeatures) else TargetFeatures()


class FeatureStep(nn.Module):
    """The network one feature-draft step runs, as a plain forward (the bench's cost hint,
    ``Drafter.step_model``): fc over [embedding, a zero feature] -> the layers -> norm -> the
    reduced head."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft
        self.config = draft.lm_config

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.draft.norm.weight.device

    def forward(self, input_ids, positions, meta, kv_cache, num_layers: int | None = None, logits_indices=None):
        features = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype, device=self.device)
        return self.draft(input_ids, positions, meta, kv_cache, features=features, logits_indices=logits_indices)
