"""Fair vectorised torch baselines of specrt's kernel ops (same contracts, torch-native
randomness), written the way production torch samplers do it (batched argmax, torch.rand coins +
exponential-race residual sampling, topk/sort for top-k/top-p, index_copy for the KV cache), and
the straightforward torch versions of issue 18 (``baseline_*``: torch.multinomial). Timed
against the kernels by bench/kernels.py."""
from __future__ import annotations

import torch

def torch_probs_from_logits(logits, temperature, top_k, top_p):
    """[N, V] -> [N, V]: temperature, top-k (kth value, ties kept), softmax, top-p (sort + cumsum)."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"))
    greedy = temperature == 0
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    v = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < v), top_k, torch.full_like(top_k, v)).long()
    kmax = int(k.max()) if x.device.type == "cpu" else v   # on a GPU: no sync, full sort instead
    if kmax < v:
        top_vals = torch.topk(x, kmax, dim=-1).values
    else:
        top_vals = torch.sort(x, dim=-1, descending=True).values
    kth = top_vals.gather(-1, (k - 1).clamp(max=top_vals.shape[-1] - 1)[:, None])
    x = torch.where(x >= kth, x, torch.full_like(x, float("-inf")))
    p = torch.softmax(x, dim=-1)
    sorted_p, _ = torch.sort(p, dim=-1, descending=True)
    csum = torch.cumsum(sorted_p, dim=-1)
    cut_idx = torch.searchsorted(csum, top_p[:, None].contiguous()).clamp(max=v - 1)
    cut = sorted_p.gather(-1, cut_idx)
    p = torch.where((p >= cut) | (top_p[:, None] >= 1.0), p, torch.zeros_like(p))
    p = p / p.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(x.argmax(-1), v).float()
    return torch.where(greedy[:, None], one_hot, p)


def _accept_prefix(match: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> num_accepted [B]: length of the all-True prefix within num_draft_tokens."""
    k = match.shape[1]
    valid = torch.arange(k, device=match.device)[None, :] < num_draft_tokens[:, None]
    return torch.cumprod((match & valid).int(), dim=1).sum(1)


def _emit(draft_token_ids, num_accepted, final_tokens):
    """out[b, :n] = drafts, out[b, n] = final_tokens[b], -1 after."""
    b, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    drafts = torch.cat([draft_token_ids, torch.full_like(draft_token_ids[:, :1], -1)], dim=1)
    out = torch.where(pos < num_accepted[:, None], drafts, torch.full_like(drafts, -1))
    return torch.where(pos == num_accepted[:, None], final_tokens[:, None].int(), out), num_accepted.int()


def torch_verify_greedy(target_logits, draft_token_ids, num_draft_tokens):
    best = torch.nan_to_num(target_logits, nan=float("-inf")).argmax(-1)   # [B, K+1]
    k = draft_token_ids.shape[1]
    n = _accept_prefix(draft_token_ids.long() == best[:, :k], num_draft_tokens)
    return _emit(draft_token_ids, n, best.gather(1, n[:, None].long())[:, 0])


def torch_rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens):
    """vLLM-style: torch.rand coins, residual race with exponential noise at every position."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    ids = draft_token_ids.long().clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, ids[..., None])[..., 0]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        q = torch.zeros_like(target_probs[:, :k]).scatter_(-1, ids[..., None], 1.0)
    else:
        q_x = draft_probs.gather(-1, ids[..., None])[..., 0]
        q = draft_probs
    u = torch.rand_like(p_x)
    n = _accept_prefix(u * q_x < p_x, num_draft_tokens)
    residual = torch.cat([(target_probs[:, :k] - q).clamp_(min=0), target_probs[:, k:]], dim=1)
    rows = residual.gather(1, n.long()[:, None, None].expand(b, 1, v))[:, 0]          # [B, V]
    p_rows = target_probs.gather(1, n.long()[:, None, None].expand(b, 1, v))[:, 0]
    rejected = n < num_draft_tokens
    empty = rows.sum(-1) == 0
    rows = torch.where((rejected & ~empty)[:, None], rows, p_rows)
    noise = torch.empty_like(rows).exponential_()
    return _emit(draft_token_ids, n, (rows / noise).argmax(-1))


def torch_coupled(target_probs, draft_token_ids, num_draft_tokens):
    noise = torch.empty_like(target_probs).exponential_()
    winners = (target_probs / noise).argmax(-1)                                        # [B, K+1]
    k = draft_token_ids.shape[1]
    n = _accept_prefix(draft_token_ids.long() == winners[:, :k], num_draft_tokens)
    return _emit(draft_token_ids, n, winners.gather(1, n[:, None].long())[:, 0])


def torch_sample_tokens(probs):
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1).int()


def baseline_rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens):
    """The straightforward torch version: gather p and q at the drafted ids, one uniform per
    position for the accept test, torch.multinomial on the normalised residual (p_n after
    accepting everything; p when the residual is all zero)."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    ids = draft_token_ids.long().clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, ids[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, ids[..., None])[..., 0]
    n = _accept_prefix(torch.rand_like(p_x) * q_x < p_x, num_draft_tokens).long()   # [B]
    rows = torch.arange(b, device=target_probs.device)
    p_row = target_probs[rows, n]                                                        # [B, V]
    at = n.clamp(max=max(k - 1, 0))
    if draft_probs is None:
        q_row = torch.zeros_like(p_row).scatter_(-1, ids[rows, at][:, None], 1.0)
    else:
        q_row = draft_probs[rows, at]
    residual = torch.where((n < num_draft_tokens)[:, None], (p_row - q_row).clamp_(min=0), p_row)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total, p_row)
    return _emit(draft_token_ids, n, torch.multinomial(residual, 1)[:, 0])


def baseline_sample_tokens(probs):
    return torch.multinomial(probs, 1)[:, 0].int()


def torch_copy_blocks(caches, src, dst):
    for cache in caches:
        cache.index_copy_(2, dst, cache.index_select(2, src))


def torch_write_kv(cache, layer, k, v, slots):
    bs = cache.shape[3]
    flat_k = cache[layer, 0].view(-1, *cache.shape[4:])
    flat_v = cache[layer, 1].view(-1, *cache.shape[4:])
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)
    del bs
