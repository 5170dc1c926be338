"""Input builders shared by the CPU-vs-reference and CUDA-vs-CPU kernel tests."""
from __future__ import annotations

import torch

from specrt import reference


def greedy_case(b: int, v: int, k: int, g: torch.Generator, jitter: bool = False):
    """(logits [B,K+1,V], draft ids [B,K], num_draft_tokens [B]) for verify_greedy.

    Integer logits give plenty of ties (``jitter`` adds 0.25 to half of them: fewer, still
    many); 10% NaN; row (2, 0) entirely NaN (-> token 0). Row 0 drafts exactly the argmaxes
    of all K positions (everything accepted); odd rows get one wrong draft somewhere."""
    logits = torch.randint(-3, 3, (b, k + 1, v), generator=g).float()
    if jitter:
        logits = logits + torch.where(torch.rand(b, k + 1, v, generator=g) < 0.5, 0.0, 0.25)
    logits[torch.rand(b, k + 1, v, generator=g) < 0.1] = float("nan")
    if b > 2:
        logits[2, 0] = float("nan")
    best = reference.argmax_nan_low(logits)
    nd = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
    nd[0] = k
    ids = torch.full((b, k), -1, dtype=torch.int32)
    for r in range(b):
        n = int(nd[r])
        ids[r, :n] = best[r, :n].int()
        if n and r % 2:
            j = int(torch.randint(0, n, (1,), generator=g))
            ids[r, j] = (best[r, j] + 1) % v
    return logits, ids, nd
