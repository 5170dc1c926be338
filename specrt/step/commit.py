"""Commit one verified step: keep what was accepted, roll back the rest, emit, check stops.

Per request (row b) with n drafts of which a were accepted: the target's KV now holds
[0, context_len + a); the drafter says what its own cache holds (``on_commit``, then
``settle`` for draft work made during the step for the next one: specrt.step.overlap); the surplus
KV slots are rolled back (the block table is truncated, nothing copied); a + 1 tokens are
appended, and the request's full blocks are registered for prefix sharing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from specrt.drafters import Drafter, DraftProposal
from specrt.drafters.tree import node_depths
from specrt.models.attention import copy_slots
from specrt.models.kv_cache import PagedKVCache
from specrt.observability.metrics import StepSample
from specrt.step.scheduler import Request
from specrt.step.verify import VerifyResult, commit_logprobs

logger = logging.getLogger("specrt.engine")


@dataclass
class CommitContext:
    """What a commit writes to and checks against (fixed for an engine's KV cache)."""
    kv: PagedKVCache
    drafter: Drafter | None
    eos_token_ids: list[int]
    max_model_len: int
    decode: Callable[[list[int]], str]


# settle(request, row, held) -> (positions the drafter's KV holds, host seconds of draft work made during
# the step for the next one, of which hidden behind the verification): specrt.step.overlap.Overlap.settler
Settle = Callable[[Request, int, "int | None"], "tuple[int | None, float, float]"]


@dataclass
class Ended:
    """A request the commit finished (stop, length) or failed (its bookkeeping raised)."""
    request: Request
    reason: str
    error: str | None = None


def commit_step(ctx: CommitContext, batch: list[Request], proposal: DraftProposal, result: VerifyResult,
                verify_s: float, settle: Settle | None = None) -> tuple[list[tuple[Request, StepSample]], list[Ended]]:
    """Commit every request of the step; one whose bookkeeping raises (e.g. its text cannot be
    decoded) fails alone. Returns [(request, StepSample)] for the statistics (recorded once the
    step's time is known) and the requests that ended, in batch order. ``settle``: the hook of
    draft work made during the step for the next one (None: there is none)."""
    if result.accepted_nodes is not None:
        _move_paths(ctx.kv, batch, result.accepted_nodes)
    drafted_total, verify_share = max(sum(proposal.num_draft_tokens), 1), verify_s / len(batch)
    samples, ended = [], []
    for b, r in enumerate(batch):
        try:
            sample, reason = _commit_one(ctx, r, b, proposal, result, drafted_total, verify_share, settle)
            samples.append((r, sample))
            if reason is not None:
                ended.append(Ended(r, reason))
        except Exception as e:   # noqa: BLE001 - attributable to this request alone
            logger.warning("request %s failed: %s", r.request_id, e, exc_info=True)
            ended.append(Ended(r, "error", f"{type(e).__name__}: {e}"))
    return samples, ended


def _move_paths(kv: PagedKVCache, batch: list[Request], accepted_nodes: list[list[int]]) -> None:
    """A tree step: each request's accepted path (node j in slot context_len + j) moves to consecutive
    slots context_len + i in the target's cache, all requests in one copy (the draft's tree K/V lies
    past its context and is dropped)."""
    moves = []
    for r, nodes in zip(batch, accepted_nodes):
        table, L, bs = kv.block_table(r.request_id), r.context_len, kv.block_size
        for i, j in enumerate(nodes):
            if j != i:
                src, dst = L + j, L + i
                moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
    if moves:
        copy_slots([kv["target"]], torch.tensor(moves, dtype=torch.int64).to(kv["target"].device, non_blocking=True))


def _commit_one(ctx: CommitContext, r: Request, b: int, proposal: DraftProposal, result: VerifyResult,
                drafted_total: int, verify_share: float, settle: Settle | None) -> tuple[StepSample, str | None]:
    n, a = proposal.num_draft_tokens[b], result.num_accepted[b]
    emitted = result.output_token_ids[b][:a + 1]
    L = r.context_len
    r.target_cached = L + a
    held = ctx.drafter.on_commit(r, b, proposal) if ctx.drafter is not None else None
    ahead_s = hidden_s = 0.0           # draft work made this step for the next one (specrt.step.overlap)
    if settle is not None:
        held, ahead_s, hidden_s = settle(r, b, held)
    if held is not None:
        r.draft_cached = held
    surplus = ctx.kv.num_tokens(r.request_id) - max(r.target_cached, 0 if held is None else held)
    if surplus > 0:
        ctx.kv.rollback(r.request_id, surplus)
    share = proposal.cost.seconds * (n / drafted_total) + ahead_s
    sample = StepSample(n, a, len(emitted), share, verify_share, hidden_s, context_len=L,
                        temperature=r.params.temperature,
                        depth=max(node_depths(proposal.parents(b)), default=0) if proposal.node_parents else None)
    reason = r.append_tokens(emitted, ctx.eos_token_ids, ctx.max_model_len, ctx.decode,
                             commit_logprobs(r, b, result))
    sample.emitted = len(r.output_token_ids) - (L - len(r.prompt_token_ids))
    if reason is None:
        # a lagging draft KV does not hold back the target's prefix sharing: its blocks
        # are registered target-only, and a later request's draft recomputes them
        ctx.kv.commit(r.request_id, r.token_ids[:r.target_cached], all_caches_upto=held)
    return sample, reason
