"""Pure-torch reference of specrt's linear ops, float and weight-only quantized (ops.linear,
ops.quant_linear, ops.quant_linear_dynamic, ops.interleave_quant_weight): the test oracle of the
small-M linear kernel (csrc/cpu/linear_kernel.h, linear_dynamic.h). specrt.ops.reference re-exports
every name, so ``reference.quant_linear`` is this module's."""
from __future__ import annotations

import torch

QUANT_GROUP = 32  # input features per scale group of q8_0 / q4_0 / q4_1


def unpack_q4(qweight: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit weights [N, K/2] uint8 -> values [N, K] in 0..15 (uint8).

    Each group of 32 features is 16 bytes; byte j holds feature j (low nibble)
    and feature j + 16 (high nibble), as in GGUF Q4_0 / Q4_1 blocks."""
    n = qweight.shape[0]
    b = qweight.reshape(n, -1, QUANT_GROUP // 2)  # [N, G, 16]
    return torch.cat((b & 0xF, b >> 4), dim=-1).reshape(n, -1)


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      kind: str) -> torch.Tensor:
    """The float32 weight [N, K] a quantized weight stands for (llama.cpp / gguf-py values).

    int8: ``scale[n] * q``; q8_0: ``d * q``; q4_0: ``d * (q - 8)``; q4_1: ``fl(d * q) + m``
    (two roundings, no fused multiply-add), with fp16 ``d`` / ``m`` per 32 features."""
    if kind == "int8":
        return qweight.float() * scales.float()[:, None]
    n = qweight.shape[0]
    q = (unpack_q4(qweight) if kind in ("q4_0", "q4_1") else qweight).float().reshape(n, -1, QUANT_GROUP)
    d = scales.float()[:, :, None]
    if kind == "q8_0":
        w = q * d
    elif kind == "q4_0":
        w = (q - 8.0) * d
    elif kind == "q4_1":
        w = (d * q) + mins.float()[:, :, None]
    else:
        raise ValueError(f"kind must be one of int8, q8_0, q4_0, q4_1, got {kind!r}")
    return w.reshape(n, -1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x weight^T + bias in float32 (torch's GEMM), returned in x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """linear() over the dequantized weight."""
    return linear(x, dequantize_weight(qweight, scales, mins, kind), bias)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (xq [M, K] int8 values as float32, dx [M, K/32]) per block of 32:
    dx = max|x| / 127, xq = clamp(rint(x * (1 / dx)), -127, 127) (0 where dx == 0)."""
    xb = x.float().reshape(x.shape[0], -1, QUANT_GROUP)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return xq.reshape(x.shape[0], -1), dx


def interleave_quant_weight(qweight: torch.Tensor, kind: str, inverse: bool = False) -> torch.Tensor:
    """ops.interleave_quant_weight: per row, each run of 16 blocks (the last may be shorter) as
    [blocks, 4-byte steps] -> [steps, blocks] (inverse: back)."""
    n, width = qweight.shape
    b = QUANT_GROUP // 2 if kind in ("q4_0", "q4_1") else QUANT_GROUP  # bytes per block
    g, steps = width // b, b // 4
    words = qweight.contiguous().view(torch.int32).reshape(n, g * steps)
    parts, start = [], 0
    while start < g:
        ng = min(16, g - start)
        chunk = words[:, start * steps:(start + ng) * steps]
        shape = (n, steps, ng) if inverse else (n, ng, steps)
        parts.append(chunk.reshape(shape).transpose(1, 2).reshape(n, -1))
        start += ng
    return torch.cat(parts, dim=1).contiguous().view(qweight.dtype).reshape(n, width)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fl32(a * b + c) rounded once (a fused multiply-add) for float32 tensors: the product is exact in
    float64, the sum is exact as float64 s + err (TwoSum), and the one case where rounding s to float32
    differs from rounding s + err (s exactly halfway between two floats) is settled by err's sign."""
    p, cd = a.double() * b.double(), c.double()
    s = p + cd
    bp = s - cd
    err = (p - bp) + (cd - (s - bp))
    r = s.float()
    diff = s - r.double()
    nb = torch.nextafter(r, torch.where(diff > 0, torch.full_like(r, float("inf")), torch.full_like(r, -float("inf"))))
    tie = (diff != 0) & (diff.abs() * 2 == (nb.double() - r.double()).abs())
    up = tie & (err != 0) & ((err > 0) == (diff > 0))
    return torch.where(up, nb, r)


def _tree16(acc: torch.Tensor) -> torch.Tensor:
    """The fixed 16 -> 1 lane sum of csrc/cpu/linear_kernel.h over the last dim (float32)."""
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def quant_linear_dynamic(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """ops.quant_linear_dynamic bit for bit (qweight in the GGUF order), in the order of
    csrc/cpu/linear_dynamic.h: exact integer block sums P_g, then per lane l = g % 16, over g =
    l, l + 16, ...: acc_l = fma(P_g, fl(d_g dx_g), acc_l) (int8: dx_g), q4_1 then fma(m_g, e_g, acc_l);
    the fixed tree, the int8 row scale, + bias; x's dtype out."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, dx = quantize_activations(x2)  # [M, K], [M, G]
    m, k = xq.shape
    g = k // QUANT_GROUP
    if kind == "int8":
        wq = qweight.double()
    elif kind == "q8_0":
        wq = qweight.double()
    else:
        wq = unpack_q4(qweight).double() - (8.0 if kind == "q4_0" else 0.0)
    n = wq.shape[0]
    P = torch.einsum("mgk,ngk->mng", xq.double().reshape(m, g, QUANT_GROUP),
                     wq.reshape(n, g, QUANT_GROUP)).float()  # [M, N, G] exact integers
    sc = dx[:, None, :].expand(m, n, g) if kind == "int8" else scales.float()[None] * dx[:, None, :]
    e = dx * xq.reshape(m, g, QUANT_GROUP).sum(-1)  # [M, G] (exact integer sums)
    acc = torch.zeros(m, n, 16)
    for s in range(0, g, 16):
        ng = min(16, g - s)
        zero = torch.zeros(m, n, 16 - ng)
        pad = (lambda t: torch.cat((t, zero), dim=-1))
        acc = _fma32(pad(P[..., s:s + ng]), pad(sc[..., s:s + ng]), acc)
        if kind == "q4_1":
            acc = _fma32(pad(mins.float()[None, :, s:s + ng].expand(m, n, ng)),
                         pad(e[:, None, s:s + ng].expand(m, n, ng)), acc)
    y = _tree16(acc)  # [M, N]
    if kind == "int8":
        y = scales.float()[None] * y
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def linear_amx_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """ops.linear bit for bit for bf16 x and bf16 weight [N, K] (K even) on a CPU with usable AMX-BF16,
    in the tdpbf16ps order of csrc/cpu/linear_kernel.h: per chunk of 32 features, the even products
    and the odd ones summed in two fp32 chains from zero, then s = s + (e + o); + bias; x's dtype out
    (out_dtype=torch.float32 keeps the fp32 sums, for tests that compare every bit of them).
    (A bf16 product is exact in fp32, so each step is one rounding. Denormals are not flushed.)"""
    x2 = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    w = weight.float()  # [N, K]
    k = x2.shape[1]
    if k % 2:
        raise ValueError(f"x's last dim must be even for the AMX order, got {k}")
    s = torch.zeros(x2.shape[0], w.shape[0])  # [M, N]
    for k0 in range(0, k, 32):
        e = torch.zeros_like(s)
        o = torch.zeros_like(s)
        for j in range(k0, min(k, k0 + 32), 2):
            e = e + x2[:, j, None] * w[None, :, j]
            o = o + x2[:, j + 1, None] * w[None, :, j + 1]
        s = s + (e + o)
    if bias is not None:
        s = s + bias.float()
    return s.to(out_dtype or x.dtype).reshape(*x.shape[:-1], -1)
