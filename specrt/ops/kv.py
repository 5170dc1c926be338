"""KV cache ops: block and slot copies, key/value stores, and paged attention over the blocks.

paged_attention is the torch.library op specrt::paged_attention (csrc/attention_ops.cpp; kernels
csrc/cpu/attention_cpu.cpp and csrc/cuda/attention_cuda.cu; shared math csrc/include/specrt/attention.h).
"""
from __future__ import annotations

from typing import Sequence

import torch

from specrt.ops.checks import _check_values, _has_kernels, _index, _same_device, _tensor

def _block_mapping(block_mapping, name: str = "block_mapping", what: str = "block") -> torch.Tensor:
    """A tensor passes as is (the op checks dtype int64); a list must hold integers."""
    if isinstance(block_mapping, torch.Tensor):
        return block_mapping.contiguous()
    if block_mapping is None:
        raise ValueError(f"{name} must be a tensor, got None")
    try:
        t = torch.as_tensor(block_mapping)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"{name} must be a tensor or a list of (src, dst) pairs: {exc}") from None
    if t.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer {what} ids, got {t.dtype} values")
    return (t.reshape(-1, 2) if t.dim() == 1 and t.numel() % 2 == 0 else t).to(torch.int64).contiguous()


def _cache_list(caches) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"caches must be a list of cache tensors, got {type(caches).__name__}")
    caches = [_tensor(c, f"caches[{i}]") for i, c in enumerate(caches)]
    if not caches:
        raise ValueError("caches must be a non-empty list of cache tensors")
    for i, c in enumerate(caches[1:], 1):
        _same_device(c, f"caches[{i}]", caches[0])
    return caches


def copy_blocks(caches: Sequence[torch.Tensor], block_mapping, check_values: bool | None = None) -> None:
    """Copy whole KV blocks src -> dst in every layer of every cache, in one launch.

    Shape: each cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    (target and draft caches may differ in every dim but 1 and in dtype);
    block_mapping [P, 2] int64 (src, dst), on the CPU or on the caches' device.
    A CPU mapping is always validated (in range for every cache, distinct
    destinations, no block both source and destination).

    Examples:
        >>> ops.copy_blocks([target_cache, draft_cache], torch.tensor([[3, 8]]))   # block 3 -> block 8
    """
    caches = _cache_list(caches)
    block_mapping = _block_mapping(block_mapping)
    if block_mapping.device.type != "cpu":
        _same_device(block_mapping, "block_mapping", caches[0])
    _has_kernels(caches[0], "caches")
    torch.ops.specrt.copy_blocks(caches, block_mapping, _check_values(caches[0], check_values))


def copy_slots(caches: Sequence[torch.Tensor], slot_mapping, check_values: bool | None = None) -> None:
    """Copy the K and V of single token slots src -> dst in every layer of every cache, in one call.

    A slot is ``block * block_size + offset``. All sources are read before any destination is
    written (a gather, then a scatter), so sources and destinations may overlap: this is how an
    accepted tree path's KV moves down to consecutive positions. Destinations must be distinct;
    src == dst is a no-op.

    Shape: each cache [layers, 2, num_blocks, block_size, kv_heads, head_dim] (target and draft
    caches may differ in every dim but 1 and in dtype; slots are read with each cache's
    block_size); slot_mapping [P, 2] int64 (src, dst), on the CPU or on the caches' device. A CPU
    mapping is always validated (in range for every cache, distinct destinations).

    Examples:
        >>> ops.copy_slots([target_cache, draft_cache], torch.tensor([[37, 34], [39, 35]]))   # nodes 3, 5 -> 34, 35
    """
    caches = _cache_list(caches)
    slot_mapping = _block_mapping(slot_mapping, "slot_mapping", "slot")
    if slot_mapping.device.type != "cpu":
        _same_device(slot_mapping, "slot_mapping", caches[0])
    _has_kernels(caches[0], "caches")
    torch.ops.specrt.copy_slots(caches, slot_mapping, _check_values(caches[0], check_values))


def write_kv(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             check_values: bool | None = None) -> None:
    """Store new keys/values: cache[layer, 0|1, slot // block_size, slot % block_size] = k|v.

    Shape: cache [layers, 2, num_blocks, block_size, kv_heads, head_dim],
    k, v [T, kv_heads, head_dim] in the cache's dtype, slot_mapping [T] int64
    (-1 = padding, skipped).

    Examples:
        >>> ops.write_kv(cache, 0, k, v, torch.tensor([17, -1, 18]))   # k, v [3, kv_heads, head_dim]
    """
    cache = _tensor(cache, "cache")
    layer = _index(layer, "layer")
    for t, name in ((k, "k"), (v, "v"), (slot_mapping, "slot_mapping")):
        _same_device(_tensor(t, name), name, cache)
    _has_kernels(cache, "cache")
    torch.ops.specrt.write_kv(cache, layer, k, v, slot_mapping, _check_values(cache, check_values))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int | None = 0,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    check_values: bool | None = None, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every request's new queries directly over its paged KV blocks (no gather copy).

    Request b's new tokens are rows ``query_start_loc[b]:query_start_loc[b+1]`` of ``q``; its
    query i sits at position ``seq_lens[b] - query_len + i`` and attends causally to the
    request's keys ``0 .. pos`` (the last ``window`` of them when ``window`` > 0), read from
    ``kv_cache`` through ``block_tables`` — the new tokens' K/V must already be written
    (``write_kv``). Query head h uses kv head ``h // (H // Hkv)`` (GQA). float32 accumulation
    with an online softmax; a long context is split into 256-key chunks across threads / CTAs
    and combined in a fixed order, so a query's output does not depend on its batch
    neighbours, the number of queries of its request, the block size or the thread count, and
    the CPU and CUDA kernels return the same bits (csrc/include/specrt/attention.h).

    Shape: q [T, H, D] float32; kv_cache [2, num_blocks, block_size, Hkv, D] (one layer of the
    model cache) float32, bfloat16 or float16; block_tables [B, max_blocks] int32 (-1 padded);
    seq_lens [B] int64 (context length including the new tokens); query_start_loc [B+1] int64.
    ``max_query_len`` / ``max_seq_len`` bound the query lengths and seq_lens (host ints: the CUDA
    kernel sizes its grid from them without a sync); computed from the tensors when omitted
    (CPU tensors only).

    Token trees: ``tree_mask`` [T] int64 (on q's device; None: every row causal) holds each row's
    ancestor bits. Row t at position pos sees key kp as above AND only if ``pos - kp >= 64`` or bit
    ``pos - kp`` of ``tree_mask[t]`` is set (bit 0: the row's own key; -1, every bit: plain causal,
    the same bits as None). Rows past ``query_start_loc[B]`` ignore theirs.

    Returns: out [T, H, D] float32; rows past ``query_start_loc[B]`` (padding) are zero.

    Examples:
        >>> meta = AttentionMetadata.build([7, 3], [5, 1], [[4, 0], [2]], block_size=4)
        >>> out = ops.paged_attention(q, cache[layer], meta.block_tables, meta.seq_lens,
        ...                           meta.query_start_loc, scale=head_dim ** -0.5)
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if tree_mask is not None and not isinstance(tree_mask, torch.Tensor):
        raise ValueError(f"tree_mask must be a torch.Tensor or None, got {type(tree_mask).__name__}")
    if max_query_len is None or max_seq_len is None:
        if not (isinstance(seq_lens, torch.Tensor) and isinstance(query_start_loc, torch.Tensor)):
            raise TypeError("seq_lens and query_start_loc must be tensors")
        if seq_lens.device.type != "cpu" or query_start_loc.device.type != "cpu":
            raise ValueError("pass max_query_len and max_seq_len for device tensors (reading them would sync)")
        if max_query_len is None:
            max_query_len = int(query_start_loc.diff().max()) if query_start_loc.numel() > 1 else 0
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    return torch.ops.specrt.paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, float(scale),
                                            int(window or 0), int(max_query_len), int(max_seq_len),
                                            _check_values(q, check_values), tree_mask)
