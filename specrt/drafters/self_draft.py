"""``self:N``: the target's first N layers plus its final norm and head as the draft, reading
and writing the target's own KV cache for those layers (nothing duplicated, no catch-up: the
target's verify writes every position the draft reads)."""
from __future__ import annotations

from specrt.drafters.base import Drafter, DraftSettings
from specrt.drafters.model import ModelDrafter


class SelfDrafter(ModelDrafter):
    name = "self"
    cache_name = "target"

    def __init__(self, target, num_layers: int, settings: DraftSettings):
        if not 1 <= num_layers < target.config.num_layers:
            raise ValueError(f"draft='self:N' needs 1 <= N < {target.config.num_layers}, got {num_layers}")
        super().__init__(target, settings, num_layers=num_layers)

    def cache_configs(self) -> dict:
        return {}

    def cached(self, r) -> int:
        return r.target_cached

    def catchup(self, batch) -> list[int]:
        return [0] * len(batch)

    # no overlap pre-drafts and no KV of its own
    pre_draft = Drafter.pre_draft
    on_commit = Drafter.on_commit
