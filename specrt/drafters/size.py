"""Model sizes in bytes (``module_bytes``) and the design's draft-size limit: a draft forward that
reads over ~1/3 of the target's weight bytes rarely pays for itself, so the engine warns at start-up."""
from __future__ import annotations

import itertools
import logging

from torch import nn

from specrt.drafters.base import Drafter

logger = logging.getLogger("specrt.engine")

DRAFT_SIZE_LIMIT = 1 / 3     # draft weight bytes / target's above which the engine warns


def module_bytes(*modules) -> int:
    """Bytes of the modules' parameters and buffers: the union of the memory ranges they view, so
    tied or fused weights count once, and a weight arena (one storage holding every projection,
    rounded up to huge pages) counts only the bytes its tensors use."""
    spans = sorted({(t.device, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                    for t in itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers())
                                                           for m in modules) if t.numel()},
                   key=lambda s: (str(s[0]), s[1]))
    total, end, dev = 0, None, None
    for d, lo, hi in spans:
        if d != dev or end is None or lo >= end:
            total += hi - lo
            dev, end = d, hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


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
