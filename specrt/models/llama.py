"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Module and parameter names mirror transformers (``model.layers.0.self_attn.q_proj.weight``,
...) so a checkpoint's state dict loads as is. The numerics follow transformers too
(RMSNorm in fp32, RoPE cos/sin in fp32 cast to the activation dtype, lm_head in the
model dtype, logits returned as float32), so fp32 logits match to ~1e-6.

Attention: K/V are written with ``write_kv``; decode and K+1 verify rows then attend with
``ops.paged_attention``, a kernel that reads the paged blocks in place (no gather copy), causal
within the new tokens, GQA, sliding window, float32 accumulation. Fresh prefills (no earlier
context) attend over their own new K/V with ``F.scaled_dot_product_attention`` (``is_causal``),
and chunks of more than _KERNEL_MAX_QUERY tokens after a cached prefix gather their blocks and
use SDPA. The torch path (``paged_attention_sdpa``: half-precision attention, the
``set_attention_backend("sdpa")`` reference) splits the requests into three groups (decided
from host-side lengths, no device->host sync):
  * fresh prefills, as above;
  * everything else (decode, K+1 verify, chunks after a cached prefix): ONE padded batch
    ``[B, max_q]`` x ``[B, max_ctx]`` with a boolean mask — except chunks longer than
    _LONG_QUERY tokens that would make the padded batch > 4x the useful work: those run
    alone (one gather + SDPA each); and a verify that mixes one-query requests (nothing
    drafted) with K+1-query ones, when padding would be most of the work, runs as two
    batches (one-query, multi-query).
  * decode fast path: when every request has one query at the same length (always at batch 1)
    the keys are cut to exactly the context and SDPA runs without a mask.
K and V of all the blocks a batch reads are fetched with ONE ``index_select`` per layer.

Projections (specrt.models.linear): decode / verify rows (<= 128 by default) run on specrt's
small-M kernel — one pass over the weights for all rows, and the same reduction order for any
row count, so a verify row equals the decode of that token bit for bit (greedy speculative
output then equals autoregressive output in bf16 too); prefill runs on torch's GEMM; quantized
layers (QuantLinear) always run quantized. ``set_linear_kernel(0)`` switches the kernel off.

CPU overhead (a decode step of a small model is dominated by per-op costs, not FLOPs):
q/k/v and gate/up are fused into one projection each (``prepare``: the fused tensor is the storage
of the original parameters, so state_dict names and memory are unchanged — note safetensors'
``save_file`` refuses such shared storage: ``.clone()`` the tensors first); RoPE reads cos/sin
rows from a table indexed by position and rotates q and k together (roll + addcmul); RMSNorm
takes sum(x^2) from one ``vector_norm``; layers are called as plain methods (no nn.Module
``__call__``). Tensor parallelism (specrt.models.tp) swaps in row-/vocab-parallel modules
that this file calls like any other module.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specrt.attention import AttentionMetadata, write_kv
from specrt.models.config import ModelConfig
from specrt.models.linear import KernelPolicy, QuantEmbedding, QuantLinear, fuse_linears, prepare_linear

_LONG_QUERY = 16  # longer chunks may run alone rather than pad the batch (see _Plan.sdpa)
_KERNEL_MAX_QUERY = 16  # longer chunks (prefill after a cached prefix) attend with SDPA, a GEMM-shaped problem

try:  # the compiled paged-attention kernel; without it every call takes the gather + SDPA path
    from specrt import ops as _ops
    if not hasattr(_ops, "paged_attention"):
        _ops = None
except Exception:  # noqa: BLE001 - not built / import error
    _ops = None

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) with the statistics in fp32 (as transformers' LlamaRMSNorm).

    sum(x^2) comes from ``vector_norm`` (one fused reduction; ``mean(x.pow(2))`` and
    ``F.rms_norm`` cost ~3-10x more per call on the CPU); differs from transformers by ~1 ulp."""
    dtype = x.dtype
    xf = x.float()
    n = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # [T, 1]
    r = (n * n).mul_(1.0 / x.shape[-1]).add_(eps).rsqrt_()  # 1 / rms
    return weight * (xf * r).to(dtype)


class RotaryEmbedding:
    """RoPE tables: default, "linear", "dynamic" (NTK, per call) and "llama3" scaling."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.dim = config.head_dim
        self.scaling = config.rope_scaling or {}
        self.rope_type = self.scaling.get("rope_type", "default")
        self._cache: dict = {}

    def _base_inv_freq(self, base: float, device) -> torch.Tensor:
        d = self.dim
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / d))

    def inv_freq(self, device, seq_len: int) -> torch.Tensor:
        cfg, s, base = self.config, self.scaling, self.config.rope_theta
        if self.rope_type == "dynamic":
            max_pos = cfg.max_position_embeddings
            seq_len = max(seq_len, max_pos)
            key = (str(device), seq_len)
            if key not in self._cache:
                factor, d = s["factor"], self.dim
                base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
                self._cache[key] = self._base_inv_freq(base, device)
            return self._cache[key]
        key = str(device)
        if key in self._cache:
            return self._cache[key]
        inv = self._base_inv_freq(base, device)
        if self.rope_type == "linear":
            inv = inv / s["factor"]
        elif self.rope_type == "llama3":
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_ctx = s["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
            wavelen = 2 * math.pi / inv
            inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, inv_l)
        self._cache[key] = inv
        return inv

    def cos_sin(self, positions: torch.Tensor, dtype, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for ``positions`` [T] (all < seq_len, a host-side bound: no sync)."""
        if self.rope_type != "dynamic":  # one table per (device, dtype), rows indexed by position
            key = ("table", str(positions.device), dtype)
            table = self._cache.get(key)
            if table is None or table[0].shape[0] < seq_len:  # grow by doubling, up to the context
                n = min(max(256, 1 << (seq_len - 1).bit_length()), max(self.config.max_model_len, seq_len))
                table = self._cache[key] = self._cos_sin(torch.arange(n, device=positions.device), dtype, n)
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
        return self._cos_sin(positions, dtype, seq_len)

    def _cos_sin(self, positions: torch.Tensor, dtype, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq(positions.device, seq_len)
        freqs = positions[:, None].float() * inv  # [T, D/2] (exact: same numbers as the table rows)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_operands(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] -> (cos [T, 1, D], sin with its first half negated [T, 1, D]), once per forward,
    so that ``rotate_half(x) * sin == roll(x, D/2) * signed_sin`` exactly (negation is exact)."""
    half = cos.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None], signed_sin[:, None]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos / signed_sin [T, 1, D] from rope_operands: x*cos + rotate_half(x)*sin in 3-4 ops
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), signed_sin)
    # half precision: round each product like transformers does (addcmul rounds once: a different error)
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


# ----------------------------------------------------------------------------- attention plan
class _Group:
    """Requests attended as ONE padded batch [B, max_q] x [B, ctx] (one gather, one SDPA)."""

    def __init__(self, meta: AttentionMetadata, members: list[int], starts: list[int], whole: bool):
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
        # decode fast path: one query per request at the same length -> keys [0, s) need no mask
        self.uniform_decode = self.max_q == 1 and all(sls[b] == self.max_s for b in members)
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
            self._masks[window] = m[:, None]  # [B, 1, max_q, ctx]
        return self._masks[window]


def _device_ints(x: list[int], device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)  # host -> device only, no sync


class _KernelBatch:
    """Requests attended by the paged-attention kernel in one call (decode and K+1 verify rows).

    whole: every request of the metadata, in order (its tensors as they are); else the members'
    rows are gathered from q (``rows``) with their own block tables / lengths."""

    def __init__(self, meta: AttentionMetadata, members: list[int], starts: list[int], whole: bool):
        qls, sls = meta.query_lens_host, meta.seq_lens_host
        dev = meta.seq_lens.device
        self.max_q = max(qls[b] for b in members)
        self.max_s = max(sls[b] for b in members)
        if whole:
            self.rows = None
            self.block_tables, self.seq_lens = meta.block_tables, meta.seq_lens
            self.query_start_loc = meta.query_start_loc
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


class _Plan:
    """How one AttentionMetadata's requests are grouped (host lists only; built once per call).

    Fresh prefills (no earlier context) attend over their own new K/V with SDPA. The rest either
    go to the paged-attention kernel (``kernel()``: at most _KERNEL_MAX_QUERY new tokens each;
    longer chunks after a cached prefix run alone through a gather + SDPA) or, for half-precision
    attention and the reference path, to padded gather + SDPA batches (``sdpa()``)."""

    def __init__(self, meta: AttentionMetadata):
        meta.ensure_derived()
        qls, sls = meta.query_lens_host, meta.seq_lens_host
        starts = [0]
        for q in qls:
            starts.append(starts[-1] + q)
        self.fresh: list[tuple[int, int, int]] = []  # (request, row start, q)
        self.rest: list[int] = []
        for b, (q, s) in enumerate(zip(qls, sls)):
            if q == s and q > 1:
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
            members = [b for b in self.rest if qls[b] <= _KERNEL_MAX_QUERY]
            long = [(b, starts[b], qls[b], sls[b]) for b in self.rest if qls[b] > _KERNEL_MAX_QUERY]
            batch = _KernelBatch(self._meta, members, starts, len(members) == len(qls)) if members else None
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
                    groups = [_Group(self._meta, one, starts, False), _Group(self._meta, multi, starts, False)]
                else:
                    members = sorted(rest)
                    groups = [_Group(self._meta, members, starts, len(members) == len(qls))]
            all_batched = len(groups) == 1 and groups[0].rows is None
            self._sdpa = (long, groups, all_batched)
        return self._sdpa

    def mask(self, key, q: int, s: int, window: int | None, device) -> torch.Tensor | None:
        """[q, s] mask for queries at positions s-q..s-1 over keys 0..s-1 (None = plain causal, q == s)."""
        if window is None and q == s:
            return None
        key = (key, window)
        if key not in self._masks:
            qp = torch.arange(s - q, s, device=device)[:, None]
            kp = torch.arange(s, device=device)
            m = kp <= qp
            if window is not None:
                m = m & (kp > qp - window)
            self._masks[key] = m
        return self._masks[key]


def _plan(meta: AttentionMetadata) -> _Plan:
    plan = meta.scratch.get("llama_plan")
    if plan is None:
        plan = meta.scratch["llama_plan"] = _Plan(meta)
    return plan


def _attend_fresh(plan: _Plan, q, k, v, out, scale: float, window: int | None) -> None:
    """Fresh prefills: [1, H, n, D] over their own new K/V (causal SDPA)."""
    gqa = q.shape[1] != k.shape[1]
    for b, start, n in plan.fresh:
        qs = q[start:start + n].transpose(0, 1)[None]
        ks = k[start:start + n].transpose(0, 1)[None]
        vs = v[start:start + n].transpose(0, 1)[None]
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
        m = plan.mask(("long", b), n, s, window, q.device)
        o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=m, scale=scale, enable_gqa=gqa)
        out[start:start + n] = o[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    backend: str = "kernel") -> torch.Tensor:
    """Attention of the new tokens over their requests' paged context.

    q [T, H, D]; k/v [T, Hkv, D] (this call's, already written to the cache);
    layer_cache [2, num_blocks, block_size, Hkv, D]. Returns [T, H, D].

    backend "kernel": decode and verify rows (up to _KERNEL_MAX_QUERY new tokens per request) run
    through ``ops.paged_attention`` straight over the paged blocks (float32 q only); fresh prefills
    and longer chunks use SDPA. "sdpa" (and half-precision q, or no compiled kernels): the gather +
    SDPA path, :func:`paged_attention_sdpa`.
    """
    if backend == "sdpa" or _ops is None or q.dtype != torch.float32:
        return paged_attention_sdpa(q, k, v, layer_cache, meta, scale, window)
    plan = _plan(meta)
    long, batch = plan.kernel()
    w = window or 0
    if batch is not None and batch.rows is None:  # every request: one call (padding rows come back zero)
        return _ops.paged_attention(q.contiguous(), layer_cache, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, scale, w, batch.max_q, batch.max_s)
    T, H, D = q.shape
    out = q.new_zeros(T, H, D) if T > plan.num_rows else q.new_empty(T, H, D)
    _attend_fresh(plan, q, k, v, out, scale, window)
    _attend_long(plan, meta, long, q, layer_cache, out, scale, window)
    if batch is not None:
        o = _ops.paged_attention(q.index_select(0, batch.rows), layer_cache, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc, scale, w, batch.max_q, batch.max_s)
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


# ----------------------------------------------------------------------------- modules
class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = config.layer_window(layer_idx)
        self.attn_fp32 = True  # LlamaForCausalLM.set_attention_fp32 toggles it
        self.attn_backend = "kernel"  # LlamaForCausalLM.set_attention_backend toggles it
        hd = config.hidden_size
        self.q_proj = nn.Linear(hd, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hd, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hd, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hd, bias=config.o_proj_bias)
        self._qkv = None  # fused q/k/v callable from LlamaForCausalLM.prepare(); None: separate projections

    def prepare(self, policy: KernelPolicy) -> None:
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj, policy=policy)
        self._o = prepare_linear(self.o_proj, policy)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; cos / sin [T, 1, D] from rope_operands (sin's first half negated)."""
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self._qkv is not None:
            qkv = self._qkv(x)  # [T, (H + 2 Hkv) D]
            # RoPE on q and k at once (adjacent in the fused output)
            qk = _apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin)  # [T, H + Hkv, D]
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            o_proj = self._o
        else:
            q = self.q_proj(x).view(T, H, D)  # [T, H, D]
            k = self.k_proj(x).view(T, Hkv, D)  # [T, Hkv, D]
            v = self.v_proj(x).view(T, Hkv, D)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            o_proj = self._o
        write_kv(kv_cache, self.layer_idx, k, v, meta.slot_mapping)
        if self.attn_fp32 and q.dtype != torch.float32:
            # fp32 attention for half models: more accurate, and (nearly) independent of how the batch
            # is padded, so verify / decode / batched logits agree (greedy speculative == plain greedy)
            q, k, v = q.float(), k.float(), v.float()
        o = paged_attention(q, k, v, kv_cache[self.layer_idx], meta, self.scale, self.window,
                            self.attn_backend)  # [T, H, D]
        return o_proj(o.to(x.dtype).reshape(T, H * D))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hd, it, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hd, it, bias=bias)
        self.up_proj = nn.Linear(hd, it, bias=bias)
        self.down_proj = nn.Linear(it, hd, bias=bias)
        self.act = _ACTS[config.hidden_act]
        self._gate_up = None  # fused gate/up callable from LlamaForCausalLM.prepare()

    def prepare(self, policy: KernelPolicy) -> None:
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj, policy=policy)
        self._down = prepare_linear(self.down_proj, policy)

    def forward(self, x):
        if self._gate_up is not None:
            gu = self._gate_up(x)  # [T, 2 I]
            n = gu.shape[-1] // 2
            return self._down(self.act(gu[..., :n]) * gu[..., n:])
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def prepare(self, policy: KernelPolicy) -> None:
        self.self_attn.prepare(policy)
        self.mlp.prepare(policy)
        self._norms = (self.input_layernorm.weight, self.input_layernorm.eps,
                       self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)

    def forward(self, x, cos, sin, meta, kv_cache):
        # plain method calls (no nn.Module __call__ / hook machinery: ~10 us per call on the CPU)
        w1, eps1, w2, eps2 = self._norms
        x = x + self.self_attn.forward(rms_norm(x, w1, eps1), cos, sin, meta, kv_cache)
        return x + self.mlp.forward(rms_norm(x, w2, eps2))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral causal LM over a paged KV cache (see module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        self.linear_policy = KernelPolicy()  # shared by every prepared projection (set_linear_kernel)
        self._prepared = False

    # -- fast path: fused q/k/v and gate/up weights, cached weight references (built lazily)
    def prepare(self) -> "LlamaForCausalLM":
        """Fuse q/k/v and gate/up into single projections and cache per-layer callables
        (specrt.models.linear: the small-M kernel for decode / verify rows, torch's GEMM for prefill).
        Runs lazily at the first forward; anything that replaces parameters or modules
        (``.to()``, ``load_state_dict(assign=True)``, tensor-parallel sharding) invalidates it."""
        for layer in self.model.layers:
            layer.prepare(self.linear_policy)
        self._lm_head = prepare_linear(self.lm_head, self.linear_policy)
        self._prepared = True
        return self

    def set_linear_kernel(self, max_rows: int) -> None:
        """Projections of at most ``max_rows`` rows (tokens) run on specrt's small-M kernel (default
        SMALL_M = 128); 0 runs every projection on torch's path (F.linear, and torch's int8 / dequantize for
        quantized layers). Greedy bf16 speculative output equals autoregressive output only with it."""
        if not isinstance(max_rows, int) or max_rows < 0:
            raise ValueError(f"max_rows must be an integer >= 0, got {max_rows!r}")
        self.linear_policy.max_rows = max_rows

    def projections(self) -> list[tuple[str, object]]:
        """The prepared projection callables a forward runs, in order, as (kind, fn) with kind
        "hidden" (input [T, hidden]) or "intermediate" (input [T, intermediate]); the LM head last.
        For benchmarks that time the kernels' share of a forward."""
        self.prepare()
        calls = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = [a._qkv] if a._qkv is not None else [a.q_proj, a.k_proj, a.v_proj]
            gate_up = [m._gate_up] if m._gate_up is not None else [m.gate_proj, m.up_proj]
            calls += [("hidden", fn) for fn in qkv + [a._o] + gate_up] + [("intermediate", m._down)]
        return calls + [("hidden", self._lm_head)]

    def _invalidate_fast_path(self) -> None:
        self._prepared = False

    def _apply(self, fn, *args, **kwargs):
        self._prepared = False  # .to() / .half() give every parameter its own storage again
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._prepared = False
        return super().load_state_dict(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (quantized weights keep their own)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def set_attention_fp32(self, enabled: bool) -> None:
        """bf16/fp16 models compute attention in float32 by default (see LlamaAttention.forward);
        False computes it in the model dtype like transformers does."""
        for layer in self.model.layers:
            layer.self_attn.attn_fp32 = enabled

    def set_attention_backend(self, backend: str) -> None:
        """"kernel" (default): decode / verify attention with the paged-attention kernel; "sdpa": the
        gather + SDPA torch path for every call (the reference; what benchmarks compare against)."""
        if backend not in ("kernel", "sdpa"):
            raise ValueError(f"backend must be 'kernel' or 'sdpa', got {backend!r}")
        for layer in self.model.layers:
            layer.self_attn.attn_backend = backend

    def tie_weights(self) -> None:
        # a quantized head / embedding already shares one quantized matrix (quant.quantize_model_)
        if self.config.tie_word_embeddings and not isinstance(self.lm_head, QuantLinear) \
                and not isinstance(self.model.embed_tokens, QuantEmbedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, num_layers: int | None = None,
                logits_indices: torch.Tensor | None = None,
                return_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step over a mixed batch.

        input_ids [T] int64 (all requests' new tokens concatenated, in request order);
        positions [T] int64 absolute positions (== seq_len - query_len + i per request);
        kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim] — written at meta.slot_mapping;
        num_layers: run only the first N layers + final norm + lm_head (self-speculative draft);
        logits_indices [L]: rows to compute logits for (default all T).
        Returns (logits [L, V] float32, final-normed hidden [L, hidden] or None).
        """
        cfg = self.config
        n = cfg.num_layers if num_layers is None else int(num_layers)
        if not 1 <= n <= cfg.num_layers:
            raise ValueError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}]")
        T = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                             f"must both be [T]")
        if T < meta.num_tokens or meta.slot_mapping.shape[0] != T:
            raise ValueError(f"input_ids has {T} tokens, slot_mapping {meta.slot_mapping.shape[0]}, but the metadata "
                             f"describes {meta.num_tokens} (rows beyond that must be padding with slot -1)")
        exp = (cfg.num_kv_heads, cfg.head_dim)
        if kv_cache.dim() != 6 or kv_cache.shape[0] < n or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[4:]) != exp:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)}: expected [>={n} layers, 2, num_blocks, block_size, "
                             f"{exp[0]}, {exp[1]}]")
        if kv_cache.shape[3] != meta.block_size:
            raise ValueError(f"kv_cache block_size {kv_cache.shape[3]} != metadata block_size {meta.block_size}")
        max_seq = meta.max_context_len  # the true length (a KVWindow view is shorter)
        if max_seq > cfg.max_model_len:
            raise ValueError(f"a request has {max_seq} tokens, longer than the model's context of "
                             f"{cfg.max_model_len} tokens")

        if not self._prepared:
            self.prepare()
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = rope_operands(*self.rotary.cos_sin(positions, x.dtype, max_seq))  # [T, 1, D] each
        layers = self.model.layers
        for i in range(n):
            x = layers[i].forward(x, cos, sin, meta, kv_cache)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        norm = self.model.norm
        h = rms_norm(x, norm.weight, norm.eps)  # [L, hidden]
        logits = self._lm_head(h).float()  # [L, V]
        return logits, (h if return_hidden else None)
