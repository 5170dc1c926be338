"""Paged KV cache: block allocator, block tables, commit, rollback, copy-on-write, prefix sharing.

One cache tensor per model: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(index 0 = keys, 1 = values). Token position ``p`` of a request lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its *slot* is
``block * block_size + offset``.

``KVCacheManager`` does the bookkeeping only (no tensors). One block table per request
serves the target AND the draft cache (same token positions), so one rollback or fork
covers both; block copies it asks for must be applied to ALL caches at once
(``PagedKVCache`` does that with a single ``copy_blocks``).

Prefix sharing: ``commit`` registers each full block of final tokens under a chained
hash of the tokens (sha256 of the parent block's hash + the block's token ids);
``allocate`` reuses such blocks for a new prompt. Blocks nobody references stay in the
prefix table until their memory is needed (LRU eviction). Note a shared block holds the
KV of every cache in the PagedKVCache, so every model must have written those positions
before ``commit`` registers them.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

import torch

from specrt.models.attention import AttentionMetadata, copy_blocks
from specrt.models.config import ModelConfig
from specrt.models.loader import resolve_dtype


# ----------------------------------------------------------------------------- block manager
class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks; nothing was changed. Queue or preempt and retry."""


@dataclass
class _Request:
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of committed full blocks
    cached_in_all: int = 0      # allocate: leading cached tokens whose KV every cache holds
    valid_in_all: int = 0       # leading blocks whose KV this request wrote (or found) in every cache


_ROOT_HASH = b"specrt-prefix-root"


def _block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class KVCacheManager:
    """Block bookkeeping for a paged KV cache (no tensors).

    A request's ``num_tokens`` is the number of positions that have a slot (written or about
    to be written). Out of blocks is a return value (``None`` / ``False``) for ``allocate`` and
    ``append_slots`` and an ``OutOfBlocksError`` for ``fork`` / ``prepare_write``; in every case
    nothing is half-done.

    Caches that lag: when there are several model caches (target and draft) the target's KV of
    a block may be final while the draft's is not written yet (a draft that has not caught up).
    ``commit(..., all_caches_upto=n)`` registers such blocks as *target-only*: a later request
    reuses them for the target (``allocate``'s return) and recomputes them for the other caches
    (``cached_in_all_caches``); once a request has written them everywhere they are upgraded.

    Copy-on-write: block copies the caller must apply (with ``copy_blocks`` over ALL model
    caches at once) are returned by ``fork`` and ``prepare_write``; ``append_slots`` queues
    the copies it needs in ``pending_copies`` (take them with ``pop_pending_copies``) — it
    only needs any after a rollback into a block shared with another request.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_sharing: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_sharing = enable_prefix_sharing
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU: evict first
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._target_only: set[int] = set()   # registered blocks whose KV only the first cache holds
        self._reqs: dict[Hashable, _Request] = {}
        self.pending_copies: list[tuple[int, int]] = []

    # -- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def block_table(self, request_id) -> list[int]:
        return list(self._req(request_id).block_table)

    def num_tokens(self, request_id) -> int:
        return self._req(request_id).num_tokens

    def has_request(self, request_id) -> bool:
        return request_id in self._reqs

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def _req(self, request_id) -> _Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    # -- block primitives
    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash_of_block.pop(block, None)
        if h is not None:
            del self._block_of_hash[h]
            self._target_only.discard(block)
        self._ref[block] = 1
        return block

    def _incref(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]  # revive a cached prefix block
        self._ref[block] += 1

    def _decref(self, block: int) -> None:
        self._ref[block] -= 1
        assert self._ref[block] >= 0, f"block {block} refcount below zero"
        if self._ref[block] == 0:
            self._free[block] = None
            if block not in self._hash_of_block:
                self._free.move_to_end(block, last=False)  # nothing to keep: reuse first

    def _unregister(self, block: int) -> None:
        h = self._hash_of_block.pop(block, None)
        if h is not None:
            del self._block_of_hash[h]
            self._target_only.discard(block)

    # -- lifecycle
    def allocate(self, request_id, token_ids: list[int]) -> int | None:
        """Reserve blocks for a prompt; returns how many leading tokens are already cached
        (prefill may skip them; always < len(token_ids)), or None if out of blocks."""
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} already has blocks")
        n = len(token_ids)
        if n == 0:
            raise ValueError("allocate: empty prompt")
        bs = self.block_size
        hits: list[int] = []
        hashes: list[bytes] = []
        if self.enable_prefix_sharing:
            parent = _ROOT_HASH
            for i in range((n - 1) // bs):  # never the block holding the last token: it must be computed
                h = _block_hash(parent, token_ids[i * bs:(i + 1) * bs])
                blk = self._block_of_hash.get(h)
                if blk is None:
                    break
                hits.append(blk)
                hashes.append(h)
                parent = h
        fresh = self.blocks_needed(n) - len(hits)
        revived = sum(1 for b in hits if self._ref[b] == 0)
        if fresh + revived > self.num_free_blocks:
            return None
        for b in hits:
            self._incref(b)
        table = hits + [self._take_free() for _ in range(fresh)]
        in_all = next((i for i, b in enumerate(hits) if b in self._target_only), len(hits))
        self._reqs[request_id] = _Request(block_table=table, num_tokens=n, block_hashes=hashes,
                                          cached_in_all=in_all * bs, valid_in_all=in_all)
        return len(hits) * bs

    def cached_in_all_caches(self, request_id) -> int:
        """Of the tokens ``allocate`` reported cached, how many lead with KV in every cache
        (the rest are cached for the target only; the other caches must recompute them)."""
        return self._req(request_id).cached_in_all

    def can_append_slots(self, request_id, num_tokens: int) -> bool:
        """Would ``append_slots(request_id, num_tokens)`` succeed now? (no change)"""
        req = self._req(request_id)
        start, end = req.num_tokens, req.num_tokens + num_tokens
        new = self.blocks_needed(end) - len(req.block_table)
        shared = self._shared_blocks_in(req, start, min(end, len(req.block_table) * self.block_size))
        return max(new, 0) + len(shared) <= self.num_free_blocks

    def append_slots(self, request_id, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` more positions; False (nothing changed) if out of blocks."""
        req = self._req(request_id)
        if num_tokens < 0:
            raise ValueError(f"append_slots: num_tokens={num_tokens} < 0")
        start, end = req.num_tokens, req.num_tokens + num_tokens
        new = self.blocks_needed(end) - len(req.block_table)
        shared = self._shared_blocks_in(req, start, min(end, len(req.block_table) * self.block_size))
        if max(new, 0) + len(shared) > self.num_free_blocks:
            return False
        self.pending_copies.extend(self._copy_on_write(req, shared))
        for _ in range(new):
            req.block_table.append(self._take_free())
        req.num_tokens = end
        return True

    def pop_pending_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def commit(self, request_id, token_ids: list[int], all_caches_upto: int | None = None) -> None:
        """``token_ids`` (the request's full sequence so far) is final: register its full blocks
        for prefix sharing. Only positions that have a slot (< num_tokens, whose KV the caller has
        written) count, so passing a sampled-but-not-yet-fed last token is fine.

        ``all_caches_upto``: positions below it have KV in every cache, the rest of ``token_ids``
        only in the first (target) cache; None: every cache holds all of them."""
        req = self._req(request_id)
        if not self.enable_prefix_sharing:
            return
        bs = self.block_size
        full = min(len(token_ids), req.num_tokens) // bs
        in_all = full if all_caches_upto is None else min(full, max(all_caches_upto, 0) // bs)
        parent = req.block_hashes[-1] if req.block_hashes else _ROOT_HASH
        for i in range(len(req.block_hashes), full):
            h = _block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            blk = req.block_table[i]
            if h not in self._block_of_hash and blk not in self._hash_of_block:
                self._block_of_hash[h] = blk
                self._hash_of_block[blk] = h
                if i >= in_all:
                    self._target_only.add(blk)
            req.block_hashes.append(h)
            parent = h
        # blocks this request has now written everywhere (a lagging draft caught up)
        for i in range(req.valid_in_all, in_all):
            self._target_only.discard(req.block_table[i])
        req.valid_in_all = max(req.valid_in_all, in_all)

    def rollback(self, request_id, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions (no copy); frees blocks no longer used."""
        req = self._req(request_id)
        if not 0 <= num_tokens <= req.num_tokens:
            raise ValueError(f"rollback: num_tokens={num_tokens} not in [0, {req.num_tokens}]")
        req.num_tokens -= num_tokens
        keep = self.blocks_needed(req.num_tokens)
        for blk in req.block_table[keep:]:
            self._decref(blk)
        del req.block_table[keep:]
        full = req.num_tokens // self.block_size
        req.valid_in_all = min(req.valid_in_all, full)
        if len(req.block_hashes) > full:
            # the block at index `full` will be rewritten: if it is ours alone, its hash is stale now
            if full < len(req.block_table) and self._ref[req.block_table[full]] == 1:
                self._unregister(req.block_table[full])
            del req.block_hashes[full:]

    def fork(self, parent_id, child_id) -> list[tuple[int, int]]:
        """Copy-on-write fork: the child shares all the parent's full blocks; the partially
        filled last block is copied now. Returns the (src, dst) copies to apply to every
        cache before either request writes again. Raises OutOfBlocksError (nothing changed)."""
        if child_id in self._reqs:
            raise ValueError(f"fork: request {child_id!r} already exists")
        par = self._req(parent_id)
        partial = par.num_tokens % self.block_size != 0
        if partial and self.num_free_blocks < 1:
            raise OutOfBlocksError(f"fork {parent_id!r} -> {child_id!r}: no free block for the partial last block")
        table = list(par.block_table)
        copies = []
        for blk in table[:-1] if partial else table:
            self._incref(blk)
        if partial:
            dst = self._take_free()
            copies.append((table[-1], dst))
            table[-1] = dst
        self._reqs[child_id] = _Request(block_table=table, num_tokens=par.num_tokens,
                                        block_hashes=list(par.block_hashes), valid_in_all=par.valid_in_all)
        return copies

    def prepare_write(self, request_id, start_pos: int, num_tokens: int) -> list[tuple[int, int]]:
        """Before writing positions ``start_pos .. start_pos+num_tokens-1``: give the request its
        own copy of every block there that is shared (refcount > 1). Returns (src, dst) copies
        to apply with ONE copy_blocks over all caches. Raises OutOfBlocksError (nothing changed)."""
        req = self._req(request_id)
        end = min(start_pos + num_tokens, len(req.block_table) * self.block_size)
        shared = self._shared_blocks_in(req, start_pos, end)
        if len(shared) > self.num_free_blocks:
            raise OutOfBlocksError(f"prepare_write {request_id!r}: {len(shared)} blocks to copy, "
                                   f"{self.num_free_blocks} free")
        return self._copy_on_write(req, shared)

    def _shared_blocks_in(self, req: _Request, start: int, end: int) -> list[int]:
        if end <= start:
            return []
        bs = self.block_size
        return [i for i in range(start // bs, (end - 1) // bs + 1) if self._ref[req.block_table[i]] > 1]

    def _copy_on_write(self, req: _Request, indices: list[int]) -> list[tuple[int, int]]:
        copies = []
        for i in indices:
            src = req.block_table[i]
            dst = self._take_free()
            self._decref(src)
            req.block_table[i] = dst
            copies.append((src, dst))
            del req.block_hashes[i:]  # the copy is about to be rewritten
            req.valid_in_all = min(req.valid_in_all, i)
        return copies

    def free(self, request_id) -> None:
        """Return every block of the request (ref-counted); unknown ids are ignored (cancel is idempotent)."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        for blk in reversed(req.block_table):  # tail blocks are evicted before the shared prefix
            self._decref(blk)


# ----------------------------------------------------------------------------- tensors
def as_dtype(dtype) -> torch.dtype:
    """A torch dtype, or its name ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" or not isinstance(dtype, str):
        raise ValueError(f"dtype must be a torch dtype or one of float32, bfloat16, float16, got {dtype!r}")
    return resolve_dtype(dtype, None)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype, device,
                      num_layers: int | None = None) -> torch.Tensor:
    """Zeroed cache ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``. On the CPU its
    pages come zeroed from the OS (an anonymous mapping) and are committed when first written:
    even a cache sized for the worst case is built at once and costs memory for the blocks in use."""
    layers = config.num_layers if num_layers is None else num_layers
    dtype = as_dtype(dtype)
    shape = (layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type == "cpu" and nbytes > 0:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_block(configs: list[ModelConfig], block_size: int, dtype) -> int:
    elem = torch.empty((), dtype=as_dtype(dtype)).element_size()
    return sum(c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * elem for c in configs)


def _available_memory(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for_budget(configs: list[ModelConfig], block_size: int, dtype, budget: int | float, device) -> int:
    """How many blocks fit a budget: bytes (int) or a fraction in (0, 1] (float) of the free memory
    of ``device`` (CUDA: ``mem_get_info``; CPU: MemAvailable). Every block holds all ``configs``'
    layers (target + draft share block ids). Raises ValueError if not even one block fits."""
    per_block = kv_bytes_per_block(configs, block_size, dtype)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"memory budget fraction must be in (0, 1], got {budget}")
        nbytes = int(_available_memory(device) * budget)
    else:
        nbytes = int(budget)
    n = nbytes // per_block
    if n < 1:
        raise ValueError(f"KV cache budget of {nbytes} bytes holds no block ({per_block} bytes per block)")
    return n


def kv_cache_blocks(configs: list[ModelConfig], spec, dtype, device, max_model_len: int) -> int:
    """The engine's block count: ``spec.kv_cache_budget`` of the device's free memory (or bytes).
    On a CPU a budget fraction is capped at what the workload can use: max_batch_size requests
    at max_model_len (+2 blocks each for drafts and a partial block) and a margin of 64 blocks."""
    num_blocks = num_blocks_for_budget(configs, spec.block_size, dtype, spec.kv_cache_budget, device)
    if torch.device(device).type == "cpu" and isinstance(spec.kv_cache_budget, float):
        num_blocks = min(num_blocks, 64 + spec.max_batch_size * (max_model_len // spec.block_size + 2))
    return num_blocks


class PagedKVCache:
    """A KVCacheManager plus one cache tensor per model, e.g. {"target": T, "draft": D}.

    The engine's one handle on the KV cache: every copy-on-write copy the manager asks for is
    applied here with one ``copy_blocks`` over all caches, so callers never see the manager.
    """

    def __init__(self, configs: dict[str, ModelConfig], num_blocks: int, block_size: int = 16,
                 dtype=torch.float32, device="cpu", enable_prefix_sharing: bool = True,
                 num_layers: dict[str, int] | None = None):
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_sharing)
        self.block_size = block_size
        self.device = torch.device(device)
        num_layers = num_layers or {}
        self.caches: dict[str, torch.Tensor] = {
            name: allocate_kv_cache(cfg, num_blocks, block_size, dtype, device, num_layers.get(name))
            for name, cfg in configs.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.caches[name]

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64)  # [P, 2] on the host: ops validates it there
            copy_blocks(list(self.caches.values()), mapping)

    # -- queries
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.manager.can_allocate(num_tokens)

    def has_request(self, request_id) -> bool:
        return self.manager.has_request(request_id)

    def block_table(self, request_id) -> list[int]:
        return self.manager.block_table(request_id)

    def num_tokens(self, request_id) -> int:
        return self.manager.num_tokens(request_id)

    def cached_in_all_caches(self, request_id) -> int:
        return self.manager.cached_in_all_caches(request_id)

    # -- lifecycle (copies applied immediately)
    def allocate(self, request_id, token_ids: list[int]) -> int | None:
        return self.manager.allocate(request_id, token_ids)

    def append_slots(self, request_id, num_tokens: int) -> bool:
        ok = self.manager.append_slots(request_id, num_tokens)
        self._apply_copies(self.manager.pop_pending_copies())
        return ok

    def commit(self, request_id, token_ids: list[int], all_caches_upto: int | None = None) -> None:
        self.manager.commit(request_id, token_ids, all_caches_upto)

    def rollback(self, request_id, num_tokens: int) -> None:
        self.manager.rollback(request_id, num_tokens)

    def fork(self, parent_id, child_id) -> None:
        self._apply_copies(self.manager.fork(parent_id, child_id))

    def free(self, request_id) -> None:
        self.manager.free(request_id)

    def metadata(self, request_ids: list, query_lens: list[int], max_model_len: int | None = None) -> AttentionMetadata:
        """Metadata for a forward over the last ``query_lens[i]`` positions of each request."""
        seq_lens = [self.manager.num_tokens(r) for r in request_ids]
        tables = [self.manager.block_table(r) for r in request_ids]
        return AttentionMetadata.build(seq_lens, query_lens, tables, self.block_size, self.device, max_model_len)
