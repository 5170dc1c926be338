"""Verification: the target's K+1 rows per request -> the tokens each request emits.

Per request b with n_b drafts: the target scores its pending tokens (the context its KV does
not hold yet, at least the last token) followed by its drafts, and the rows at the last pending
token and at every draft are verified. The leading drafts the target agrees with are
*accepted*; then one more token is emitted: the target's own choice at the first rejected
position (*recovered*) or after the last draft when all were accepted (*bonus*). So a request
emits num_accepted + 1 tokens per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specrt import ops
from specrt.attention import AttentionMetadata
from specrt.config import SamplingParams
from specrt.drafters.base import DraftProposal, PreDraft
from specrt.sampling import mask_eos, pad_rows, param_rows


@dataclass
class VerifyBatch:
    """One target forward over every request's pending tokens and drafts (T tokens, R verified rows)."""

    input_ids: torch.Tensor            # [T] int64: per request its pending tokens, then its drafts
    positions: torch.Tensor            # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor       # [R] int64: rows verified, R = sum(num_draft_tokens + 1)
    draft_token_ids: torch.Tensor      # [B, K] int32, -1 padded
    draft_probs: torch.Tensor | None   # [B, K, V] float32; None: one-hot drafts
    num_draft_tokens: list[int]        # [B] host
    num_draft_tokens_t: torch.Tensor   # [B] int32
    pad_index: torch.Tensor            # [R] int64: verified row -> row of the [B * (K+1)] padded layout
    seeds: torch.Tensor                # [B] int64: each request's Philox key
    first_positions: torch.Tensor      # [B] int64: position of each request's first emitted token
    params: list[SamplingParams]       # [B]
    row_params: list[SamplingParams]   # [R] the sampling parameters of each verified row
    output_index: list[int]            # [R] which output token (#) each verified row would emit
    num_query_tokens: int              # T (the cost model's verified tokens)
    num_context_tokens: int            # sum of the requests' sequence lengths


@dataclass
class VerifyResult:
    """What verification decided, on the host (after the step's one device->host copy)."""

    output_token_ids: list[list[int]]  # [B][K+1] emitted tokens: the first num_accepted + 1 are valid
    num_accepted: list[int]            # [B]
    pre_drafts: dict[int, PreDraft]    # row -> overlap pre-draft made for the next round
    pre_draft_guess: list[int]         # [B] the bonus token each pre-draft assumed (-1: none)


def build_verify_batch(batch, proposal: DraftProposal, kv, device) -> VerifyBatch:
    """Lay out every request's pending tokens + drafts; reserve nothing (the slots exist)."""
    kmax = proposal.draft_token_ids.shape[1]
    n = proposal.num_draft_tokens
    host_ids, positions, draft_dest, draft_src, logit_rows, seq_lens, query_lens = [], [], [], [], [], [], []
    for b, r in enumerate(batch):
        start, L = r.target_cached, r.context_len
        pending = r.token_ids[start:]
        base = len(host_ids)
        host_ids += pending + [0] * n[b]
        draft_dest += range(base + len(pending), base + len(pending) + n[b])
        draft_src += range(b * kmax, b * kmax + n[b])
        positions += range(start, L + n[b])
        logit_rows += range(base + len(pending) - 1, base + len(pending) + n[b])
        seq_lens.append(L + n[b])
        query_lens.append(L + n[b] - start)

    def dev(x, dtype=torch.int64):   # host -> device copies only
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    input_ids = dev(host_ids)
    if draft_dest:
        input_ids[dev(draft_dest)] = proposal.draft_token_ids.view(-1).index_select(0, dev(draft_src)).long()
    counts = [k + 1 for k in n]
    return VerifyBatch(
        input_ids=input_ids, positions=dev(positions),
        attn_metadata=AttentionMetadata.build(seq_lens, query_lens, [kv.block_table(r.request_id) for r in batch],
                                              kv.block_size, device),
        logits_indices=dev(logit_rows), draft_token_ids=proposal.draft_token_ids, draft_probs=proposal.draft_probs,
        num_draft_tokens=list(n), num_draft_tokens_t=dev(n, torch.int32),
        pad_index=dev([b * (kmax + 1) + i for b, c in enumerate(counts) for i in range(c)]),
        seeds=dev([r.seed for r in batch]), first_positions=dev([r.context_len for r in batch]),
        params=[r.params for r in batch], row_params=[r.params for r, c in zip(batch, counts) for _ in range(c)],
        output_index=[r.num_generated + i for r, c in zip(batch, counts) for i in range(c)],
        num_query_tokens=sum(query_lens), num_context_tokens=sum(seq_lens))


def accept(vb: VerifyBatch, logits: torch.Tensor, acceptance: str | None,
           eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: (output_token_ids [B, K+1] int32, num_accepted [B] int32) from the target's
    logits [R, V] of the verified rows. ``acceptance`` None: no drafter (plain sampling)."""
    B, kmax = len(vb.num_draft_tokens), vb.draft_token_ids.shape[1]
    counts = [k + 1 for k in vb.num_draft_tokens]
    mask_eos(logits, vb.row_params, vb.output_index, eos_token_ids)
    if all(p.greedy for p in vb.params):
        return ops.verify_greedy(pad_rows(logits, counts, kmax, vb.pad_index), vb.draft_token_ids,
                                 vb.num_draft_tokens_t, check_values=False)
    temps, topk, topp = param_rows(vb.params, counts, logits.device)
    probs = ops.probs_from_logits(logits, temps, topk, topp, check_values=False)    # [R, V]
    padded = pad_rows(probs, counts, kmax, vb.pad_index)                             # [B, K+1, V]
    if acceptance is None:
        tokens = ops.sample_tokens(padded[:, 0].contiguous(), vb.seeds, vb.first_positions, purpose="target",
                                   check_values=False)[:, None]
        return tokens, torch.zeros(B, dtype=torch.int32, device=logits.device)
    return ops.rejection_sample(padded, vb.draft_probs, vb.draft_token_ids, vb.num_draft_tokens_t, vb.seeds,
                                vb.first_positions, method=acceptance, check_values=False)


def to_host(tokens: torch.Tensor, accepted: torch.Tensor, pre: dict[int, PreDraft]) -> VerifyResult:
    """The step's one intentional device->host sync (tokens, counts and the pre-drafts' guesses)."""
    B = tokens.shape[0]
    guesses = torch.full((B,), -1, dtype=torch.int32, device=tokens.device)
    if pre:
        idx = torch.tensor(list(pre), dtype=torch.int64).to(tokens.device, non_blocking=True)
        guesses[idx] = torch.stack([p.guess for p in pre.values()]).to(torch.int32)
    host = torch.cat([tokens.to(torch.int32), accepted.to(torch.int32)[:, None], guesses[:, None]], 1).cpu()
    return VerifyResult(host[:, :-2].tolist(), host[:, -2].tolist(), pre, host[:, -1].tolist())
