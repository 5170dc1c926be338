"""Attention metadata and the KV-cache writes the model's attention layers issue.

Below the model code (``llama``, ``attention_path``, ``draft_model``: they read the metadata and
write K/V) and the KV cache (``kv_cache``: it builds the metadata from its block tables).
``write_kv`` / ``copy_blocks`` / ``copy_slots`` are thin wrappers over the ``specrt.ops`` kernels;
their pure-torch oracle is ``specrt.ops.reference``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from specrt import ops


def write_kv(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, kv_heads, D] into ``cache[layer]`` at ``slot_mapping`` [T] (-1 = skip)."""
    ops.write_kv(cache, layer, k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous(), slot_mapping)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy whole blocks ``block_mapping[:, 0] -> block_mapping[:, 1]`` in every layer of every cache."""
    if block_mapping.numel():
        ops.copy_blocks(caches, block_mapping)


def copy_slots(caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """Copy single token slots ``slot_mapping[:, 0] -> slot_mapping[:, 1]`` in every layer of every cache
    (all sources read before any destination is written: an accepted tree path's KV moving down)."""
    if slot_mapping.numel():
        ops.copy_slots(caches, slot_mapping)


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``: as is for the CPU; else staged in pinned memory (torch's caching host
    allocator keeps it alive until the copy is done) and copied without blocking (host -> device only)."""
    if device is None or torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _dedupe_shared_slots(slots: list[int], token_ids: list[int]) -> None:
    """In place: later rows that write an already-written slot with the same token get -1."""
    if len(token_ids) != len(slots):
        raise ValueError(f"token_ids has {len(token_ids)} entries, the batch has {len(slots)} new tokens")
    if len(set(slots)) == len(slots):
        return
    first: dict[int, int] = {}
    for i, s in enumerate(slots):
        j = first.setdefault(s, i)
        if j != i:
            if int(token_ids[j]) != int(token_ids[i]):
                raise ValueError(f"slot {s} is shared by rows {j} and {i} with different tokens "
                                 f"({token_ids[j]} != {token_ids[i]}): a shared block must not be rewritten")
            slots[i] = -1


@dataclass(frozen=True)
class KVWindow:
    """A draft's view of a long context (StreamingLLM-style, as TriForce and MagicDec draft): the
    first ``sinks`` positions (attention sinks) plus at least the last ``recent`` positions
    before each new token, in whole KV blocks. The view is a shorter block table over the same
    blocks: keys keep the positions they were written at (RoPE is applied before the write), and
    the causal order survives because the recent blocks are contiguous up to the new tokens."""

    sinks: int       # first positions always attended (rounded up to whole blocks)
    recent: int      # positions before each new token always attended (> 0)

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.recent < 1:
            raise ValueError(f"KVWindow needs sinks >= 0 and recent >= 1, got {self.sinks}, {self.recent}")

    def view(self, seq_len: int, query_len: int, block_table: list[int], block_size: int) -> tuple[list[int], int]:
        """(blocks the new tokens attend to, the view's sequence length) of one request whose
        ``query_len`` new tokens end at ``seq_len``."""
        nb = -(-seq_len // block_size)
        keep_head = -(-self.sinks // block_size)
        first_recent = max(seq_len - query_len - self.recent + 1, 0) // block_size
        if first_recent <= keep_head:
            return list(block_table[:nb]), seq_len
        dropped = first_recent - keep_head
        return list(block_table[:keep_head]) + list(block_table[first_recent:nb]), seq_len - dropped * block_size


@dataclass
class AttentionMetadata:
    """One forward call over a mixed batch of B requests, T new tokens in all.

    Request b's new tokens are rows ``query_start_loc[b]:query_start_loc[b+1]`` of the
    flattened batch; they sit at positions ``seq_lens[b] - query_lens[b] .. seq_lens[b] - 1``.
    """
    query_start_loc: torch.Tensor  # [B+1] int64 cumulative query lengths
    seq_lens: torch.Tensor         # [B] int64 context length INCLUDING this call's new tokens
    block_tables: torch.Tensor     # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor     # [T] int64 slot of each new token (-1 = padding, not written)
    query_lens_host: list[int]     # [B] host copy: the torch attention path never syncs
    seq_lens_host: list[int]       # [B] host copy
    block_size: int
    query_lens: torch.Tensor | None = None         # [B] int64
    token_request_ids: torch.Tensor | None = None  # [T] int64 request index of each row
    token_query_idx: torch.Tensor | None = None    # [T] int64 index of each row within its request
    scratch: dict = field(default_factory=dict, repr=False)  # per-call cache (attention masks), reused across layers
    context_lens_host: list[int] | None = None     # [B] true lengths when a KVWindow view shortened seq_lens
    tree_mask: torch.Tensor | None = None  # [T] int64 ancestor bits per new token (None: causal)
    tree_requests_host: list[bool] | None = None   # [B] host: request b has a row whose tree_mask is not -1
    verify_requests_host: list[bool] | None = None  # [B] host: request b's rows are a pending token + drafts
                                                    # (the kernel attends them at any count, as decoding would)

    def tree_requests(self) -> list[bool]:
        """[B] whether request b's rows carry tree masks (host only; without tree_requests_host every
        request counts as one when tree_mask is set)."""
        if self.tree_mask is None:
            return [False] * self.num_requests
        return self.tree_requests_host or [True] * self.num_requests

    @property
    def max_context_len(self) -> int:
        """The longest request's true length (its last position + 1), whatever view it attends."""
        return max(self.context_lens_host or self.seq_lens_host)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @staticmethod
    def build(seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int,
              device=None, max_model_len: int | None = None,
              token_ids: list[int] | None = None, window: KVWindow | None = None,
              write: bool = True, tree_mask: list[int] | None = None,
              verify: list[bool] | None = None) -> "AttentionMetadata":
        """Metadata for requests with ``seq_lens[b]`` total positions of which the last ``query_lens[b]`` are new.

        ``slot_mapping`` is computed from positions ``seq_len - query_len .. seq_len - 1``.
        Raises ValueError on inconsistent lengths, too-short block tables, or a request longer
        than ``max_model_len`` (when given).

        ``token_ids`` (the host token of every row; pass it when rows may recompute a shared
        block, e.g. several requests catching up a lagging cache over the same target-only
        prefix): a slot that several rows map to is written by the first only (-1 for the
        others: the same token at the same position of the same prefix has the same KV); rows
        that share a slot with different tokens raise ValueError. Without it every slot must
        be distinct (write_kv refuses duplicates).

        ``window``: the new tokens attend to that view of their context (block tables and seq_lens
        are the view's; slots and positions stay the true ones). ``write`` False: every slot is -1
        (the new tokens' K/V are already in the cache and are read from there).

        ``verify`` ([B], speculative steps): request b's rows are its pending token and drafts, so the
        paged-attention kernel attends them whatever their number (each row's bits then equal
        decoding its token; a longer chunk otherwise goes to SDPA like a prefill).

        ``tree_mask`` (token trees): one signed int64 per new token in row order, its ancestor bits
        (``ops.paged_attention``: bit d lets it see the key d positions back, for d < 64; -1 =
        causal, as for fresh prefills and other requests of the batch).
        """
        B = len(seq_lens)
        if len(query_lens) != B or len(block_tables) != B:
            raise ValueError(f"seq_lens ({B}), query_lens ({len(query_lens)}) and block_tables "
                             f"({len(block_tables)}) must have one entry per request")
        if B == 0:
            raise ValueError("AttentionMetadata.build: empty batch")
        slots: list[int] = []
        req_ids: list[int] = []
        q_idx: list[int] = []
        for b, (s, q, bt) in enumerate(zip(seq_lens, query_lens, block_tables)):
            if q < 1 or q > s:
                raise ValueError(f"request {b}: query_len={q} must be in [1, seq_len={s}]")
            if max_model_len is not None and s > max_model_len:
                raise ValueError(f"request {b}: {s} tokens exceed the model's context of {max_model_len} tokens")
            need = -(-s // block_size)
            if len(bt) < need or any(x < 0 for x in bt[:need]):
                raise ValueError(f"request {b}: block table has {len(bt)} blocks ({bt[:need]}), "
                                 f"{need} needed for {s} tokens with block_size={block_size}")
            for p in range(s - q, s):
                slots.append(bt[p // block_size] * block_size + p % block_size)
            req_ids.extend([b] * q)
            q_idx.extend(range(q))
        if token_ids is not None:
            _dedupe_shared_slots(slots, token_ids)
        if not write:
            slots = [-1] * len(slots)
        context_lens = None
        if window is not None:
            views = [window.view(s, q, bt, block_size) for s, q, bt in zip(seq_lens, query_lens, block_tables)]
            if any(v[1] != s for v, s in zip(views, seq_lens)):
                context_lens = [int(s) for s in seq_lens]
                block_tables, seq_lens = [v[0] for v in views], [v[1] for v in views]
        max_blocks = max(len(bt) for bt in block_tables)
        bt_pad = [list(bt) + [-1] * (max_blocks - len(bt)) for bt in block_tables]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        tree_requests = None
        if tree_mask is not None:
            try:
                tree_mask = [operator.index(x) for x in tree_mask]
            except TypeError as exc:
                raise TypeError(f"tree_mask must hold integers: {exc}") from None
            if len(tree_mask) != len(slots):
                raise ValueError(f"tree_mask has {len(tree_mask)} entries, the batch has {len(slots)} new tokens")
            if any(not -2**63 <= x < 2**63 for x in tree_mask):
                raise ValueError("tree_mask values must be signed int64 (a mask with bit 63 set is negative)")
            tree_requests = [any(x != -1 for x in tree_mask[qsl[b]:qsl[b + 1]]) for b in range(B)]

        # every int64 field from ONE host tensor (one copy to the device), the block tables from another
        parts = (qsl, list(seq_lens), slots, list(query_lens), req_ids, q_idx)
        if tree_mask is not None:
            parts += (tree_mask,)
        ints = torch.split(_to_device(torch.tensor([v for p in parts for v in p], dtype=torch.int64), device),
                           [len(p) for p in parts])
        return AttentionMetadata(
            query_start_loc=ints[0],
            seq_lens=ints[1],
            block_tables=_to_device(torch.tensor(bt_pad, dtype=torch.int32), device).view(B, max_blocks),
            slot_mapping=ints[2],
            query_lens_host=[int(q) for q in query_lens],
            seq_lens_host=[int(s) for s in seq_lens],
            block_size=block_size,
            query_lens=ints[3],
            token_request_ids=ints[4],
            token_query_idx=ints[5],
            context_lens_host=context_lens,
            tree_mask=ints[6] if tree_mask is not None else None,
            tree_requests_host=tree_requests,
            verify_requests_host=None if verify is None else [bool(v) for v in verify],
        )

    def ensure_derived(self) -> None:
        """Fill the derived per-token index tensors if the metadata was constructed by hand."""
        if self.token_request_ids is None:
            dev = self.seq_lens.device
            self.query_lens = torch.tensor(self.query_lens_host, dtype=torch.int64).to(dev)
            self.token_request_ids = torch.tensor(
                [b for b, q in enumerate(self.query_lens_host) for _ in range(q)], dtype=torch.int64).to(dev)
            self.token_query_idx = torch.tensor(
                [i for q in self.query_lens_host for i in range(q)], dtype=torch.int64).to(dev)
