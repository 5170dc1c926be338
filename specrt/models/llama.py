"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Module and parameter names mirror transformers (``model.layers.0.self_attn.q_proj.weight``,
...) so a checkpoint's state dict loads as is. The numerics follow transformers too
(RMSNorm in fp32, RoPE cos/sin in fp32 cast to the activation dtype, lm_head in the
model dtype, logits returned as float32), so fp32 logits match to ~1e-6.

Attention (specrt.models.attention_path): decode and K+1 verify rows attend with the paged-attention
kernel straight over the cache blocks; prefills use SDPA.

Projections (specrt.models.linear): on the CPU every row runs on specrt's linear kernel — the
same reduction order for any row count, so a verify row equals the decode of that token bit for
bit (greedy speculative output then equals autoregressive output in bf16 too) and a prompt row
does not depend on the prompts prefilled beside it; quantized layers (QuantLinear) always run
quantized. ``set_linear_kernel(n)`` sends steps of more than n rows to torch's GEMM (0: always).

CPU overhead (a decode step is dominated by per-op costs, not FLOPs, outside the projections):
q/k/v and gate/up are fused into one projection each (``prepare``: the fused tensor is the storage
of the original parameters, so state_dict names and memory are unchanged — note safetensors'
``save_file`` refuses such shared storage: ``.clone()`` the tensors first), and on the CPU every
projection's weights then move into one huge-page arena in the order a forward reads them
(``linear.pack_projections``: one sequential stream instead of 121 separate ones). On the CPU, float32 /
bfloat16 models then run each layer as ~9 kernels (``_forward_fused``): the residual add fused
into the next RMSNorm (``ops.rms_norm(residual=)``), RoPE on q and k plus the KV-cache store in one
pass (``ops.rotary_write_kv``), SwiGLU's silu * up (``ops.silu_mul``); the residual stream stays
in the model dtype and every op rounds where transformers' modules do, so a bf16 model sees
transformers' values (float32 differs by ulps: reduction orders, silu's exp). Decode / verify steps
run those kernels for every layer in one C++ call when the layers qualify (``set_layer_stack``;
specrt.models.layer_stack): same bits, without ~270 Python dispatches per forward.
``set_fused_ops(False)``, GPUs and float16 run the op-by-op torch path (``LlamaDecoderLayer.forward``):
RoPE from a cos/sin table indexed by position on q and k together (roll + addcmul), RMSNorm's
sum(x^2) from one ``vector_norm``. Layers are called as plain methods (no nn.Module ``__call__``).
Tensor parallelism (specrt.models.tp) swaps in row-/vocab-parallel modules that this file calls
like any other module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specrt import ops
from specrt.models.attention import AttentionMetadata, write_kv
from specrt.models.attention_path import kernel_batch, paged_attention, paged_attention_sdpa  # noqa: F401
from specrt.models.config import ModelConfig
from specrt.models.layer_stack import build_layer_stack
from specrt.models.linear import (KernelPolicy, QuantEmbedding, QuantLinear, fuse_linears, pack_projections,
                                  prepare_linear)
from specrt.models.rope import RMSNorm, RotaryEmbedding, _apply_rope, rms_norm, rope_operands  # noqa: F401

_NORM = torch.ops.specrt.rms_norm.default
_ADD_NORM = torch.ops.specrt.add_rms_norm_.default
_ROTARY = torch.ops.specrt.rotary_write_kv.default
_SILU_MUL = torch.ops.specrt.silu_mul.default
_PAGED_ATTENTION = torch.ops.specrt.paged_attention.default

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


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

    def fusable(self, dtype: torch.dtype) -> bool:
        """Whether forward_fused can run this (prepared) layer with activations in ``dtype``."""
        attn, mlp = self.self_attn, self.mlp
        return (attn._qkv is not None and mlp._gate_up is not None
                and self.input_layernorm.weight.dtype == dtype == self.post_attention_layernorm.weight.dtype)

    def forward_fused(self, residual, delta, cos, sin, meta, kv_cache, layer_cache, kernel_batch):
        """The CPU fused path: ``residual`` [T, hidden] += ``delta`` (the previous layer's output, None
        for the first layer) in place; returns this layer's output delta [T, hidden].

        cos / sin [T, D] as RotaryEmbedding.cos_sin gives them; layer_cache = kv_cache[layer];
        kernel_batch: attention_path.kernel_batch(meta) (None: the general attention path)."""
        w1, eps1, w2, eps2 = self._norms
        attn, mlp = self.self_attn, self.mlp
        h = _NORM(residual, w1, eps1) if delta is None else _ADD_NORM(residual, delta, w1, eps1)  # [T, hidden]
        qkv = attn._qkv(h)  # [T, (H + 2 Hkv) D]
        T, dtype = qkv.shape[0], qkv.dtype
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        # RoPE on q (returned, float32 for fp32 attention) and k (in place); k and v stored in the cache
        q = _ROTARY(qkv, cos, sin, H, Hkv, kv_cache, attn.layer_idx, meta.slot_mapping,
                    torch.float32 if attn.attn_fp32 else None)  # [T, H, D]
        if kernel_batch is not None and attn.attn_backend == "kernel" and q.dtype == torch.float32:
            kb = kernel_batch
            o = _PAGED_ATTENTION(q, layer_cache, kb.block_tables, kb.seq_lens, kb.query_start_loc, attn.scale,
                                 attn.window or 0, kb.max_q, kb.max_s, True, kb.tree_rows(T))  # [T, H, D] float32
        else:
            k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            o = paged_attention(q, k, v, layer_cache, meta, attn.scale, attn.window, attn.attn_backend)
        o = o.view(T, H * D) if o.dtype == dtype else o.to(dtype).view(T, H * D)
        h = _ADD_NORM(residual, attn._o(o), w2, eps2)  # residual += attention output
        gu = mlp._gate_up(h)  # [T, 2 I]
        if mlp.act is F.silu:
            a = _SILU_MUL(gu)  # [T, I]
        else:
            i = gu.shape[1] // 2
            a = mlp.act(gu[:, :i]) * gu[:, i:]
        return mlp._down(a)


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
        self.fused_ops = True  # set_fused_ops
        self.layer_stack = True  # set_layer_stack
        self._prepared = False
        self._fused = False  # prepare(): whether forward runs _forward_fused
        self._stack = None  # prepare(): the layers' C++ LayerStack for decode / verify steps, if they qualify

    # -- fast path: fused q/k/v and gate/up weights, cached weight references (built lazily)
    def prepare(self) -> "LlamaForCausalLM":
        """Fuse q/k/v and gate/up into single projections and cache per-layer callables
        (specrt.models.linear: specrt's linear kernel for every row on the CPU).
        Runs lazily at the first forward; anything that replaces parameters or modules
        (``.to()``, ``load_state_dict(assign=True)``, tensor-parallel sharding) invalidates it."""
        dynamic = self.linear_policy.int8_activations
        for m in self.modules():  # the int8 kernel's weight order while int8 activations are on (in place)
            if isinstance(m, QuantLinear):
                m.set_interleaved(dynamic and m.dynamic_capable)
        for layer in self.model.layers:
            layer.prepare(self.linear_policy)
        self._lm_head = prepare_linear(self.lm_head, self.linear_policy)
        if self.device.type == "cpu":  # the weights in the order a forward streams them, in one arena
            order = [fn for layer in self.model.layers for fn in (layer.self_attn._qkv, layer.self_attn._o,
                                                                   layer.mlp._gate_up, layer.mlp._down)]
            pack_projections(order + [self._lm_head], self)
        dtype = self.dtype
        self._fused = (self.fused_ops and self.device.type == "cpu" and dtype in ops.FUSED_DTYPES
                       and all(layer.fusable(dtype) for layer in self.model.layers))
        self._stack = build_layer_stack(self.model.layers, dtype) if self._fused else None
        self._prepared = True
        return self

    def set_fused_ops(self, enabled: bool) -> None:
        """True (default): on the CPU, float32 / bfloat16 models run each layer on the fused kernels
        (module docstring); False: the op-by-op torch path everywhere (for comparisons)."""
        self.fused_ops = bool(enabled)
        self._prepared = False

    def set_layer_stack(self, enabled: bool) -> None:
        """True (default): fused decode / verify steps run every layer in one C++ call when the layers
        qualify (specrt/models/layer_stack.py); False: the per-op Python loop. Same bits either way."""
        self.layer_stack = bool(enabled)

    def set_linear_kernel(self, max_rows: int) -> None:
        """Projections of at most ``max_rows`` rows (tokens) run on specrt's linear kernel (default:
        any row count), larger ones on torch's GEMM; 0 runs every projection on torch's path (F.linear,
        and torch's int8 / dequantize for quantized layers). Greedy bf16 speculative output equals
        autoregressive output, and a request's output is independent of its neighbours, only with it."""
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

    def set_int8_activations(self, enabled: bool) -> None:
        """Opt-in: quantized layers quantize their input to int8 per row and block of 32 and multiply
        in integers (``ops.quant_linear_dynamic``, AVX-512-VNNI): faster decoding of int8 / GGUF-format
        weights, at the price of the activation rounding (logits move by ~0.5%). Verify == decode
        and batch invariance still hold; float projections are unaffected. The next forward's prepare()
        permutes the quantized weights in place into the kernel's order (or back)."""
        self.linear_policy.int8_activations = bool(enabled)
        self._prepared = False

    def invalidate_prepared(self) -> None:
        """Forget the prepared fast path (fused projections, weight arena); call after replacing a
        layer module (quantizing, sharding), so the next forward prepares again."""
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
        self._prepared = False  # the layer stack only runs float32 attention

    def set_attention_backend(self, backend: str) -> None:
        """"kernel" (default): decode / verify attention with the paged-attention kernel; "sdpa": the
        gather + SDPA torch path for every call (the reference; what benchmarks compare against)."""
        if backend not in ("kernel", "sdpa"):
            raise ValueError(f"backend must be 'kernel' or 'sdpa', got {backend!r}")
        for layer in self.model.layers:
            layer.self_attn.attn_backend = backend
        self._prepared = False  # the layer stack only runs the kernel backend

    def tie_weights(self) -> None:
        # a quantized head / embedding already shares one quantized matrix (quant.quantize_model_)
        if self.config.tie_word_embeddings and not isinstance(self.lm_head, QuantLinear) \
                and not isinstance(self.model.embed_tokens, QuantEmbedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, num_layers: int | None = None,
                logits_indices: torch.Tensor | None = None,
                return_hidden: bool = False,
                inputs_embeds: torch.Tensor | None = None,
                all_hidden: bool = False,
                hidden_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step over a mixed batch.

        input_ids [T] int64 (all requests' new tokens concatenated, in request order);
        positions [T] int64 absolute positions (== seq_len - query_len + i per request);
        kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim] — written at meta.slot_mapping;
        num_layers: run only the first N layers + final norm + lm_head (self-speculative draft);
        logits_indices [L]: rows to compute logits for (default all T);
        inputs_embeds [T, hidden]: the residual stream entering layer 0 instead of the token
        embeddings (feature drafts; consumed: the fused path updates it in place);
        all_hidden: return the final-normed hidden of EVERY row [T, hidden] (a feature drafter reads
        the prompt rows too), logits still only at logits_indices; the norm is per row, so the
        logits are bit-identical either way.
        hidden_layers: the returned hidden concatenates, per row, the residual stream after each
        listed layer (index num_layers = the final-normed state): [L or T, len * hidden] (the
        fused low / middle / high features an EAGLE-3 draft reads). None: the final-normed state.
        Returns (logits [L, V] float32, final-normed hidden [L, hidden] ([T, hidden] with
        all_hidden) or None).
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
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype, max_seq)  # [T, D] each
        rows = None if all_hidden else logits_indices  # the rows the final norm runs on (None: all)
        capture = _capture_layers(hidden_layers, n)  # layers whose output stream is kept
        taken = None  # [T, len(capture), hidden]
        if self._fused and x.dtype == self.dtype and kv_cache.dtype in ops.FUSED_DTYPES and kv_cache.is_cpu:
            h, taken = self._forward_fused(x, cos, sin, meta, kv_cache, n, rows, capture)  # [L or T, hidden]
        else:
            cos, sin = rope_operands(cos, sin)  # [T, 1, D] each
            layers = self.model.layers
            kept = {}
            for i in range(n):
                x = layers[i].forward(x, cos, sin, meta, kv_cache)
                if i in capture:
                    kept[i] = x.clone()
            taken = torch.stack([kept[i] for i in capture], 1) if capture else None
            if rows is not None:
                x = x.index_select(0, rows)
            norm = self.model.norm
            h = rms_norm(x, norm.weight, norm.eps)  # [L or T, hidden]
        h_all = h if all_hidden else None
        if all_hidden and logits_indices is not None:
            h = h.index_select(0, logits_indices)  # [L, hidden]
        logits = self._lm_head(h).float()  # [L, V]
        hidden = h_all if all_hidden else h if return_hidden else None
        if hidden is not None and hidden_layers is not None:
            hidden = _fuse_hidden(hidden_layers, n, taken, hidden, rows)
        return logits, hidden

    def _forward_fused(self, x, cos, sin, meta, kv_cache, n: int, logits_indices, capture: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers 0..n-1 and the final norm on the fused CPU kernels. x [T, hidden] (the embeddings)
        becomes the residual stream, updated in place; returns (the final-normed rows [L, hidden],
        the stream after each ``capture`` layer [T, len(capture), hidden] or None)."""
        kb = kernel_batch(meta)  # decode / verify batches: every request on the attention kernel
        stack = self._stack if self.layer_stack else None
        taken = x.new_empty(x.shape[0], len(capture), x.shape[1]) if capture else None
        if stack is not None and kb is not None and x.shape[0] <= self.linear_policy.max_rows and x.is_contiguous():
            delta = stack.run(x, cos, sin, kv_cache, meta.slot_mapping, kb.block_tables, kb.seq_lens,
                              kb.query_start_loc, kb.max_q, kb.max_s, n,
                              kb.tree_rows(x.shape[0]), capture, taken)  # the loop below, in C++
        else:
            layer_caches = kv_cache.unbind(0)  # one call for every layer's view
            layers = self.model.layers
            delta = None
            for i in range(n):
                delta = layers[i].forward_fused(x, delta, cos, sin, meta, kv_cache, layer_caches[i], kb)
                for j, li in enumerate(capture):
                    if li == i:
                        torch.add(x, delta, out=taken[:, j])
        norm = self.model.norm
        if logits_indices is None:
            return _ADD_NORM(x, delta, norm.weight, norm.eps), taken
        x.add_(delta)  # rounds as the fused add does
        return _NORM(x.index_select(0, logits_indices), norm.weight, norm.eps), taken


def _capture_layers(hidden_layers, n: int) -> list[int]:
    """The decoder layers (< n) whose output stream ``hidden_layers`` asks for (n = the final norm)."""
    if hidden_layers is None:
        return []
    if not hidden_layers or any(not 0 <= int(i) <= n for i in hidden_layers):
        raise ValueError(f"hidden_layers {tuple(hidden_layers)} must be layer indices in [0, {n}] "
                         f"({n} = the final-normed state)")
    return [int(i) for i in hidden_layers if int(i) < n]


def _fuse_hidden(hidden_layers, n: int, taken, final: torch.Tensor, rows) -> torch.Tensor:
    """[R, len(hidden_layers) * hidden]: each listed layer's stream (rows ``rows`` of the captured
    [T, k, hidden]; None = all) with the final-normed ``final`` [R, hidden] at index n."""
    if taken is not None and rows is not None:
        taken = taken.index_select(0, rows)
    parts, j = [], 0
    for i in hidden_layers:
        if int(i) == n:
            parts.append(final)
        else:
            parts.append(taken[:, j].to(final.dtype))
            j += 1
    return torch.cat(parts, -1)
