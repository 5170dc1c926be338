"""Builds the drafter a ``draft=`` argument asks for, from its parsed record
(specrt.drafters.spec.DraftSpec; the spellings are listed there), with the function registered
for its kind (``register_drafter``; the built-in kinds' lines are at the end of this module).

    kind "none"          no drafter
    kind "ngram"         prompt lookup (specrt.drafters.ngram)
    kind "suffix"        suffix drafting (specrt.drafters.suffix)
    kind "self"          the target's first N layers (specrt.drafters.self_draft)
    kind "model"         a draft model (specrt.drafters.model), or a reduced-vocabulary DraftModel folder
                         (config.json architectures ["SpecrtDraftModel"], e.g. "smollm2-135m-draft"):
                         specrt.drafters.reduced (kind "layers") or specrt.drafters.feature (kind
                         "feature": EAGLE-style, reads the target's states)
    spec.lookup          the lookup in front of a model or self:N drafter (specrt.drafters.lookup)

Adding a drafter is a new module and one ``register_drafter(NAME, build)`` line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specrt.drafters.base import Drafter, DraftSettings
from specrt.drafters.feature import FeatureDrafter
from specrt.drafters.lookup import PromptLookup, make_lookup
from specrt.drafters.model import ModelDrafter
from specrt.drafters.ngram import NgramDrafter, NgramProposer
from specrt.drafters.reduced import ReducedDrafter
from specrt.drafters.self_draft import SelfDrafter
from specrt.drafters.spec import DraftSpec, drafter_builder, register_drafter
from specrt.drafters.suffix import SuffixDrafter, SuffixSettings
from specrt.models import check_draft_compatible, load_generation_config
from specrt.models.draft_model import is_draft_folder, load_draft_for_target
from specrt.models.sources import DraftLoader, resolve_model_path


@dataclass(frozen=True)
class DraftContext:
    """What a drafter's builder gets beside its DraftSpec (specrt.drafters.spec.register_drafter)."""

    settings: DraftSettings
    target: torch.nn.Module              # the target model (self:N drafts with its first layers)
    target_path: Path                    # its folder (a draft model is checked against it)
    loader: DraftLoader                  # how a draft model loads (its quantization and dtype)
    dtype: torch.dtype | None = None     # the engine's dtype
    accept_head: bool = False            # policy="head": load the acceptance head stored beside a draft model
    lookup: PromptLookup | None = None   # the lookup in front of a model or self:N drafter (None: none)


def make_drafter(spec: DraftSpec, target_path: Path, target, settings: DraftSettings, loader: DraftLoader, dtype,
                 accept_head: bool = False) -> Drafter | None:
    """The drafter ``spec`` asks for (None: no speculation). ``accept_head``: load the acceptance
    head stored beside a draft model (policy="head"); other drafters cannot have one. ``loader``:
    how a draft model loads (its quantization and dtype, honoured by a DraftModel folder too)."""
    lookup = _make_lookup(spec, settings) if spec.takes_lookup else None
    ctx = DraftContext(settings, target, target_path, loader, dtype, accept_head, lookup)
    drafter = None if spec.kind == "none" else drafter_builder(spec.kind)(spec, ctx)
    if accept_head and spec.kind != "model":
        raise ValueError("policy='head' needs a draft model with an acceptance head (accept_head/ beside it)")
    return drafter


def _make_lookup(spec: DraftSpec, settings: DraftSettings) -> PromptLookup | None:
    """The lookup in front of a model or self:N drafter; a bad one named in ``draft=`` raises as
    it is, one from SpecConfig.lookup with "lookup: " in front."""
    if spec.lookup_spec is None:
        return None
    try:
        return make_lookup(spec.lookup_spec, settings.coupled)
    except ValueError as e:
        raise ValueError(str(e) if spec.lookup_named else f"lookup: {e}") from None


def _ngram(spec: DraftSpec, ctx: DraftContext) -> NgramDrafter:
    proposer = NgramProposer(*spec.ngram_sizes) if spec.ngram_sizes else NgramProposer()
    return NgramDrafter(proposer, ctx.settings.device)


def _model_drafter(spec: DraftSpec, ctx: DraftContext) -> ModelDrafter | FeatureDrafter:
    """A draft model's drafter: a DraftModel folder (reduced or feature) or a model of the target's vocabulary."""
    settings = ctx.settings
    draft_path = resolve_model_path(spec.source, "draft")
    if is_draft_folder(draft_path):
        if ctx.accept_head:
            raise ValueError("policy='head' needs a draft model with an acceptance head; a reduced-vocabulary "
                             "draft has none")
        model = load_draft_for_target(draft_path, ctx.target, load_generation_config(ctx.target_path),
                                      ctx.loader.dtype, settings.device, ctx.loader.quantize)
        cls = FeatureDrafter if model.config.kind == "feature" else ReducedDrafter
        return cls(model, settings, lookup=ctx.lookup)
    check_draft_compatible(ctx.target_path, draft_path)
    model = ctx.loader.load(draft_path, "draft", ctx.dtype, settings.device)
    head = load_accept_head(draft_path, settings.device) if ctx.accept_head else None
    return ModelDrafter(model, settings, accept_head=head, lookup=ctx.lookup)


def load_accept_head(draft_path: Path, device):
    """The acceptance head stored in ``draft_path``/accept_head (policy="head"); ValueError naming
    the command that trains one when there is none."""
    from specrt.models.accept_head import AcceptanceHead

    head_dir = draft_path / "accept_head"
    if not head_dir.is_dir():
        raise ValueError(f"policy='head': no acceptance head at {head_dir} (train one with "
                         f"`python -m specrt.training.accept_head --target TARGET --draft {draft_path}`)")
    return AcceptanceHead.load(head_dir).to(device).eval()


register_drafter("ngram", _ngram)
register_drafter("suffix", lambda spec, ctx: SuffixDrafter(SuffixSettings.parse(spec.suffix), ctx.settings.device,
                                                           ctx.settings.coupled))
register_drafter("self", lambda spec, ctx: SelfDrafter(ctx.target, spec.self_layers, ctx.settings, lookup=ctx.lookup))
register_drafter("model", _model_drafter)
