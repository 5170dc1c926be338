"""Verification: the target's K+1 rows per request -> the tokens each request emits.

Per request b with n_b drafts: the target scores its pending tokens (the context its KV does
not hold yet, at least the last token) followed by its drafts, and the rows at the last pending
token and at every draft are verified. The leading drafts the target agrees with are
*accepted*; then one more token is emitted: the target's own choice at the first rejected
position (*recovered*) or after the last draft when all were accepted (*bonus*). So a request
emits num_accepted + 1 tokens per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specrt import ops
from specrt.config import SamplingParams
from specrt.drafters.base import DraftProposal
from specrt.drafters.tree import ancestor_mask, node_depths
from specrt.models.attention import AttentionMetadata
from specrt.sampling.controls import TokenLogprob
from specrt.sampling.logprobs import PromptRows, output_logprobs, packed, prompt_logprobs, records
from specrt.sampling.transform import (BatchControls, RowLogprobs, apply_controls, batch_controls, mask_eos, pad_rows,
                                       param_rows, probs_from_logits)


@dataclass
class VerifyBatch:
    """One target forward over every request's pending tokens and drafts (T tokens, R verified rows,
    then P prompt rows whose log-probabilities a request asked for)."""

    input_ids: torch.Tensor            # [T] int64: per request its pending tokens, then its drafts
    positions: torch.Tensor            # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor       # [R + P] int64: rows verified, R = sum(num_draft_tokens + 1), then prompt rows
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
    row_request: list[int] = field(default_factory=list)   # [R] request b of each verified row
    row_offset: list[int] = field(default_factory=list)    # [R] drafts before each verified row (0..n_b)
    controls: BatchControls | None = None                  # logit controls; None: no request has any
    logprob_rows: list[int] = field(default_factory=list)  # verified rows whose requests want logprobs
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)   # [P] (request b, next prompt token)
    query_start: list[int] = field(default_factory=list)     # [B] first row in T of each request's fed tokens
    query_position: list[int] = field(default_factory=list)  # [B] the position of that row
    node_parents: torch.Tensor | None = None                 # [B, K] int32: a tree step's node parents
                                                             # (-1: the pending token); None: chains
    node_start: list[int] = field(default_factory=list)      # [B] first row in T of each request's nodes


class Verified(NamedTuple):
    """What verification produced, on the device."""

    output_token_ids: torch.Tensor     # [B, K+1] int32, -1 padded (num_accepted + 1 valid)
    num_accepted: torch.Tensor         # [B] int32
    logprobs: RowLogprobs | None       # at vb.logprob_rows (of each row's output token)
    prompt_logprobs: RowLogprobs | None   # at vb.prompt_rows
    accepted_nodes: torch.Tensor | None = None   # [B, K] int32 a tree step's accepted path (node indices)


@dataclass
class VerifyResult:
    """What verification decided, on the host (after the step's one device->host copy)."""

    output_token_ids: list[list[int]]  # [B][K+1] emitted tokens: the first num_accepted + 1 are valid
    num_accepted: list[int]            # [B]
    guesses: list[int]                 # [B] each request's token guessed before the verification (the
                                       # bonus a pre-draft assumed, specrt.step.overlap), -1: none
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)   # request b -> rows 0..n_b
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)   # b -> per prompt token
    accepted_nodes: list[list[int]] | None = None   # [B][num_accepted] a tree step's path (node indices)


def scores_prompt(r) -> bool:
    """The request wants its prompt's log-probabilities and this is its first step."""
    return r.params.prompt_logprobs is not None and r.prompt_logprobs is None and r.num_generated == 0


def feeds_context(r) -> bool:
    """This step scores more than the request's last token: its prompt (or the part not cached), a
    recompute after preemption, or the prompt's log-probabilities."""
    return r.context_len - r.target_cached > 1 or scores_prompt(r)


def build_verify_batch(batch, proposal: DraftProposal, kv, device, prefill=()) -> VerifyBatch:
    """Lay out every request's pending tokens + drafts; reserve nothing (the slots exist). A request
    scoring its prompt feeds all of it: positions whose KV is cached already (a shared prefix) are
    recomputed for their logits without being written again (slot -1). ``prefill``: prefill-only
    requests (specrt.step.prefill) and where their chunk ends, fed after the batch's rows, unscored
    (in query_start / query_position they follow the batch's requests)."""
    K = proposal.draft_token_ids.shape[1]
    n = proposal.num_draft_tokens
    tree = proposal.is_tree
    host_ids, positions, draft_dest, draft_src, logit_rows, seq_lens, query_lens = [], [], [], [], [], [], []
    unwritten, prompt_rows, prompt_logit_rows, query_start, query_position = [], [], [], [], []
    masks, node_start, verify = [], [], []
    for b, r in enumerate(batch):
        start, L = r.target_cached, r.context_len
        base = len(host_ids)
        if scores_prompt(r):
            unwritten += range(base, base + start)
            start = 0
            prompt_rows += [(b, t) for t in r.prompt_token_ids[1:]]
            prompt_logit_rows += range(base, base + L - 1)
        pending = r.token_ids[start:]
        verify.append(len(pending) == 1)     # one pending token + drafts: decode-shaped rows
        query_start.append(base)
        query_position.append(start)
        host_ids += pending + [0] * n[b]
        node_start.append(base + len(pending))
        draft_dest += range(base + len(pending), base + len(pending) + n[b])
        draft_src += range(b * K, b * K + n[b])
        if tree:                 # node j at the pending token's position + its depth; sees its ancestors
            parents = proposal.parents(b)
            positions += list(range(start, L)) + [L - 1 + d for d in node_depths(parents)]
            masks += [-1] * len(pending) + ancestor_mask(parents)
        else:
            positions += range(start, L + n[b])
        logit_rows += range(base + len(pending) - 1, base + len(pending) + n[b])
        seq_lens.append(L + n[b])
        query_lens.append(L + n[b] - start)
    for r, end in prefill:                       # a prompt chunk: K/V and hidden states only
        query_start.append(len(host_ids))
        query_position.append(r.target_cached)
        host_ids += r.token_ids[r.target_cached:end]
        positions += range(r.target_cached, end)
        masks += [-1] * (end - r.target_cached)
        verify.append(False)
        seq_lens.append(end)
        query_lens.append(end - r.target_cached)

    def dev(x, dtype=torch.int64):   # host -> device copies only
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    input_ids = dev(host_ids)
    if draft_dest:
        input_ids[dev(draft_dest)] = proposal.draft_token_ids.view(-1).index_select(0, dev(draft_src)).long()
    meta = AttentionMetadata.build(seq_lens, query_lens, [kv.block_table(r.request_id) for r in batch]
                                   + [kv.block_table(r.request_id) for r, _ in prefill],
                                   kv.block_size, device, tree_mask=masks if tree else None, verify=verify)
    if unwritten:
        meta.slot_mapping[dev(unwritten)] = -1
    counts = [k + 1 for k in n]
    row_request = [b for b, c in enumerate(counts) for _ in range(c)]
    # how many tokens each verified row's output follows (its depth: a chain's i-th row, i)
    row_depths = [[0] + node_depths(proposal.parents(b)) if tree else list(range(c)) for b, c in enumerate(counts)]
    return VerifyBatch(
        input_ids=input_ids, positions=dev(positions), attn_metadata=meta,
        logits_indices=dev(logit_rows + prompt_logit_rows), draft_token_ids=proposal.draft_token_ids,
        draft_probs=proposal.draft_probs, num_draft_tokens=list(n), num_draft_tokens_t=dev(n, torch.int32),
        pad_index=dev([b * (K + 1) + i for b, c in enumerate(counts) for i in range(c)]),
        seeds=dev([r.seed for r in batch]), first_positions=dev([r.context_len for r in batch]),
        params=[r.params for r in batch], row_params=[r.params for r, c in zip(batch, counts) for _ in range(c)],
        output_index=[r.num_generated + i for b, r in enumerate(batch) for i in row_depths[b]],
        num_query_tokens=sum(query_lens), num_context_tokens=sum(seq_lens),
        row_request=row_request, row_offset=[i for c in counts for i in range(c)],
        controls=batch_controls(batch, device),
        logprob_rows=[j for j, b in enumerate(row_request) if batch[b].params.logprobs is not None],
        prompt_rows=prompt_rows, query_start=query_start, query_position=query_position,
        node_parents=_parents_tensor(proposal, K, device) if tree else None, node_start=node_start)


def _parents_tensor(proposal: DraftProposal, K: int, device) -> torch.Tensor:
    """[B, K] int32 node parents, -1 padded (padding nodes are never read: num_draft_tokens)."""
    rows = [proposal.parents(b) + [-1] * (K - n) for b, n in enumerate(proposal.num_draft_tokens)]
    return torch.tensor(rows, dtype=torch.int32).view(len(rows), K).to(device, non_blocking=True)


def accept(vb: VerifyBatch, logits: torch.Tensor, acceptance: str | None, eos_token_ids: list[int],
           prompt: PromptRows | None = None) -> Verified:
    """On the device: the emitted tokens from the target's logits [R + P, V] (verified rows, then
    prompt rows; [R, V] with ``prompt``, whose rows' logits are made a chunk at a time): controls,
    then greedy verification or the sampling transform and rejection sampling. ``acceptance``
    None: no drafter (plain sampling)."""
    B, K = len(vb.num_draft_tokens), vb.draft_token_ids.shape[1]
    counts = [k + 1 for k in vb.num_draft_tokens]
    R = len(vb.row_request)
    prompt_logits, logits = logits[R:], logits[:R]                                   # [P, V] ([0, V]), [R, V]
    if vb.controls is not None:
        apply_controls(logits, vb.controls, vb.row_request, vb.row_offset, vb.draft_token_ids)
    mask_eos(logits, vb.row_params, vb.output_index, eos_token_ids)
    probs, nodes = None, None
    if vb.node_parents is not None:
        tokens, accepted, nodes = _accept_tree(vb, logits, acceptance, counts, K)
    elif all(p.greedy for p in vb.params):
        tokens, accepted = ops.verify_greedy(pad_rows(logits, counts, K, vb.pad_index), vb.draft_token_ids,
                                             vb.num_draft_tokens_t, check_values=False)
    else:
        probs = probs_from_logits(logits, param_rows(vb.params, counts, logits.device))   # [R, V]
        padded = pad_rows(probs, counts, K, vb.pad_index)                              # [B, K+1, V]
        if acceptance is None:
            tokens = ops.sample_tokens(padded[:, 0].contiguous(), vb.seeds, vb.first_positions, purpose="target",
                                       check_values=False)[:, None]
            accepted = torch.zeros(B, dtype=torch.int32, device=logits.device)
        else:
            tokens, accepted = ops.rejection_sample(padded, vb.draft_probs, vb.draft_token_ids,
                                                    vb.num_draft_tokens_t, vb.seeds, vb.first_positions,
                                                    method=acceptance, check_values=False)
    return Verified(tokens, accepted, output_logprobs(vb, logits, probs, tokens),
                    prompt_logprobs(vb, prompt_logits, prompt), nodes)


def _accept_tree(vb: VerifyBatch, logits, acceptance: str | None, counts: list[int], K: int):
    """A tree step's verification (no logprob rows: tree steps take requests without them):
    (output_token_ids [B, K+1], num_accepted [B], accepted_nodes [B, K])."""
    if all(p.greedy for p in vb.params):
        return ops.verify_tree_greedy(pad_rows(logits, counts, K, vb.pad_index), vb.draft_token_ids,
                                      vb.node_parents, vb.num_draft_tokens_t, check_values=False)
    probs = probs_from_logits(logits, param_rows(vb.params, counts, logits.device))    # [R, V]
    return ops.rejection_sample_tree(pad_rows(probs, counts, K, vb.pad_index), vb.draft_probs,
                                     vb.draft_token_ids, vb.node_parents, vb.num_draft_tokens_t, vb.seeds,
                                     vb.first_positions, method=acceptance or "rejection", check_values=False)


def path_rows(vb: VerifyBatch, accepted_nodes: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T] int64 on the device: the fed rows reordered so that each request's node rows follow its
    accepted path (row i of its nodes = the row of path node i; past the path, as fed), for a
    drafter that reads the verify forward's rows by position (observe_target)."""
    dev = accepted_nodes.device
    b = [i for i, n in enumerate(vb.num_draft_tokens) for _ in range(n)]
    j = [k for n in vb.num_draft_tokens for k in range(n)]
    index = torch.arange(num_rows, dtype=torch.int64, device=dev)
    if not b:
        return index
    bt, jt = (torch.tensor(x, dtype=torch.int64).to(dev, non_blocking=True) for x in (b, j))
    node = accepted_nodes[bt, jt].long()
    start = torch.tensor([vb.node_start[i] for i in b], dtype=torch.int64).to(dev, non_blocking=True)
    index[start + jt] = start + torch.where(node >= 0, node, jt)
    return index


def commit_logprobs(r, b: int, result: VerifyResult) -> list[TokenLogprob] | None:
    """At request r's commit (row b): store its prompt's log-probabilities if this step scored them,
    and return its verified rows' (for ``Request.append_tokens``)."""
    if scores_prompt(r):
        r.prompt_logprobs = result.prompt_logprobs.get(b, [None])
    return result.logprobs.get(b)


def to_host(vb: VerifyBatch, verified: Verified, guessed: dict[int, torch.Tensor] | None = None) -> VerifyResult:
    """The step's one intentional device->host sync (tokens, counts, ``guessed``: {row: a [] token
    on the device} guessed before the verification, and any log-probabilities, all as one int32 tensor)."""
    tokens, accepted = verified.output_token_ids, verified.num_accepted
    B = tokens.shape[0]
    guesses = torch.full((B,), -1, dtype=torch.int32, device=tokens.device)
    if guessed:
        idx = torch.tensor(list(guessed), dtype=torch.int64).to(tokens.device, non_blocking=True)
        guesses[idx] = torch.stack(list(guessed.values())).to(torch.int32)
    nodes = verified.accepted_nodes
    head = torch.cat([tokens.to(torch.int32), accepted.to(torch.int32)[:, None], guesses[:, None]]
                     + ([nodes.to(torch.int32)] if nodes is not None else []), 1)
    host = torch.cat([head.reshape(-1)] + packed(verified.logprobs, verified.prompt_logprobs)).cpu()
    table = host[:head.numel()].view(head.shape)
    W = tokens.shape[1]
    result = VerifyResult(table[:, :W].tolist(), table[:, W].tolist(), table[:, W + 1].tolist())
    if nodes is not None:
        result.accepted_nodes = [row[W + 2:W + 2 + a] for row, a in zip(table.tolist(), result.num_accepted)]
    result.logprobs, result.prompt_logprobs = records(vb, host[head.numel():], verified.logprobs,
                                                      verified.prompt_logprobs, result.output_token_ids)
    return result
