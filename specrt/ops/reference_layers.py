"""Pure-torch reference of specrt's cache and decoder-layer ops (re-exported by
specrt.ops.reference): KV block and slot copies, KV writes, paged attention, and the fused
rms_norm / silu_mul / rotary_write_kv, each the specification of the op of the same name in
:mod:`specrt.ops`."""
from __future__ import annotations

import torch


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """caches[c][:, :, dst] = caches[c][:, :, src] for every (src, dst) row."""
    for cache in caches:
        for src, dst in block_mapping.tolist():
            cache[:, :, dst] = cache[:, :, src]


def copy_slots(caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """Every (src, dst) row copies slot src to slot dst (slot = block * block_size + offset) in every
    layer and K/V plane of every cache; all sources are read before any destination is written."""
    for cache in caches:
        block_size = cache.shape[3]
        src, dst = slot_mapping[:, 0].long(), slot_mapping[:, 1].long()
        staged = cache[:, :, src // block_size, src % block_size].clone()   # [layers, 2, P, H, D]
        cache[:, :, dst // block_size, dst % block_size] = staged


def write_kv(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """cache[layer, 0|1, slot // block_size, slot % block_size] = k|v; slot -1 skipped."""
    block_size = cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        cache[layer, 0, slot // block_size, slot % block_size] = k[t]
        cache[layer, 1, slot // block_size, slot % block_size] = v[t]


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int = 0,
                    tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each request's new queries over its paged context, in float64, one request at a time.

    q [T, H, D]; kv_cache [2, num_blocks, block_size, Hkv, D] (one layer); block_tables [B, max_blocks];
    seq_lens [B]; query_start_loc [B+1]. Query i of request b sits at position
    ``seq_lens[b] - query_len + i`` and sees keys ``max(0, pos - window + 1) .. pos`` (``window`` 0:
    all up to pos). ``tree_mask`` [T] int64 (None: every row causal): of the keys up to 63 positions
    back, row t sees key ``pos - d`` only if bit d of ``tree_mask[t]`` is set (-1: all).
    Query head h reads kv head ``h // (H // Hkv)``. Returns float32 [T, H, D]; rows past
    ``query_start_loc[B]`` are zero.
    """
    T, H, D = q.shape
    block_size, Hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(T, H, D, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for b, s in enumerate(seq_lens.tolist()):
        n = starts[b + 1] - starts[b]
        if n == 0:
            continue
        keys = torch.arange(s)
        blocks = block_tables[b].long()[keys // block_size]
        k = kv_cache[0, blocks, keys % block_size].double().repeat_interleave(H // Hkv, dim=1)  # [s, H, D]
        v = kv_cache[1, blocks, keys % block_size].double().repeat_interleave(H // Hkv, dim=1)
        pos = torch.arange(s - n, s)[:, None]  # [n, 1]
        visible = keys[None, :] <= pos
        if window > 0:
            visible &= keys[None, :] > pos - window
        if tree_mask is not None:
            back = pos - keys[None, :]  # [n, s]
            bits = tree_mask[starts[b]:starts[b + 1]].cpu()[:, None].bitwise_right_shift(back.clamp(0, 63)) & 1
            visible &= (back >= 64) | (bits == 1)
        scores = torch.einsum("nhd,shd->hns", q[starts[b]:starts[b + 1]].double(), k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # [H, n, s]
        out[starts[b]:starts[b + 1]] = torch.einsum("hns,shd->nhd", probs, v).float()
    return out


# --------------------------------------------------------------------------- #
# Fused decoder ops (specrt.ops.rms_norm / silu_mul / rotary_write_kv): the same
# math as op-by-op torch code in the tensors' dtype (transformers' roundings)
# --------------------------------------------------------------------------- #
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype); with ``residual``: residual += x first."""
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * r).to(x.dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] (each op rounded to x's dtype, as transformers' MLP)."""
    n = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :n]) * x[..., n:]


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                    kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
                    q_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on q and k (k in place in qkv), then write_kv of k and v."""
    T, D = qkv.shape[0], cos.shape[-1]
    H, Hkv = num_heads, num_kv_heads
    x = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)
    rot = torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)
    y = x * cos[:, None] + rot * sin[:, None]
    x[:, H:] = y[:, H:]
    k = x[:, H:]
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    for t, slot in enumerate(slot_mapping.tolist()):  # in row order: a repeated slot keeps the last row
        if slot >= 0:
            write_kv(kv_cache, layer, k[t:t + 1].to(kv_cache.dtype), v[t:t + 1].to(kv_cache.dtype),
                     torch.tensor([slot]))
    return y[:, :H].to(q_dtype or qkv.dtype).contiguous()
