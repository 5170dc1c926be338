"""The attention of a decoder layer over the paged KV cache: which requests go where, and the calls.

Rows attend with ``ops.paged_attention``, a kernel that reads the paged blocks in place (no gather
copy), causal within the new tokens, GQA, sliding window, float32 accumulation; a row's bits depend
only on its query and its keys. On the CPU every row takes it, prefill included, so a request's
output does not depend on its batch neighbours or on which of its blocks were cached. On other
devices fresh prefills (no earlier context) attend over their own new K/V with
``F.scaled_dot_product_attention`` (``is_causal``), and chunks of more than _KERNEL_MAX_QUERY tokens
after a cached prefix gather their blocks and use SDPA. The torch path (``paged_attention_sdpa``:
half-precision attention, the ``set_attention_backend("sdpa")`` reference) splits the requests
into three groups (decided from host-side lengths, no device->host sync):
  * fresh prefills, as above;
  * everything else (decode, K+1 verify, chunks after a cached prefix): ONE padded batch
    ``[B, max_q]`` x ``[B, max_ctx]`` with a boolean mask — except chunks longer than
    _LONG_QUERY tokens that would make the padded batch > 4x the useful work: those run
    alone (one gather + SDPA each); and a verify that mixes one-query requests (nothing
    drafted) with K+1-query ones, when padding would be most of the work, runs as two
    batches (one-query, multi-query).
  * decode fast path: when every request has one query at the same length (always at batch 1)
    the keys are cut to exactly the context and SDPA runs without a mask.
K and V of all the blocks a batch reads are fetched with ONE ``index_select`` per layer. The
grouping (:class:`_Plan`) is built once per AttentionMetadata and reused by every layer.

Token trees (``meta.tree_mask``): a request whose rows carry ancestor bits is never a fresh prefill
(its new tokens are not a causal chain); on the kernel path it stays on the kernel whatever its
query length, and every SDPA mask (padded batch, long chunk) applies the same bits as the kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specrt import ops
from specrt.models.attention import AttentionMetadata

_LONG_QUERY = 16  # longer chunks may run alone rather than pad the batch (see _Plan.sdpa)
_KERNEL_MAX_QUERY = 16  # longer chunks (prefill after a cached prefix) attend with SDPA, a GEMM-shaped problem
_PAGED_ATTENTION = torch.ops.specrt.paged_attention.default
_TREE_BITS = 64  # keys this close behind a query obey its tree bits (csrc/include/specrt/attention.h)


def _tree_visible(tree_mask: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """Whether ancestor bits ``tree_mask`` keep the key ``back`` positions behind their query (broadcast;
    ops.paged_attention's rule; back < 0 is left to the causal mask)."""
    return (back >= _TREE_BITS) | (tree_mask.bitwise_right_shift(back.clamp(0, _TREE_BITS - 1)) & 1).bool()


class _Group:
    """Requests attended as ONE padded batch [B, max_q] x [B, ctx] (one gather, one SDPA)."""

    def __init__(self, meta: AttentionMetadata, members: list[int], starts: list[int], whole: bool,
                 tree: list[bool]):
        qls, sls = meta.query_lens_host, meta.seq_lens_host
        bs = meta.block_size
        dev = meta.seq_lens.device
        self.members = members
        self.max_q = max(qls[b] for b in members)
        self.max_s = max(sls[b] for b in members)
        self.num_blocks = -(-self.max_s // bs)
        if whole:
            self.rows = None  # every row, in order
            self.req = meta.token_request_ids
            self.qi = meta.token_query_idx
            self.block_tables = meta.block_tables[:, : self.num_blocks]
            q_lens, s_lens = meta.query_lens, meta.seq_lens
        else:
            rows, req, qi = [], [], []
            for j, b in enumerate(members):
                rows.extend(range(starts[b], starts[b] + qls[b]))
                req.extend([j] * qls[b])
                qi.extend(range(qls[b]))
            self.rows, self.req, self.qi = _device_ints(rows, dev), _device_ints(req, dev), _device_ints(qi, dev)
            sel = _device_ints(members, dev)
            self.block_tables = meta.block_tables[sel, : self.num_blocks]
            q_lens = _device_ints([qls[b] for b in members], dev)
            s_lens = _device_ints([sls[b] for b in members], dev)
        self.block_tables = self.block_tables.clamp(min=0).long()  # -1 pads are masked anyway
        self._q_lens, self._s_lens, self._ctx, self._dev = q_lens, s_lens, self.num_blocks * bs, dev
        self._tree = None  # [B, max_q] ancestor bits of the padded rows (padding -1), when a member has some
        if any(tree[b] for b in members):
            rows_mask = meta.tree_mask[: self.req.shape[0]] if self.rows is None else meta.tree_mask[self.rows]
            self._tree = torch.full((len(members), self.max_q), -1, dtype=torch.int64, device=dev)
            self._tree[self.req, self.qi] = rows_mask
        # decode fast path: one query per request at the same length -> keys [0, s) need no mask
        self.uniform_decode = self._tree is None and self.max_q == 1 and all(sls[b] == self.max_s for b in members)
        self._masks: dict = {}

    def batched_mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, max_q, ctx] mask of the padded batch; None when keys are cut to [0, max_s) instead."""
        if self.uniform_decode and (window is None or window >= self.max_s):
            return None
        if window not in self._masks:
            i = torch.arange(self.max_q, device=self._dev)
            s_lens, q_lens = self._s_lens, self._q_lens
            # position of query i of request b; padded query rows reuse the last position (never fully masked)
            qp = torch.minimum((s_lens - q_lens)[:, None] + i, (s_lens - 1)[:, None])[:, :, None]  # [B, max_q, 1]
            k_pos = torch.arange(self._ctx, device=self._dev)
            m = k_pos <= qp  # [B, max_q, ctx]
            if window is not None:
                m = m & (k_pos > qp - window)
            if self._tree is not None:
                m = m & _tree_visible(self._tree[:, :, None], qp - k_pos)
            self._masks[window] = m[:, None]  # [B, 1, max_q, ctx]
        return self._masks[window]


def _device_ints(x: list[int], device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)  # host -> device only, no sync


class _KernelBatch:
    """Requests attended by the paged-attention kernel in one call (decode and K+1 verify rows).

    whole: every request of the metadata, in order (its tensors as they are); else the members'
    rows are gathered from q (``rows``) with their own block tables / lengths."""

    def __init__(self, meta: AttentionMetadata, members: list[int], starts: list[int], whole: bool,
                 tree: list[bool]):
        qls, sls = meta.query_lens_host, meta.seq_lens_host
        dev = meta.seq_lens.device
        self.max_q = max(qls[b] for b in members)
        self.max_s = max(sls[b] for b in members)
        has_tree = any(tree[b] for b in members)
        self._tree_rows: dict = {}
        if whole:
            self.rows = None
            self.block_tables, self.seq_lens = meta.block_tables, meta.seq_lens
            self.query_start_loc = meta.query_start_loc
            self.tree_mask = meta.tree_mask if has_tree else None  # [rows] int64 or None (all causal)
            return
        rows, qsl = [], [0]
        for b in members:
            rows.extend(range(starts[b], starts[b] + qls[b]))
            qsl.append(qsl[-1] + qls[b])
        sel = _device_ints(members, dev)
        self.rows = _device_ints(rows, dev)  # [T_kernel] rows of q
        self.block_tables = meta.block_tables.index_select(0, sel)  # [B_kernel, max_blocks] int32
        self.seq_lens = meta.seq_lens.index_select(0, sel)  # [B_kernel] int64
        self.query_start_loc = _device_ints(qsl, dev)  # [B_kernel + 1] int64
        self.tree_mask = meta.tree_mask.index_select(0, self.rows) if has_tree else None  # [T_kernel] int64

    def tree_rows(self, T: int) -> torch.Tensor | None:
        """The kernel's tree_mask for a q of T rows (trailing padding rows -1), or None (all causal)."""
        if self.tree_mask is None or self.tree_mask.shape[0] == T:
            return self.tree_mask
        if T not in self._tree_rows:
            pad = self.tree_mask.new_full((T - self.tree_mask.shape[0],), -1)
            self._tree_rows[T] = torch.cat([self.tree_mask, pad])
        return self._tree_rows[T]


class _Plan:
    """How one AttentionMetadata's requests are grouped (host lists only; built once per call).

    ``kernel()``: on the CPU every request goes to the paged-attention kernel. Elsewhere fresh
    prefills (no earlier context) attend over their own new K/V with SDPA, requests with at most
    _KERNEL_MAX_QUERY new tokens go to the kernel, and longer chunks after a cached prefix run alone
    through a gather + SDPA. ``sdpa()``: half-precision attention and the reference path, padded
    gather + SDPA batches."""

    def __init__(self, meta: AttentionMetadata):
        meta.ensure_derived()
        qls, sls = meta.query_lens_host, meta.seq_lens_host
        starts = [0]
        for q in qls:
            starts.append(starts[-1] + q)
        self.tree = meta.tree_requests()  # [B] rows with tree bits: never fresh, any length on the kernel
        self.fresh: list[tuple[int, int, int]] = []  # (request, row start, q)
        self.rest: list[int] = []
        for b, (q, s) in enumerate(zip(qls, sls)):
            if q == s and q > 1 and not self.tree[b]:
                self.fresh.append((b, starts[b], q))
            else:
                self.rest.append(b)
        self.num_rows = starts[-1]
        self._meta, self._starts = meta, starts
        self._sdpa: tuple | None = None
        self._kernel: tuple | None = None
        self._masks: dict = {}

    def kernel(self) -> tuple[list[tuple[int, int, int, int]], _KernelBatch | None]:
        """(long chunks (request, row start, q, seq_len) for gather + SDPA, the kernel's batch or None)."""
        if self._kernel is None:
            qls, sls, starts = self._meta.query_lens_host, self._meta.seq_lens_host, self._starts
            verify = self._meta.verify_requests_host or [False] * len(qls)
            if self._meta.seq_lens.device.type == "cpu":  # every request: one path, whatever its neighbours
                members, long = list(range(len(qls))), []
            else:
                on_kernel = [qls[b] <= _KERNEL_MAX_QUERY or self.tree[b] or verify[b] for b in range(len(qls))]
                members = [b for b in self.rest if on_kernel[b]]
                long = [(b, starts[b], qls[b], sls[b]) for b in self.rest if not on_kernel[b]]
            batch = (_KernelBatch(self._meta, members, starts, len(members) == len(qls), self.tree)
                     if members else None)
            self._kernel = (long, batch)
        return self._kernel

    def sdpa(self) -> tuple[list[tuple[int, int, int, int]], list[_Group], bool]:
        """(long chunks, padded groups, all_batched: one group holding every request in order)."""
        if self._sdpa is None:
            qls, sls, starts = self._meta.query_lens_host, self._meta.seq_lens_host, self._starts
            long: list[tuple[int, int, int, int]] = []
            # pad the rest into one batch unless a long chunk would mostly pad it: then it runs alone
            rest = sorted(self.rest, key=lambda b: qls[b])
            while len(rest) > 1 and qls[rest[-1]] > _LONG_QUERY:
                padded = len(rest) * qls[rest[-1]] * max(sls[b] for b in rest)
                useful = sum(qls[b] * sls[b] for b in rest)
                if padded <= 4 * useful:
                    break
                b = rest.pop()
                long.append((b, starts[b], qls[b], sls[b]))
            groups: list[_Group] = []
            if rest:
                # a verify step mixes one-query requests (nothing drafted) with K+1-query ones: padded
                # together, every one-query request would attend max_q rows; split in two batches
                # when that padding is most of the work (a second SDPA costs less than that)
                one = sorted(b for b in rest if qls[b] == 1)
                multi = sorted(b for b in rest if qls[b] > 1)
                if one and multi and len(rest) * qls[rest[-1]] > 2 * sum(qls[b] for b in rest):
                    groups = [_Group(self._meta, one, starts, False, self.tree),
                              _Group(self._meta, multi, starts, False, self.tree)]
                else:
                    members = sorted(rest)
                    groups = [_Group(self._meta, members, starts, len(members) == len(qls), self.tree)]
            all_batched = len(groups) == 1 and groups[0].rows is None
            self._sdpa = (long, groups, all_batched)
        return self._sdpa

    def mask(self, key, q: int, s: int, window: int | None, device,
             tree_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """[q, s] mask for queries at positions s-q..s-1 over keys 0..s-1 (None = plain causal, q == s);
        tree_mask [q]: the queries' ancestor bits."""
        if window is None and q == s and tree_mask is None:
            return None
        key = (key, window)
        if key not in self._masks:
            qp = torch.arange(s - q, s, device=device)[:, None]
            kp = torch.arange(s, device=device)
            m = kp <= qp
            if window is not None:
                m = m & (kp > qp - window)
            if tree_mask is not None:
                m = m & _tree_visible(tree_mask[:, None], qp - kp)
            self._masks[key] = m
        return self._masks[key]


def _plan(meta: AttentionMetadata) -> _Plan:
    plan = meta.scratch.get("llama_plan")
    if plan is None:
        plan = meta.scratch["llama_plan"] = _Plan(meta)
    return plan


def kernel_batch(meta: AttentionMetadata) -> _KernelBatch | None:
    """The kernel batch of ``meta`` when every request attends through the paged-attention kernel in
    one call (always on the CPU; elsewhere decode, verify and tree batches: no prefill, no causal
    chunk longer than _KERNEL_MAX_QUERY), else None."""
    _, batch = _plan(meta).kernel()
    return batch if batch is not None and batch.rows is None else None


def _attend_fresh(plan: _Plan, q, k, v, out, scale: float, window: int | None) -> None:
    """Fresh prefills: [1, H, n, D] over their own new K/V (causal SDPA, in q's dtype)."""
    gqa = q.shape[1] != k.shape[1]
    for b, start, n in plan.fresh:
        qs = q[start:start + n].transpose(0, 1)[None]
        ks = k[start:start + n].to(q.dtype).transpose(0, 1)[None]
        vs = v[start:start + n].to(q.dtype).transpose(0, 1)[None]
        m = plan.mask(("fresh", b), n, n, window, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, is_causal=m is None, scale=scale, enable_gqa=gqa)
        out[start:start + n] = o[0].transpose(0, 1)


def _attend_long(plan: _Plan, meta: AttentionMetadata, long, q, layer_cache, out, scale: float,
                 window: int | None) -> None:
    """Long chunks after a cached prefix, one request at a time: gather its blocks, then SDPA."""
    _, bs, Hkv, D = layer_cache.shape[1:]
    gqa = q.shape[1] != Hkv
    for b, start, n, s in long:
        nb = -(-s // bs)
        blocks = meta.block_tables[b, :nb].long()
        kc = layer_cache[0, blocks].reshape(nb * bs, Hkv, D)[:s].to(q.dtype).transpose(0, 1)[None]
        vc = layer_cache[1, blocks].reshape(nb * bs, Hkv, D)[:s].to(q.dtype).transpose(0, 1)[None]
        qs = q[start:start + n].transpose(0, 1)[None]
        tree = meta.tree_mask[start:start + n] if plan.tree[b] else None
        m = plan.mask(("long", b), n, s, window, q.device, tree)
        o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=m, scale=scale, enable_gqa=gqa)
        out[start:start + n] = o[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    backend: str = "kernel") -> torch.Tensor:
    """Attention of the new tokens over their requests' paged context.

    q [T, H, D]; k/v [T, Hkv, D] (this call's, already written to the cache; any strides, read
    only by fresh prefills, in q's dtype there); layer_cache [2, num_blocks, block_size, Hkv, D].
    Returns [T, H, D] in q's dtype.

    backend "kernel": every row on the CPU; elsewhere decode and verify rows (up to _KERNEL_MAX_QUERY
    new tokens per request, and requests with tree bits in ``meta.tree_mask`` at any length) run through ``ops.paged_attention``
    straight over the paged blocks (float32 q only); fresh prefills and longer chunks use SDPA.
    "sdpa" (and half-precision q): the gather + SDPA path, :func:`paged_attention_sdpa`.
    """
    if backend == "sdpa" or q.dtype != torch.float32:
        return paged_attention_sdpa(q, k, v, layer_cache, meta, scale, window)
    plan = _plan(meta)
    long, batch = plan.kernel()
    w = window or 0
    if batch is not None and batch.rows is None:  # every request: one call (padding rows come back zero)
        return _PAGED_ATTENTION(q.contiguous(), layer_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, scale, w, batch.max_q, batch.max_s,
                                ops._check_values(q, None),  # CPU: always (cheap); CUDA: debug mode only
                                batch.tree_rows(q.shape[0]))
    T, H, D = q.shape
    out = q.new_zeros(T, H, D) if T > plan.num_rows else q.new_empty(T, H, D)
    _attend_fresh(plan, q, k, v, out, scale, window)
    _attend_long(plan, meta, long, q, layer_cache, out, scale, window)
    if batch is not None:
        o = ops.paged_attention(q.index_select(0, batch.rows), layer_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, scale, w, batch.max_q, batch.max_s,
                                tree_mask=batch.tree_mask)
        out.index_copy_(0, batch.rows, o)
    return out


def paged_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """The gather + SDPA path (same contract as :func:`paged_attention`): per layer, ONE
    ``index_select`` of every block the padded batch reads, then SDPA with a mask. Runs
    attention in q's dtype (half-precision attention, like transformers) and is the torch
    reference the kernel is checked against."""
    plan = _plan(meta)
    long, groups, all_batched = plan.sdpa()
    T, H, D = q.shape
    Hkv = k.shape[1]
    bs = layer_cache.shape[2]
    gqa = H != Hkv
    if T > plan.num_rows:  # trailing padding rows (slot -1) belong to no request: zeros
        out = q.new_zeros(T, H, D)
    elif all_batched and not plan.fresh and not long:
        out = None
    else:
        out = q.new_empty(T, H, D)
    _attend_fresh(plan, q, k, v, out, scale, window)
    _attend_long(plan, meta, long, q, layer_cache, out, scale, window)

    for g in groups:
        Bg, nb = g.block_tables.shape
        mask = g.batched_mask(window)
        # ONE gather of K and V (index_select of whole blocks: ~4x cheaper than advanced indexing)
        NB = layer_cache.shape[1]
        kv = layer_cache.view(2, NB, bs * Hkv * D).index_select(1, g.block_tables.view(-1))
        kv = kv.view(2, Bg, nb * bs, Hkv, D)
        if mask is None:
            kv = kv[:, :, :g.max_s]  # uniform decode: exactly the context, no mask
        kv = kv.to(q.dtype).transpose(2, 3)  # [2, B, Hkv, ctx, D]
        q_rows = q if g.rows is None else q[g.rows]
        if g.rows is None and T > plan.num_rows:
            q_rows = q[: plan.num_rows]
        if g.max_q == 1:
            qp = q_rows.view(Bg, 1, H, D)
        else:
            qp = q.new_zeros(Bg, g.max_q, H, D)
            qp[g.req, g.qi] = q_rows
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kv[0], kv[1], attn_mask=mask,
                                           scale=scale, enable_gqa=gqa).transpose(1, 2)  # [B, max_q, H, D]
        o_rows = o.reshape(Bg, H, D) if g.max_q == 1 else o[g.req, g.qi]
        if out is None:
            return o_rows
        if g.rows is None:
            out[: plan.num_rows] = o_rows
        else:
            out[g.rows] = o_rows
    return out
