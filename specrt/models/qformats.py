"""GGUF-style weight quantization formats: int8 (per output row), Q8_0, Q4_0, Q4_1 (groups of 32
features), quantized exactly as gguf-py / llama.cpp's reference quantizers round. The layers that
run them are in specrt.models.linear."""
from __future__ import annotations

import torch

from specrt import ops
from specrt.ops import reference

KINDS = ops.QUANT_KINDS  # ("int8", "q8_0", "q4_0", "q4_1")
GROUP = reference.QUANT_GROUP  # 32 features per scale group


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as gguf-py's np_roundf (llama.cpp's roundf)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """Values [N, K] in 0..15 -> [N, K/2] uint8 (GGUF nibble order, see reference.unpack_q4)."""
    n = q.shape[0]
    g = q.to(torch.uint8).reshape(n, -1, GROUP)
    return (g[..., :GROUP // 2] | (g[..., GROUP // 2:] << 4)).reshape(n, -1)


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Float weight [N, K] -> (qweight, scales, mins or None) in ``kind``'s layout (see ops.quant_linear).

    q8_0 / q4_0 / q4_1 round exactly as gguf-py (llama.cpp's reference quantizers), so
    the result equals what ``gguf.quants.quantize`` writes. int8: symmetric per output row,
    ``scale = max|w| / 127``, ``q = round(w / scale)`` (half to even)."""
    check_kind(kind)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float weight [N, K], got {w.dtype} {tuple(w.shape)}")
    w = w.detach().float()
    n, k = w.shape
    if kind == "int8":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        return torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8), scale, None
    if k % GROUP:
        raise ValueError(f"{kind} needs in_features divisible by {GROUP}, got {k}")
    b = w.reshape(n, k // GROUP, GROUP)
    mins = None
    if kind == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        q = _roundf(b * _inverse(d)).to(torch.int8).reshape(n, k)
    elif kind == "q4_0":
        mx = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))  # signed value of largest magnitude
        d = mx / -8
        q = pack_q4(torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15).reshape(n, k))
    else:  # q4_1
        mx, mn = b.amax(-1, keepdim=True), b.amin(-1, keepdim=True)
        d = (mx - mn) / 15
        q = pack_q4(torch.trunc((b - mn) * _inverse(d) + 0.5).clamp(0, 15).reshape(n, k))
        mins = mn[..., 0].half()
    return q, d[..., 0].half(), mins


def as_half(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a float16 tensor")
    h = t.to(torch.float16)
    if t.dtype != torch.float16 and not torch.equal(h.to(t.dtype), t):
        raise ValueError(f"{name} must hold float16 values exactly (got {t.dtype} values that are not)")
    return h.contiguous()
