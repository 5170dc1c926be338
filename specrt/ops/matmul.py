"""Small-M linear ops: decode / verify projections at the memory floor, float and weight-quantized
(csrc/cpu/linear_kernel.h, csrc/cpu/linear_dynamic.h; CPU kernels, batch-invariant)."""
from __future__ import annotations

import torch

QUANT_KINDS = ("int8", "q8_0", "q4_0", "q4_1")
"""The weight formats of ``quant_linear``: int8 per output row, and llama.cpp's Q8_0, Q4_0, Q4_1 blocks of 32."""


def _linear_input(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dim [..., K], got a scalar")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _quant_rows(x, kind: str) -> torch.Tensor:
    """x as rows [M, K] for the quantized ops, after checking kind."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {QUANT_KINDS}, got {kind!r}")
    return _linear_input(x)


def _unflatten(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [M, N] back to x's leading dims: [..., N]."""
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x weight^T + bias, batch-invariant: each row's result never depends on the other rows.

    Built for decode and verification (a few rows): every weight row is streamed
    once for all rows of x, with fp32 accumulation in a fixed order per output
    (csrc/cpu/linear_kernel.h), the same for any row count, thread count and ISA
    (AMX / AVX-512-BF16 / AVX-512 / AVX2 / scalar). bf16 x with bf16 weights accumulates
    in the tdpbf16ps order on CPUs with usable AMX-BF16 (K even; AMX tiles serve every row
    count), else in the vdpbf16ps order; other bf16 x is widened to fp32 exactly.

    Shape: x [..., K] float32 or bfloat16; weight [N, K] float32 or bfloat16;
    bias [N] (any float dtype) or None.
    Returns: y [..., N] in x's dtype. Non-CPU tensors take torch's ``F.linear``.

    Examples:
        >>> y = ops.linear(torch.randn(5, 576), torch.randn(1536, 576))  # [5, 1536]
    """
    x2 = _linear_input(x)
    if x2.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.ops.specrt.linear(x2, weight, bias)
    return _unflatten(y, x)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """y = x W^T + bias with W weight-only quantized, dequantized in registers (fp32 accumulation).

    The result is bit-for-bit ``linear(x, W_float)`` with ``W_float =
    reference.dequantize_weight(qweight, scales, mins, kind)`` (llama.cpp's values).

    Shape: x [..., K] float32 or bfloat16 (bf16 is widened to fp32); for kind
      ``"int8"``: qweight [N, K] int8, scales [N] float32 (w = scale * q);
      ``"q8_0"``: qweight [N, K] int8, scales [N, K/32] float16 (w = d * q);
      ``"q4_0"``: qweight [N, K/2] uint8 (GGUF nibble order), scales [N, K/32] float16 (w = d * (q - 8));
      ``"q4_1"``: as q4_0 plus mins [N, K/32] float16 (w = d * q + m).
    mins is None except for q4_1; K must be a multiple of 32 for the grouped kinds.
    Returns: y [..., N] in x's dtype. Non-CPU tensors dequantize and take ``F.linear``.

    Examples:
        >>> y = ops.quant_linear(x, qweight, d, None, None, "q8_0")
    """
    x2 = _quant_rows(x, kind)
    if x2.device.type != "cpu":
        from specrt.ops import reference
        return reference.quant_linear(x, qweight, scales, mins, bias, kind)
    y = torch.ops.specrt.quant_linear(x2, qweight, scales, mins, bias, kind)
    return _unflatten(y, x)


def quant_linear_dynamic(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         bias: torch.Tensor | None, kind: str, interleaved: bool = False) -> torch.Tensor:
    """quant_linear with x quantized to int8 on the fly (opt-in: changes the numerics).

    Each row of x is quantized per block of 32 features (``dx = max|x| / 127``, ``xq =
    rint(x / dx)``, llama.cpp's Q8_1 activations) and multiplied with the quantized weight in
    integers: 16 blocks at a time, one per 32-bit lane, a block's 32 products summed in int32
    (AVX-512-VNNI ``vpdpbusd`` where the CPU has it; a portable path with the same bits elsewhere),
    then scaled once per block in float32 (csrc/cpu/linear_dynamic.h). Batch-invariant like
    ``quant_linear``; the result differs from it by the activation rounding (~0.5% of |y| on
    random data). ``reference.quant_linear_dynamic`` reproduces it bit for bit.

    interleaved: qweight is already in the kernel's order (``interleave_quant_weight``; what
    quantized layers hold while int8 activations are on); False permutes a copy per call.

    Shape: as quant_linear, with K a multiple of 32 for every kind (int8 included).
    Returns: y [..., N] in x's dtype.

    Examples:
        >>> y = ops.quant_linear_dynamic(x, qweight, d, m, None, "q4_1")
    """
    x2 = _quant_rows(x, kind)
    if x2.device.type != "cpu":
        raise ValueError(f"x must be on the CPU (int8 activations are a CPU mode), got {x2.device}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if not interleaved:
        if not isinstance(qweight, torch.Tensor):
            raise TypeError(f"qweight must be a torch.Tensor, got {type(qweight).__name__}")
        if x2.shape[-1] % 32 == 0 and qweight.dim() == 2 and qweight.device.type == "cpu" \
                and qweight.dtype in (torch.int8, torch.uint8) and qweight.shape[1] % 16 == 0:
            qweight = interleave_quant_weight(qweight, kind)  # else the op names what is wrong
    y = torch.ops.specrt.quant_linear_dynamic(x2, qweight, scales, mins, bias, kind)
    return _unflatten(y, x)


def interleave_quant_weight(qweight: torch.Tensor, kind: str, inverse: bool = False) -> torch.Tensor:
    """A quantized weight's bytes permuted within each row into the order ``quant_linear_dynamic``
    reads (``inverse``: back to the GGUF order): 16 blocks of 32 features at a time, stored as
    4-byte steps, one per block and step (csrc/cpu/linear_dynamic.h). Same shape and dtype.

    Shape: qweight [N, K] int8 (int8, q8_0) or [N, K/2] uint8 (q4_0, q4_1), K a multiple of 32.
    Returns: a new contiguous tensor. Non-CPU tensors take reference.interleave_quant_weight.

    Examples:
        >>> w = ops.interleave_quant_weight(qweight, "q4_1")
        >>> torch.equal(ops.interleave_quant_weight(w, "q4_1", inverse=True), qweight)
        True
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {QUANT_KINDS}, got {kind!r}")
    if not isinstance(qweight, torch.Tensor):
        raise TypeError(f"qweight must be a torch.Tensor, got {type(qweight).__name__}")
    if qweight.device.type != "cpu":
        from specrt.ops import reference
        return reference.interleave_quant_weight(qweight, kind, inverse)
    return torch.ops.specrt.interleave_quant_weight(qweight, kind, bool(inverse))
