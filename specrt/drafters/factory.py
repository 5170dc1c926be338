"""The one place that reads the ``draft=`` argument.

    None / "none"        autoregressive decoding (no drafter)
    "ngram[:min[:max]]"  prompt lookup (specrt.drafters.ngram)
    "suffix[:k=v,...]"   suffix drafting over the request's and earlier requests' tokens (specrt.drafters.suffix)
    "MODEL+ngram" / "MODEL+suffix"   the lookup first, the model where nothing matched (specrt.drafters.lookup);
                         a model named alone gets SpecConfig.lookup in front (suffix by default)
    "self:N"             the target's first N layers (specrt.drafters.self_draft)
    "builtin" / folder   a draft model (specrt.drafters.model)
    a draft folder       a reduced-vocabulary DraftModel (config.json architectures ["SpecrtDraftModel"],
                         e.g. "smollm2-135m-draft"): specrt.drafters.reduced (kind "layers") or
                         specrt.drafters.feature (kind "feature": EAGLE-style, reads the target's states)

Adding a drafter is a new module plus a line here.
"""
from __future__ import annotations

from pathlib import Path

from specrt.drafters.base import Drafter, DraftSettings
from specrt.drafters.feature import FeatureDrafter
from specrt.drafters.lookup import make_lookup
from specrt.drafters.model import ModelDrafter
from specrt.drafters.ngram import NgramDrafter, NgramProposer
from specrt.drafters.reduced import ReducedDrafter
from specrt.drafters.self_draft import SelfDrafter
from specrt.drafters.suffix import SuffixDrafter, SuffixSettings
from specrt.loading import ModelLoader, resolve_model_path
from specrt.models import check_draft_compatible, load_generation_config
from specrt.models.draft_model import is_draft_folder, load_draft_for_target


def make_drafter(draft, target_path: Path, target, settings: DraftSettings, loader: ModelLoader, dtype,
                 accept_head: bool = False, lookup: str | None = None) -> Drafter | None:
    """The drafter for ``draft`` (None: no speculation). ``accept_head``: load the acceptance head
    stored beside a draft model (policy="head"); other drafters cannot have one. ``lookup``
    (SpecConfig.lookup): the lookup in front of a model drafter when ``draft`` names none."""
    kind = draft if isinstance(draft, str) else None
    named = kind is not None and "+" in kind
    if named:
        kind, lookup = kind.rsplit("+", 1)
    drafter = _make_one(kind if named else draft, kind, target_path, target, settings, loader, dtype, accept_head)
    if named and not isinstance(drafter, ModelDrafter):
        raise ValueError(f"draft={draft!r}: a lookup ('+ngram', '+suffix') goes in front of a draft model or "
                         f"self:N, not {kind!r}")
    if lookup is not None and isinstance(drafter, ModelDrafter):
        try:
            drafter.lookup = make_lookup(lookup, settings.coupled)
        except ValueError as e:
            raise ValueError(str(e) if named else f"lookup: {e}") from None
        drafter.name = f"{drafter.name}+{lookup.split(':', 1)[0]}"
    return drafter


def _make_one(draft, kind: str | None, target_path: Path, target, settings: DraftSettings, loader: ModelLoader,
              dtype, accept_head: bool) -> Drafter | None:
    """One drafter, no lookup in front."""
    if draft is None or kind == "none":
        drafter = None
    elif kind is not None and kind.startswith("ngram"):
        parts = kind.split(":")[1:]
        drafter = NgramDrafter(NgramProposer(*(int(p) for p in parts)) if parts else NgramProposer(), settings.device)
    elif kind is not None and kind.split(":", 1)[0] == "suffix":
        drafter = SuffixDrafter(SuffixSettings.parse(kind), settings.device, settings.coupled)
    elif kind is not None and kind.startswith("self:"):
        drafter = SelfDrafter(target, int(kind.split(":", 1)[1]), settings)
    else:
        draft_path = resolve_model_path(draft, "draft")
        if is_draft_folder(draft_path):
            if accept_head:
                raise ValueError("policy='head' needs a draft model with an acceptance head; a reduced-vocabulary "
                                 "draft has none")
            model = load_draft_for_target(draft_path, target, load_generation_config(target_path),
                                          getattr(loader, "draft_dtype", None), settings.device,
                                          getattr(loader, "quantize", None))
            return (FeatureDrafter if model.config.kind == "feature" else ReducedDrafter)(model, settings)
        check_draft_compatible(target_path, draft_path)
        model = loader(draft_path, "draft", dtype, settings.device)
        head = load_accept_head(draft_path, settings.device) if accept_head else None
        return ModelDrafter(model, settings, accept_head=head)
    if accept_head:
        raise ValueError("policy='head' needs a draft model with an acceptance head (accept_head/ beside it)")
    return drafter


def load_accept_head(draft_path: Path, device):
    from specrt.models.accept_head import AcceptanceHead

    head_dir = draft_path / "accept_head"
    if not head_dir.is_dir():
        raise ValueError(f"policy='head': no acceptance head at {head_dir} (train one with "
                         f"`python -m specrt.training.accept_head --target TARGET --draft {draft_path}`)")
    return AcceptanceHead.load(head_dir).to(device).eval()
