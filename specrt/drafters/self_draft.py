"""``self:N``: the target's first N layers plus its final norm and head as the draft, reading
and writing the target's own KV cache for those layers (nothing duplicated, no catch-up: the
target's verify writes every position the draft reads).

Pre-drafting works as for a draft model, with one difference: the pre-draft reads the KV the
verification writes (the target's own layers), so on CUDA it runs after the verification on
the draft stream, and it never rewrites the slot of the last draft token (the verification wrote
the target's own K/V there). Its tokens are proposals only: a kept pre-draft holds no KV (the
next verification writes every position it verifies)."""
from __future__ import annotations

from specrt.drafters.base import DraftSettings
from specrt.drafters.lookup import PromptLookup
from specrt.drafters.model import ModelDrafter
from specrt.drafters.size import module_bytes


class SelfDrafter(ModelDrafter):
    name = "self"
    cache_name = "target"
    reads_target_kv = True

    def __init__(self, target, num_layers: int, settings: DraftSettings, lookup: PromptLookup | None = None):
        """``target``'s first ``num_layers`` layers draft; ``lookup``: see ModelDrafter."""
        if not 1 <= num_layers < target.config.num_layers:
            raise ValueError(f"draft='self:N' needs 1 <= N < {target.config.num_layers}, got {num_layers}")
        super().__init__(target, settings, num_layers=num_layers, lookup=lookup)

    def cache_configs(self) -> dict:
        return {}

    def size_bytes(self) -> int | None:
        """The first N layers, the final norm and the head (what one draft forward reads)."""
        model = self.model
        return module_bytes(*model.model.layers[:self.num_layers], model.model.norm, model.lm_head)

    def cached(self, r) -> int:
        return r.target_cached

    def catchup(self, batch) -> list[int]:
        return [0] * len(batch)

    def kept(self, request, row: int, proposal) -> int | None:
        return None                    # no KV of its own (a kept pre-draft's tokens: settle)
