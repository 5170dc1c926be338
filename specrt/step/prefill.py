"""Chunked prefill: a long prompt is fed a chunk per step, so the other requests keep decoding.

A request with more than ``chunk`` context tokens still to feed feeds exactly ``chunk`` of them
this step as a *prefill-only* request: its rows ride along in the step's target forward (their K/V
written, their hidden states handed to a feature drafter), nothing is scored or emitted, and it
does not draft. The step that feeds the rest (at most ``chunk`` tokens) is an ordinary step: it
ends with the request's first token. Chunk boundaries depend only on the request (where its
cached prefix ended, the chunk size), never on what else runs, so speculative and plain decoding
feed a prompt in the same pieces and compute the same bits.

The step's prompt tokens are capped at ``chunk`` in all: a prefilling request whose next chunk
does not fit waits for a later step (the first prefilling request always runs). A request that
scores its prompt (prompt_logprobs) is fed whole, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

from specrt.step.scheduler import Request
from specrt.step.verify import feeds_context, scores_prompt


@dataclass(frozen=True)
class PrefillSplit:
    """The running requests of one step, split by what they feed."""

    batch: list[Request]                   # ordinary requests: decoding, or feeding their last chunk
    prefill: list[tuple[Request, int]]     # prefill-only requests and the position their chunk ends at
    waiting: list[Request]                 # prefilling requests left for a later step (the budget)


def split_prefill(running: list[Request], chunk: int) -> PrefillSplit:
    """``running`` in order, split for a step that feeds at most ``chunk`` prompt tokens (0: no limit)."""
    if chunk <= 0:
        return PrefillSplit(list(running), [], [])
    batch, prefill, waiting = [], [], []
    budget, fed_any = chunk, False
    for r in running:
        if not feeds_context(r) or scores_prompt(r):
            batch.append(r)
            continue
        todo = r.context_len - r.target_cached
        n = min(chunk, todo)
        if fed_any and n > budget:
            waiting.append(r)
            continue
        budget, fed_any = budget - n, True
        if todo > chunk:
            prefill.append((r, r.target_cached + chunk))
        else:
            batch.append(r)
    return PrefillSplit(batch, prefill, waiting)
