"""The design's draft-size limit: a draft forward that reads over ~1/3 of the target's weight
bytes rarely pays for itself, so the engine warns at start-up."""
from __future__ import annotations

import logging

from torch import nn

from specrt.drafters.base import Drafter
from specrt.drafters.model import module_bytes

logger = logging.getLogger("specrt.engine")

DRAFT_SIZE_LIMIT = 1 / 3     # draft weight bytes / target's above which the engine warns


def check_draft_size(drafter: Drafter | None, target: nn.Module) -> dict | None:
    """Warn when the draft is over the limit. Returns the sizes (for stats), None without a
    drafter that runs a model."""
    draft = drafter.size_bytes() if drafter is not None else None
    if draft is None:
        return None
    target_bytes = module_bytes(target)
    ratio = draft / max(target_bytes, 1)
    if ratio > DRAFT_SIZE_LIMIT:
        logger.warning("the draft (%s, %.1f MB of weights) is %.0f%% of the target's %.1f MB: over ~1/3 a "
                       "draft rarely pays for itself (use a smaller or quantized draft, or fewer self:N layers)",
                       drafter.name, draft / 1e6, 100 * ratio, target_bytes / 1e6)
    return {"draft_bytes": draft, "target_bytes": target_bytes, "ratio": ratio, "over_limit": ratio > DRAFT_SIZE_LIMIT}
