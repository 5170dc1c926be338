"""specrt's kernel ops: the only module that imports the compiled ``specrt._C``.

Shapes: B requests, K = max draft tokens this step, V vocabulary, N rows.
Token outputs are int32, padded with -1. Every op checks its arguments and
raises ``ValueError`` (or ``TypeError`` for a wrong dtype) naming the argument.

Value checks (NaN or negative probabilities, out-of-range token ids, block and
slot ranges) read the data. On CPU tensors they always run unless
``check_values=False``; on CUDA tensors they would cost a device->host sync on
the hot path, so they run only in debug mode (``set_debug_checks(True)`` or
``SPECRT_DEBUG_CHECKS=1``). Without them the CUDA kernels still never read or
write out of bounds: bad ids are treated as rejected and bad slots skipped.

Randomness (DESIGN.md section 3): every random number is a pure function of
``(seed, absolute position, purpose, index)`` through Philox4x32-10, so
results do not depend on batch composition, slot or device.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

try:
    from specrt import _C
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "specrt's compiled extension specrt._C is missing or was built against another torch "
        f"(torch here is {torch.__version__}). Reinstall with `pip install --no-build-isolation .` "
        f"from the specrt source tree. Original error: {exc}"
    ) from exc

PURPOSES = {"draft": 1, "accept": 2, "residual": 3, "target": 4}
METHODS = ("rejection", "coupled")

_debug_checks = os.environ.get("SPECRT_DEBUG_CHECKS", "0") not in ("", "0")


def set_debug_checks(enabled: bool) -> None:
    """Run value checks on CUDA tensors too (each costs a device->host sync)."""
    global _debug_checks
    _debug_checks = bool(enabled)


def cuda_built() -> bool:
    """True when this build of specrt contains the CUDA kernels."""
    return bool(_C.cuda_built())


def _check_values(t: torch.Tensor, check_values: bool | None) -> bool:
    if check_values is not None:
        return bool(check_values)
    return t.device.type == "cpu" or _debug_checks


def _as(t, name: str, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """Accept Python lists / other integer or float dtypes for small per-row vectors."""
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.is_floating_point() != dtype.is_floating_point:
        kind = "a floating-point" if dtype.is_floating_point else "an integer"
        raise TypeError(f"{name} must be {kind} tensor ({dtype}), got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} (like the other inputs), got {t.device}")
    return t.to(dtype).contiguous()


def _float_input(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.float()  # no copy when already float32


def probs_from_logits(logits: torch.Tensor, temperature, top_k, top_p,
                      check_values: bool | None = None) -> torch.Tensor:
    """The one sampling transform: temperature -> top-k -> softmax -> top-p -> renormalise.

    Shape: logits [N, V] (any float dtype), temperature [N] (0 = greedy),
    top_k [N] (0 = off), top_p [N] in (0, 1] (1 = off).
    Returns: probs [N, V] float32. Greedy rows are one-hot at the argmax
    (NaN counts as -inf, ties to the lowest index). Ties at the top-k / top-p
    threshold are kept. Draft and target rows of a request must get the same
    parameters, or acceptance silently drops.

    Example:
        >>> probs = ops.probs_from_logits(logits, torch.tensor([0.7]), torch.tensor([50]), torch.tensor([0.9]))
    """
    logits = _float_input(logits, "logits")
    return _C.probs_from_logits(logits, _as(temperature, "temperature", torch.float32, logits),
                                _as(top_k, "top_k", torch.int32, logits),
                                _as(top_p, "top_p", torch.float32, logits),
                                _check_values(logits, check_values))


def verify_greedy(target_logits: torch.Tensor, draft_token_ids, num_draft_tokens,
                  check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept draft i while it equals the target argmax at i.

    Shape: target_logits [B, K+1, V], draft_token_ids [B, K], num_draft_tokens [B] (0..K).
    Returns: (output_token_ids [B, K+1] int32 padded with -1, num_accepted [B] int32);
    request b emits num_accepted[b] + 1 tokens: its accepted drafts, then the
    target's argmax at the first mismatch (or the bonus token). NaN logits count
    as -inf; ties go to the lowest token id.
    """
    target_logits = _float_input(target_logits, "target_logits")
    return _C.verify_greedy(target_logits, _as(draft_token_ids, "draft_token_ids", torch.int32, target_logits),
                            _as(num_draft_tokens, "num_draft_tokens", torch.int32, target_logits),
                            _check_values(target_logits, check_values))


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids,
                     num_draft_tokens, seeds, positions, method: str = "rejection",
                     check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. / Chen et al.), fused.

    Shape: target_probs [B, K+1, V], draft_probs [B, K, V] or None (the draft was
    deterministic: one-hot q), draft_token_ids [B, K], num_draft_tokens [B]
    (0..K, per request), seeds [B] int64, positions [B] int64 = absolute
    position of draft token 0 (draft token i sits at positions[b] + i).

    method="rejection": accept draft i while u_i * q_i(x_i) < p_i(x_i); at the
    first rejection emit a sample of norm(max(p - q, 0)); if all are accepted
    emit a bonus sample of p_n. method="coupled": the drafts were sampled with
    the target's own race noise (``sample_tokens(..., purpose="target")``);
    accept while the draft equals the target's race winner, and emit that
    winner at the first mismatch: the output equals plain ``sample_tokens`` of
    the target with the same seeds, whatever the draft.

    Returns: (output_token_ids [B, K+1] int32 padded with -1, num_accepted [B] int32).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    target_probs = _float_input(target_probs, "target_probs")
    if draft_probs is not None:
        draft_probs = _float_input(draft_probs, "draft_probs")
    return _C.rejection_sample(target_probs, draft_probs,
                               _as(draft_token_ids, "draft_token_ids", torch.int32, target_probs),
                               _as(num_draft_tokens, "num_draft_tokens", torch.int32, target_probs),
                               _as(seeds, "seeds", torch.int64, target_probs),
                               _as(positions, "positions", torch.int64, target_probs),
                               method, _check_values(target_probs, check_values))


def sample_tokens(probs: torch.Tensor, seeds, positions, purpose: str = "target",
                  check_values: bool | None = None) -> torch.Tensor:
    """Sample one token per row by the exponential race under ``purpose``.

    Shape: probs [N, V] (need not be normalised), seeds [N] int64, positions [N] int64.
    Returns: tokens [N] int32. purpose="target" is the autoregressive sampler
    (and what coupled drafts use); "draft" is the draft sampler of
    method="rejection". One-hot rows return their argmax.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {sorted(PURPOSES)}, got {purpose!r}")
    probs = _float_input(probs, "probs")
    return _C.sample_tokens(probs, _as(seeds, "seeds", torch.int64, probs),
                            _as(positions, "positions", torch.int64, probs), PURPOSES[purpose],
                            _check_values(probs, check_values))


def copy_blocks(caches: Sequence[torch.Tensor], block_mapping, check_values: bool | None = None) -> None:
    """Copy whole KV blocks src -> dst in every layer of every cache, in one launch.

    Shape: each cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    (target and draft caches may differ in every dim but 1 and in dtype);
    block_mapping [P, 2] int64 (src, dst), on the CPU or on the caches' device.
    A CPU mapping is always validated (in range for every cache, distinct
    destinations, no block both source and destination).
    """
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    caches = list(caches)
    if not isinstance(block_mapping, torch.Tensor):
        block_mapping = torch.as_tensor(block_mapping, dtype=torch.int64).reshape(-1, 2)
    check = _check_values(caches[0], check_values) if caches else True
    _C.copy_blocks(caches, block_mapping.contiguous(), check)


def write_kv(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             check_values: bool | None = None) -> None:
    """Store new keys/values: cache[layer, 0|1, slot // block_size, slot % block_size] = k|v.

    Shape: cache [layers, 2, num_blocks, block_size, kv_heads, head_dim],
    k, v [T, kv_heads, head_dim] in the cache's dtype, slot_mapping [T] int64
    (-1 = padding, skipped).
    """
    _C.write_kv(cache, int(layer), k, v, slot_mapping, _check_values(cache, check_values))


def philox4x32_10(counter: Sequence[int], key: Sequence[int]) -> list[int]:
    """The shared header's Philox4x32-10 (for known-answer tests)."""
    return list(_C.philox4x32_10(list(counter), list(key)))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, purpose: str, index: torch.Tensor) -> torch.Tensor:
    """The shared header's uniforms in (0, 1) for (seed, position, purpose, index) (testing hook)."""
    return _C.uniform(seeds.long().contiguous(), positions.long().contiguous(), PURPOSES[purpose],
                      index.long().contiguous())


def log_det(x: torch.Tensor) -> torch.Tensor:
    """The shared header's deterministic float32 log (testing hook)."""
    return _C.log_det(x.float().contiguous())


# --------------------------------------------------------------------------- #
# Small-M linear kernel: decode / verify projections at the memory floor
# (csrc/cpu/linear_kernel.h; section owned by the linear-layer work)
# --------------------------------------------------------------------------- #
QUANT_KINDS = ("int8", "q8_0", "q4_0", "q4_1")


def _linear_input(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dim [..., K], got a scalar")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x weight^T + bias, batch-invariant: each row's result never depends on the other rows.

    Built for decode and verification (a few rows): every weight row is streamed
    once for all rows of x, with fp32 accumulation in a fixed order per output
    (csrc/cpu/linear_kernel.h), the same for any row count, thread count and ISA
    (AVX-512-BF16 / AVX-512 / AVX2 / scalar). bf16 x with bf16 weights accumulates
    in the vdpbf16ps order; other bf16 x is widened to fp32 exactly.

    Shape: x [..., K] float32 or bfloat16; weight [N, K] float32 or bfloat16;
    bias [N] (any float dtype) or None.
    Returns: y [..., N] in x's dtype. Non-CPU tensors take torch's ``F.linear``.

    Example:
        >>> y = ops.linear(torch.randn(5, 576), torch.randn(1536, 576))  # [5, 1536]
    """
    x2 = _linear_input(x)
    if x2.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.ops.specrt.linear(x2, weight, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


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

    Example:
        >>> y = ops.quant_linear(x, qweight, d, None, None, "q8_0")
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {QUANT_KINDS}, got {kind!r}")
    x2 = _linear_input(x)
    if x2.device.type != "cpu":
        from specrt import reference
        return reference.quant_linear(x, qweight, scales, mins, bias, kind)
    y = torch.ops.specrt.quant_linear(x2, qweight, scales, mins, bias, kind)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear_isa_names() -> list[str]:
    """ISAs the linear kernel can use on this CPU, best first (e.g. ["avx512bf16", "avx512", "avx2", "scalar"])."""
    return list(torch.ops.specrt.linear_isa_names())


def set_linear_isa(name: str) -> str:
    """Cap the linear kernel's ISA (all give identical bits; for tests and benchmarks); "" = best.

    Returns: the previous ISA name."""
    return torch.ops.specrt.set_linear_isa(str(name))


@torch.library.register_fake("specrt::linear")
def _linear_fake(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("specrt::quant_linear")
def _quant_linear_fake(x, qweight, scales, mins, bias, kind):
    return x.new_empty(x.shape[0], qweight.shape[0])
