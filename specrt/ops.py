"""specrt's kernel ops: the only module that imports the compiled ``specrt._C``.

Every op is a real torch op (``torch.ops.specrt.<name>``, schemas in
csrc/bindings.cpp) with CPU and CUDA implementations and a fake kernel here,
so it traces under ``torch.compile(fullgraph=True)`` and passes
``torch.library.opcheck``. The functions below are its documented Python
front: they accept Python lists for the small per-row vectors, check what
can be checked without reading data, and call the op.

Shapes: B requests, K = max draft tokens this step, V vocabulary, N rows.
Token outputs are int32, padded with -1. Every op checks its arguments and
raises ``ValueError`` (or ``TypeError`` for a wrong type or dtype) naming the
argument. Integer arguments may have any integer dtype: values are
range-checked before the kernels narrow them to int32.

Value checks (NaN or negative probabilities, all-zero probability rows,
out-of-range token ids, block and slot ranges) read the data. On CPU tensors
they always run unless ``check_values=False``; on CUDA tensors they would cost
a device->host sync on the hot path, so they run only in debug mode
(``set_debug_checks(True)`` or ``SPECRT_DEBUG_CHECKS=1``). Without them the
kernels still never read or write out of bounds: bad ids are treated as
rejected, bad slots skipped, and integers outside int32 saturate.

Randomness (DESIGN.md section 3): every random number is a pure function of
``(seed, absolute position, purpose, index)`` through Philox4x32-10, so
results do not depend on batch composition, slot or device.
"""
from __future__ import annotations

import operator
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
# Temperatures below this (0 included) are greedy in probs_from_logits: one-hot
# at the argmax (csrc/include/specrt/sampling.h, kGreedyTemperature).
TEMPERATURE_EPS = 1e-5

_CUDA_BUILT = bool(_C.cuda_built())   # a constant, so torch.compile never calls into pybind
_debug_checks = os.environ.get("SPECRT_DEBUG_CHECKS", "0") not in ("", "0")


def set_debug_checks(enabled: bool) -> None:
    """Run value checks on CUDA tensors too (each costs a device->host sync)."""
    global _debug_checks
    _debug_checks = bool(enabled)


def cuda_built() -> bool:
    """True when this build of specrt contains the CUDA kernels."""
    return _CUDA_BUILT


def _check_values(t: torch.Tensor, check_values: bool | None) -> bool:
    if check_values is not None:
        return bool(check_values)
    return t.device.type == "cpu" or _debug_checks


def _tensor(t, name: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(t: torch.Tensor, name: str, like: torch.Tensor) -> None:
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} (like the other inputs), got {t.device}")


def _has_kernels(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cpu" or (t.device.type == "cuda" and _CUDA_BUILT):
        return
    raise ValueError(f"{name} is on {t.device} but this build of specrt has no kernels for it")


def _as(t, name: str, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """Accept Python lists / other integer or float dtypes for small per-row vectors.

    Integers stay in their dtype when the op reads int32: the op range-checks them
    before narrowing (a silent int64 -> int32 wrap would change the value)."""
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"{name} must be a tensor or a list of numbers: {exc}") from None
    if dtype.is_floating_point and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor ({dtype}), got {t.dtype}")
    if not dtype.is_floating_point and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor ({dtype}), got {t.dtype}")
    _same_device(t, name, like)
    return (t if dtype == torch.int32 else t.to(dtype)).contiguous()


def _float_input(t, name: str) -> torch.Tensor:
    t = _tensor(t, name)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.float()  # no copy when already float32


@torch.library.register_fake("specrt::probs_from_logits")
def _probs_from_logits_fake(logits, temperature, top_k, top_p, min_p=None, check_values=True):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D, got shape {list(logits.shape)}")
    return torch.empty_like(logits)


def probs_from_logits(logits: torch.Tensor, temperature, top_k, top_p, min_p=None,
                      check_values: bool | None = None) -> torch.Tensor:
    """The one sampling transform: temperature -> top-k -> softmax -> min-p -> top-p -> renormalise.

    Shape: logits [N, V] (any float dtype), temperature [N] (below
    ``TEMPERATURE_EPS`` = 1e-5, 0 included: greedy), top_k [N] (0 = off),
    top_p [N] in (0, 1] (1 = off), min_p [N] in [0, 1] or None (0 = off).
    Returns: probs [N, V] float32. Greedy rows are one-hot at the argmax
    (NaN counts as -inf, ties to the lowest index). Ties at the top-k / top-p
    threshold are kept. min-p keeps every token whose probability is at least
    min_p times the largest (on the softmax numerators exp(x/t - max), which
    are >= min_p exactly then); top-k and min-p commute, top-p cuts the row
    renormalised after both. Draft and target rows of a request must get the
    same parameters, or acceptance silently drops.

    Example:
        >>> probs = ops.probs_from_logits(logits, torch.tensor([0.7]), torch.tensor([50]), torch.tensor([0.9]),
        ...                               min_p=torch.tensor([0.05]))
    """
    logits = _float_input(logits, "logits")
    temperature = _as(temperature, "temperature", torch.float32, logits)
    top_k = _as(top_k, "top_k", torch.int32, logits)
    top_p = _as(top_p, "top_p", torch.float32, logits)
    if min_p is not None:
        min_p = _as(min_p, "min_p", torch.float32, logits)
    _has_kernels(logits, "logits")
    return torch.ops.specrt.probs_from_logits(logits, temperature, top_k, top_p, min_p,
                                              _check_values(logits, check_values))


@torch.library.register_fake("specrt::apply_penalties")
def _apply_penalties_fake(logits, row_request, row_offset, draft_token_ids, entry_start, entry_token, entry_count,
                          entry_in_prompt, entry_bias, repetition_penalty, frequency_penalty, presence_penalty,
                          check_values=True):
    return None


def apply_penalties(logits: torch.Tensor, row_request, row_offset, draft_token_ids, entry_start, entry_token,
                    entry_count, entry_in_prompt, entry_bias, repetition_penalty, frequency_penalty,
                    presence_penalty, check_values: bool | None = None) -> None:
    """logit_bias and repetition / frequency / presence penalties, in place, for every row at once.

    Row r belongs to request b = row_request[r] and follows i = row_offset[r] of its draft
    tokens: its history is what request b's entries describe plus draft_token_ids[b, :i], so
    every verified (or drafted) position sees exactly the tokens an autoregressive step would.
    Request b's entries are ``entry_start[b]:entry_start[b+1]``: strictly increasing tokens, each
    with its generated count (prompt excluded), an in-prompt flag and a bias. For each token with
    count c (generated before the row, drafts included) the logit x becomes
    ``x + bias``; then, if it is in the prompt or c > 0, ``x < 0 ? x * rp : x / rp``; then, if
    c > 0, ``(x - fp * c) - pp`` (csrc/include/specrt/penalties.h). Other logits are untouched:
    a row costs O(entries + drafts), not O(V).

    Shape: logits [R, V] float32 (mutated), row_request [R], row_offset [R] (0..K),
    draft_token_ids [B, K], entry_start [B+1] int64, entry_token / entry_count / entry_in_prompt
    (bool) / entry_bias (float32) [E], repetition_penalty / frequency_penalty / presence_penalty
    [B] float32 (1, 0, 0 = off).

    Example:
        >>> ops.apply_penalties(logits, [0, 0], [0, 1], drafts, [0, 2], [3, 9], [1, 0], [False, True], [0.0, -5.0],
        ...                     [1.2], [0.5], [0.1])     # logits [2, V]: request 0 at its draft positions 0 and 1
    """
    logits = _tensor(logits, "logits")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be a float32 tensor (it is modified in place), got {logits.dtype}")
    row_request = _as(row_request, "row_request", torch.int32, logits)
    row_offset = _as(row_offset, "row_offset", torch.int32, logits)
    draft_token_ids = _as(draft_token_ids, "draft_token_ids", torch.int32, logits)
    entry_start = _as(entry_start, "entry_start", torch.int64, logits)
    entry_token = _as(entry_token, "entry_token", torch.int32, logits)
    entry_count = _as(entry_count, "entry_count", torch.int32, logits)
    entry_in_prompt = _bool(entry_in_prompt, "entry_in_prompt", logits)
    entry_bias = _as(entry_bias, "entry_bias", torch.float32, logits)
    penalties = [_as(t, name, torch.float32, logits) for t, name in (
        (repetition_penalty, "repetition_penalty"), (frequency_penalty, "frequency_penalty"),
        (presence_penalty, "presence_penalty"))]
    _has_kernels(logits, "logits")
    torch.ops.specrt.apply_penalties(logits, row_request, row_offset, draft_token_ids, entry_start, entry_token,
                                     entry_count, entry_in_prompt, entry_bias, *penalties,
                                     _check_values(logits, check_values))


def _bool(t, name: str, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t, dtype=torch.bool)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} must be a tensor or a list of booleans: {exc}") from None
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {t.dtype}")
    _same_device(t, name, like)
    return t.contiguous()


def _tokens_and_counts(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(like.dim() == 3, lambda: f"expected [B, K+1, V], got shape {list(like.shape)}")
    b, k1 = like.shape[0], like.shape[1]
    return like.new_empty((b, k1), dtype=torch.int32), like.new_empty((b,), dtype=torch.int32)


@torch.library.register_fake("specrt::verify_greedy")
def _verify_greedy_fake(target_logits, draft_token_ids, num_draft_tokens, check_values=True):
    return _tokens_and_counts(target_logits)


def verify_greedy(target_logits: torch.Tensor, draft_token_ids, num_draft_tokens,
                  check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept draft i while it equals the target argmax at i.

    Shape: target_logits [B, K+1, V], draft_token_ids [B, K], num_draft_tokens [B] (0..K).
    Returns: (output_token_ids [B, K+1] int32 padded with -1, num_accepted [B] int32);
    request b emits num_accepted[b] + 1 tokens: its accepted drafts, then the
    target's argmax at the first mismatch (or the bonus token). NaN logits count
    as -inf; ties go to the lowest token id.

    Example:
        >>> out, n = ops.verify_greedy(logits, torch.tensor([[5, 9]]), torch.tensor([2]))   # logits [1, 3, V]
    """
    target_logits = _float_input(target_logits, "target_logits")
    draft_token_ids = _as(draft_token_ids, "draft_token_ids", torch.int32, target_logits)
    num_draft_tokens = _as(num_draft_tokens, "num_draft_tokens", torch.int32, target_logits)
    _has_kernels(target_logits, "target_logits")
    return torch.ops.specrt.verify_greedy(target_logits, draft_token_ids, num_draft_tokens,
                                          _check_values(target_logits, check_values))


@torch.library.register_fake("specrt::rejection_sample")
def _rejection_sample_fake(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds, positions,
                           method="rejection", check_values=True):
    return _tokens_and_counts(target_probs)


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

    Example:
        >>> out, n = ops.rejection_sample(p, q, ids, torch.tensor([2]), torch.tensor([7]), torch.tensor([30]))
    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    target_probs = _float_input(target_probs, "target_probs")
    if draft_probs is not None:
        draft_probs = _float_input(draft_probs, "draft_probs")
        _same_device(draft_probs, "draft_probs", target_probs)
    draft_token_ids = _as(draft_token_ids, "draft_token_ids", torch.int32, target_probs)
    num_draft_tokens = _as(num_draft_tokens, "num_draft_tokens", torch.int32, target_probs)
    seeds = _as(seeds, "seeds", torch.int64, target_probs)
    positions = _as(positions, "positions", torch.int64, target_probs)
    _has_kernels(target_probs, "target_probs")
    return torch.ops.specrt.rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds,
                                             positions, method, _check_values(target_probs, check_values))


@torch.library.register_fake("specrt::sample_tokens")
def _sample_tokens_fake(probs, seeds, positions, purpose=4, check_values=True):
    torch._check(probs.dim() == 2, lambda: f"probs must be 2-D, got shape {list(probs.shape)}")
    return probs.new_empty((probs.shape[0],), dtype=torch.int32)


def _purpose_code(purpose) -> int:
    if not isinstance(purpose, str) or purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {sorted(PURPOSES)}, got {purpose!r}")
    return PURPOSES[purpose]


def sample_tokens(probs: torch.Tensor, seeds, positions, purpose: str = "target",
                  check_values: bool | None = None) -> torch.Tensor:
    """Sample one token per row by the exponential race under ``purpose``.

    Shape: probs [N, V] (need not be normalised), seeds [N] int64, positions [N] int64.
    Returns: tokens [N] int32. purpose="target" is the autoregressive sampler
    (and what coupled drafts use); "draft" is the draft sampler of
    method="rejection". One-hot rows return their argmax. With value checks an
    all-zero row is an error (it has no token to sample); without them it
    yields token 0.

    Example:
        >>> tokens = ops.sample_tokens(probs, torch.tensor([7, 7]), torch.tensor([30, 31]))   # probs [2, V]
    """
    code = _purpose_code(purpose)
    probs = _float_input(probs, "probs")
    seeds = _as(seeds, "seeds", torch.int64, probs)
    positions = _as(positions, "positions", torch.int64, probs)
    _has_kernels(probs, "probs")
    return torch.ops.specrt.sample_tokens(probs, seeds, positions, code, _check_values(probs, check_values))


@torch.library.register_fake("specrt::copy_blocks")
def _copy_blocks_fake(caches, block_mapping, check_values=True):
    return None


def _block_mapping(block_mapping) -> torch.Tensor:
    """A tensor passes as is (the op checks dtype int64); a list must hold integers."""
    if isinstance(block_mapping, torch.Tensor):
        return block_mapping.contiguous()
    if block_mapping is None:
        raise ValueError("block_mapping must be a tensor, got None")
    try:
        t = torch.as_tensor(block_mapping)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"block_mapping must be a tensor or a list of (src, dst) pairs: {exc}") from None
    if t.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"block_mapping must hold integer block ids, got {t.dtype} values")
    return (t.reshape(-1, 2) if t.dim() == 1 and t.numel() % 2 == 0 else t).to(torch.int64).contiguous()


def copy_blocks(caches: Sequence[torch.Tensor], block_mapping, check_values: bool | None = None) -> None:
    """Copy whole KV blocks src -> dst in every layer of every cache, in one launch.

    Shape: each cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    (target and draft caches may differ in every dim but 1 and in dtype);
    block_mapping [P, 2] int64 (src, dst), on the CPU or on the caches' device.
    A CPU mapping is always validated (in range for every cache, distinct
    destinations, no block both source and destination).

    Example:
        >>> ops.copy_blocks([target_cache, draft_cache], torch.tensor([[3, 8]]))   # block 3 -> block 8
    """
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"caches must be a list of cache tensors, got {type(caches).__name__}")
    caches = [_tensor(c, f"caches[{i}]") for i, c in enumerate(caches)]
    if not caches:
        raise ValueError("caches must be a non-empty list of cache tensors")
    for i, c in enumerate(caches[1:], 1):
        _same_device(c, f"caches[{i}]", caches[0])
    block_mapping = _block_mapping(block_mapping)
    if block_mapping.device.type != "cpu":
        _same_device(block_mapping, "block_mapping", caches[0])
    _has_kernels(caches[0], "caches")
    torch.ops.specrt.copy_blocks(caches, block_mapping, _check_values(caches[0], check_values))


@torch.library.register_fake("specrt::write_kv")
def _write_kv_fake(cache, layer, k, v, slot_mapping, check_values=True):
    return None


def _index(x, name: str) -> int:
    """A Python integer (no silent truncation of floats)."""
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an integer, got bool {x!r}")
    try:
        value = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(x).__name__} {x!r}") from None
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} = {value} is out of range")
    return value


def write_kv(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             check_values: bool | None = None) -> None:
    """Store new keys/values: cache[layer, 0|1, slot // block_size, slot % block_size] = k|v.

    Shape: cache [layers, 2, num_blocks, block_size, kv_heads, head_dim],
    k, v [T, kv_heads, head_dim] in the cache's dtype, slot_mapping [T] int64
    (-1 = padding, skipped).

    Example:
        >>> ops.write_kv(cache, 0, k, v, torch.tensor([17, -1, 18]))   # k, v [3, kv_heads, head_dim]
    """
    cache = _tensor(cache, "cache")
    layer = _index(layer, "layer")
    for t, name in ((k, "k"), (v, "v"), (slot_mapping, "slot_mapping")):
        _same_device(_tensor(t, name), name, cache)
    _has_kernels(cache, "cache")
    torch.ops.specrt.write_kv(cache, layer, k, v, slot_mapping, _check_values(cache, check_values))


def philox4x32_10(counter: Sequence[int], key: Sequence[int]) -> list[int]:
    """The shared header's Philox4x32-10 (for known-answer tests); words are taken mod 2^32."""
    counter = [_index(c, "counter") & 0xFFFFFFFF for c in counter]
    key = [_index(c, "key") & 0xFFFFFFFF for c in key]
    return list(_C.philox4x32_10(counter, key))


def _cpu_only(t, name: str) -> torch.Tensor:
    t = _tensor(t, name)
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on cpu (a CPU testing hook), got {t.device}")
    return t


@torch.library.register_fake("specrt::uniform_noise")
def _uniform_noise_fake(seeds, positions, purpose, index):
    return seeds.new_empty(seeds.shape, dtype=torch.float32)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, purpose: str, index: torch.Tensor) -> torch.Tensor:
    """The shared header's uniforms in (0, 1) for (seed, position, purpose, index) (testing hook, CPU).

    Shape: seeds, positions, index [N] (integers). Returns: [N] float32.

    Example:
        >>> u = ops.uniform_noise(torch.tensor([7]), torch.tensor([30]), "accept", torch.tensor([0]))
    """
    code = _purpose_code(purpose)
    seeds = _as(_cpu_only(seeds, "seeds"), "seeds", torch.int64, seeds)
    positions = _as(positions, "positions", torch.int64, seeds)
    index = _as(index, "index", torch.int64, seeds)
    return torch.ops.specrt.uniform_noise(seeds, positions, code, index)


@torch.library.register_fake("specrt::log_det")
def _log_det_fake(x):
    return torch.empty_like(x)


def log_det(x: torch.Tensor) -> torch.Tensor:
    """The shared header's deterministic float32 log (testing hook, CPU).

    Shape: x [N] positive normal floats. Returns: [N] float32.

    Example:
        >>> ops.log_det(torch.tensor([1.0, 2.0]))   # tensor([0.0000, 0.6931])
    """
    x = _cpu_only(x, "x")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    return torch.ops.specrt.log_det(x.float().contiguous())


# ----------------------------------------------------------------------------- paged attention
# (torch.library op specrt::paged_attention: csrc/attention_ops.cpp, kernels csrc/cpu/attention_cpu.cpp,
# csrc/cuda/attention_cuda.cu, shared math csrc/include/specrt/attention.h)
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int | None = 0,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    check_values: bool | None = None) -> torch.Tensor:
    """Attention of every request's new queries directly over its paged KV blocks (no gather copy).

    Request b's new tokens are rows ``query_start_loc[b]:query_start_loc[b+1]`` of ``q``; its
    query i sits at position ``seq_lens[b] - query_len + i`` and attends causally to the
    request's keys ``0 .. pos`` (the last ``window`` of them when ``window`` > 0), read from
    ``kv_cache`` through ``block_tables`` — the new tokens' K/V must already be written
    (``write_kv``). Query head h uses kv head ``h // (H // Hkv)`` (GQA). float32 accumulation
    with an online softmax; a long context is split into 256-key chunks across threads / CTAs
    and combined in a fixed order, so a query's output does not depend on its batch
    neighbours, the number of queries of its request, the block size or the thread count, and
    the CPU and CUDA kernels return the same bits (csrc/include/specrt/attention.h).

    Shape: q [T, H, D] float32; kv_cache [2, num_blocks, block_size, Hkv, D] (one layer of the
    model cache) float32, bfloat16 or float16; block_tables [B, max_blocks] int32 (-1 padded);
    seq_lens [B] int64 (context length including the new tokens); query_start_loc [B+1] int64.
    ``max_query_len`` / ``max_seq_len`` bound the query lengths and seq_lens (host ints: the CUDA
    kernel sizes its grid from them without a sync); computed from the tensors when omitted
    (CPU tensors only).

    Returns: out [T, H, D] float32; rows past ``query_start_loc[B]`` (padding) are zero.

    Example:
        >>> meta = AttentionMetadata.build([7, 3], [5, 1], [[4, 0], [2]], block_size=4)
        >>> out = ops.paged_attention(q, cache[layer], meta.block_tables, meta.seq_lens,
        ...                           meta.query_start_loc, scale=head_dim ** -0.5)
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if max_query_len is None or max_seq_len is None:
        if not (isinstance(seq_lens, torch.Tensor) and isinstance(query_start_loc, torch.Tensor)):
            raise TypeError("seq_lens and query_start_loc must be tensors")
        if seq_lens.device.type != "cpu" or query_start_loc.device.type != "cpu":
            raise ValueError("pass max_query_len and max_seq_len for device tensors (reading them would sync)")
        if max_query_len is None:
            max_query_len = int(query_start_loc.diff().max()) if query_start_loc.numel() > 1 else 0
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    return torch.ops.specrt.paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, float(scale),
                                            int(window or 0), int(max_query_len), int(max_seq_len),
                                            _check_values(q, check_values))


@torch.library.register_fake("specrt::paged_attention")
def _paged_attention_fake(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window, max_query_len,
                          max_seq_len, check_values):
    return torch.empty_like(q)


def attention_cpu_isa(cap: int = -1) -> int:
    """Testing hook: cap the instruction set of the CPU attention kernel (0 portable scalar code,
    1 AVX2+FMA, 2 AVX-512; -1 only asks) and return the level in use before the call. Every level
    returns the same bits; tests use this to check that."""
    return int(torch.ops.specrt._attention_cpu_isa(int(cap)))



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


def quant_linear_dynamic(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """quant_linear with x quantized to int8 on the fly (opt-in: changes the numerics).

    Each row of x is quantized per block of 32 features (``dx = max|x| / 127``, ``xq =
    rint(x / dx)``, llama.cpp's Q8_1 activations) and multiplied with the quantized weight in
    integers (AVX-512-VNNI ``vpdpbusd`` where the CPU has it; a portable path with the same bits
    elsewhere), scaled per block in float32 (csrc/cpu/linear_dynamic.h). Batch-invariant like
    ``quant_linear``; the result differs from it by the activation rounding (~0.5% of |y| on
    random data), so ``reference.quant_linear_dynamic`` is its oracle, not ``quant_linear``.

    Shape: as quant_linear, with K a multiple of 32 for every kind (int8 included).
    Returns: y [..., N] in x's dtype.

    Example:
        >>> y = ops.quant_linear_dynamic(x, qweight, d, m, None, "q4_1")
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {QUANT_KINDS}, got {kind!r}")
    x2 = _linear_input(x)
    if x2.device.type != "cpu":
        raise ValueError(f"x must be on the CPU (int8 activations are a CPU mode), got {x2.device}")
    y = torch.ops.specrt.quant_linear_dynamic(x2, qweight, scales, mins, bias, kind)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear_dynamic_vnni() -> bool:
    """Whether quant_linear_dynamic runs on AVX-512-VNNI now (else its portable path: the same bits)."""
    return bool(torch.ops.specrt.linear_dynamic_vnni())


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


@torch.library.register_fake("specrt::quant_linear_dynamic")
def _quant_linear_dynamic_fake(x, qweight, scales, mins, bias, kind):
    return x.new_empty(x.shape[0], qweight.shape[0])


# --------------------------------------------------------------------------- #
# Fused decoder kernels: RMSNorm (+ residual add), SwiGLU, RoPE + KV store
# (csrc/cpu/fused_kernel.h; CPU only, float32 / bfloat16)
# --------------------------------------------------------------------------- #
FUSED_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * round(x / sqrt(mean(x^2) + eps))`` per row, as transformers' LlamaRMSNorm.

    With ``residual``: first ``residual += x`` in place (rounded to its dtype), then the sum
    is normalized — the decoder's residual add and the next layer norm in one pass. Statistics
    in float32 with a fixed order per row: the result of a row never depends on the other
    rows, the thread count or the ISA. "round" is to x's dtype (bf16: where transformers rounds).

    Shape: x [T, H] float32 or bfloat16 (unit stride in H); weight [H] in x's dtype;
    residual [T, H] like x or None.
    Returns: [T, H] in x's dtype (a new tensor).

    Example:
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

    Example:
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

    Example:
        >>> q = ops.rotary_write_kv(qkv, cos, sin, 9, 3, cache, layer=0, slot_mapping=slots)
    """
    return torch.ops.specrt.rotary_write_kv(qkv, cos, sin, int(num_heads), int(num_kv_heads), kv_cache, int(layer),
                                            slot_mapping, q_dtype)


@torch.library.register_fake("specrt::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("specrt::add_rms_norm_")
def _add_rms_norm_fake(residual, x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("specrt::silu_mul")
def _silu_mul_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.register_fake("specrt::rotary_write_kv")
def _rotary_write_kv_fake(qkv, cos, sin, num_heads, num_kv_heads, kv_cache, layer, slot_mapping, q_dtype=None):
    return qkv.new_empty(qkv.shape[0], num_heads, cos.shape[1], dtype=q_dtype or qkv.dtype)
