"""Fused decoder ops: RMSNorm (+ residual add), SwiGLU, RoPE + KV store
(csrc/cpu/fused_kernel.h; CPU only, float32 / bfloat16)."""
from __future__ import annotations

import torch

FUSED_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the fused ops take (float32, bfloat16; CPU tensors)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * round(x / sqrt(mean(x^2) + eps))`` per row, as transformers' LlamaRMSNorm.

    With ``residual``: first ``residual += x`` in place (rounded to its dtype), then the sum
    is normalized — the decoder's residual add and the next layer norm in one pass. Statistics
    in float32 with a fixed order per row: the result of a row never depends on the other
    rows, the thread count or the ISA. "round" is to x's dtype (bf16: where transformers rounds).

    Shape: x [T, H] float32 or bfloat16 (unit stride in H); weight [H] in x's dtype;
    residual [T, H] like x or None.
    Returns: [T, H] in x's dtype (a new tensor).

    Examples:
        >>> h = ops.rms_norm(delta, w, 1e-5, residual=stream)  # stream += delta; h = norm(stream)
    """
    if residual is None:
        return torch.ops.specrt.rms_norm(x, weight, float(eps))
    return torch.ops.specrt.add_rms_norm_(residual, x, weight, float(eps))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``round(round(silu(g)) * u)`` for ``x = [g | u]`` (the fused gate/up output).

    silu(g) = g / (1 + exp(-g)) with specrt's own exp (< 2 ulp from the true value; the same
    bits on every ISA), so a float32 result can differ from torch's by an ulp.

    Shape: x [T, 2I] float32 or bfloat16 (unit stride in the last dim).
    Returns: [T, I] in x's dtype.

    Examples:
        >>> a = ops.silu_mul(gate_up(h))   # [T, I]
    """
    return torch.ops.specrt.silu_mul(x)


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                    kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
                    q_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RoPE on q and k of a fused q/k/v projection, then k and v into the paged KV cache.

    Each head vector x becomes ``x * cos + rotate_half(x) * sin`` with every product and the
    sum rounded to qkv's dtype (transformers' order). k is rotated in place in ``qkv``; q is
    returned as a new contiguous tensor (in ``q_dtype``: float32 widens the rounded values
    exactly). Rows whose slot is -1 are not stored; a repeated slot keeps the last row.

    Shape: qkv [T, (H + 2 Hkv) D] float32 or bfloat16 (q | k | v, unit stride in the last dim);
    cos, sin [T, D] in qkv's dtype; kv_cache [layers, 2, num_blocks, block_size, Hkv, D]
    float32 or bfloat16, contiguous; slot_mapping [T] int64 in [-1, num_blocks * block_size).
    Returns: q [T, H, D] in q_dtype (default qkv's dtype).

    Examples:
        >>> q = ops.rotary_write_kv(qkv, cos, sin, 9, 3, cache, layer=0, slot_mapping=slots)
    """
    return torch.ops.specrt.rotary_write_kv(qkv, cos, sin, int(num_heads), int(num_kv_heads), kv_cache, int(layer),
                                            slot_mapping, q_dtype)
