"""The decode / verify layers of a prepared CPU model in one C++ call (``specrt._C.LayerStack``).

A fused-path layer (llama.py ``LlamaDecoderLayer.forward_fused``) is ~9 kernels dispatched from
Python; csrc/layer_stack.cpp runs the same kernel functions with the same arguments from C++, so a
step's outputs are bit-identical while the per-op Python and dispatcher work (~270 calls per
SmolLM2 forward) is gone. ``build_layer_stack`` makes one at ``prepare()`` when every layer
qualifies: attention on the paged kernel in float32, SwiGLU, and every projection a kernel call
(FloatLinear on its kernel, or QuantCall on the weights as prepared). Anything else, and every
prefill, keeps the Python path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from specrt.models.linear import FloatLinear, QuantCall
from specrt.ops.library import layer_stack_class


class ProjSpec(NamedTuple):
    """One projection as csrc/layer_stack.cpp runs it (a tuple on the C++ side, fields in this order)."""
    weight: torch.Tensor                # [N, K] float, or the quantized bytes as prepared
    scales: torch.Tensor | None         # quantized kinds: int8 [N] float, else [N, K/32] fp16
    mins: torch.Tensor | None           # q4_1: [N, K/32] fp16
    bias: torch.Tensor | None           # [N]
    kind: str                           # "float", "int8", "q8_0", "q4_0", "q4_1"
    dynamic: bool                       # int8 activations on interleaved weights


def projection_spec(fn) -> ProjSpec | None:
    """What the stack needs to run prepared projection ``fn`` on its kernel, or None if it cannot."""
    if type(fn) is FloatLinear:
        return ProjSpec(fn.weight, None, None, fn.bias, "float", False) if fn.kernel else None
    if type(fn) is QuantCall and fn.fast:
        weight, scales, mins, bias, kind = fn.args
        return ProjSpec(weight, scales, mins, bias, kind, fn.dynamic)
    return None


def build_layer_stack(layers, dtype: torch.dtype):
    """A LayerStack over ``layers`` (prepared LlamaDecoderLayers whose forward_fused runs in ``dtype``),
    or None when a layer needs the Python path."""
    if dtype not in (torch.float32, torch.bfloat16) or len(layers) == 0:
        return None
    a0 = layers[0].self_attn
    stack = layer_stack_class()(a0.num_heads, a0.num_kv_heads, a0.head_dim, str(dtype).removeprefix("torch."))
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.attn_backend != "kernel" or not attn.attn_fp32 or mlp.act is not F.silu \
                or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (a0.num_heads, a0.num_kv_heads, a0.head_dim):
            return None
        projs = [projection_spec(fn) for fn in (attn._qkv, attn._o, mlp._gate_up, mlp._down)]
        if any(p is None for p in projs):
            return None
        w1, eps1, w2, eps2 = layer._norms
        stack.add_layer(w1, eps1, w2, eps2, projs, attn.layer_idx, attn.scale, attn.window or 0)
    return stack
