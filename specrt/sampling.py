"""The per-row inputs of the sampling transform, shared by draft and target rows.

Draft and target rows of a request always get the same parameters (a mismatch silently
ruins acceptance) and the same ``min_tokens`` EOS mask, so they sample from the same
constrained distribution.
"""
from __future__ import annotations

import torch

from specrt.config import SamplingParams

_INT32_MAX = 2 ** 31 - 1
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def param_rows(params: list[SamplingParams], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(temperature [R] f32, top_k [R] i32, top_p [R] f32): request i's parameters repeated counts[i]
    times. Values beyond the kernels' types mean the same clamped (a top_k >= the vocabulary keeps
    every token; a temperature beyond float32 flattens the distribution like the largest one), so
    no request's parameters can break its batch's step."""
    temps, topk, topp = [], [], []
    for p, c in zip(params, counts):
        temps += [min(p.temperature, _FLOAT32_MAX)] * c
        topk += [min(p.top_k, _INT32_MAX)] * c
        topp += [p.top_p] * c
    return (torch.tensor(temps, dtype=torch.float32).to(device, non_blocking=True),
            torch.tensor(topk, dtype=torch.int32).to(device, non_blocking=True),
            torch.tensor(topp, dtype=torch.float32).to(device, non_blocking=True))


def mask_eos(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
             eos_token_ids: list[int]) -> None:
    """min_tokens, in place: the EOS logits of row i are -inf when it would emit output token
    #output_index[i] < params[i].min_tokens."""
    rows = [i for i, (oi, p) in enumerate(zip(output_index, params)) if oi < p.min_tokens]
    if rows and eos_token_ids:
        eos = [e for e in eos_token_ids if e < logits.shape[1]]
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits[idx[:, None], torch.tensor(eos, dtype=torch.int64, device=logits.device)[None, :]] = float("-inf")


def pad_rows(rows: torch.Tensor, counts: list[int], kmax: int, pad_index: torch.Tensor) -> torch.Tensor:
    """The ragged [R, V] rows (request b's counts[b] rows in order) as [B, K+1, V]. A row past a
    request's drafts + 1 is never read by the verify kernels, so it is left unwritten (no memset
    of B*(K+1)*V values); with every request at K+1 rows the view alone."""
    B, V = len(counts), rows.shape[1]
    if all(c == kmax + 1 for c in counts):
        return rows.view(B, kmax + 1, V)
    padded = rows.new_empty(B * (kmax + 1), V)
    padded[pad_index] = rows
    return padded.view(B, kmax + 1, V)
