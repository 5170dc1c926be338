"""Sampling ops: the sampling transform, penalties, greedy and exact speculative verification,
the plain sampler, and the randomness testing hooks (docs/architecture.md sections 2 and 3)."""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from specrt.ops.checks import _as, _bool, _check_values, _cpu_only, _float_input, _has_kernels, _index, \
    _same_device, _tensor
from specrt.ops.library import greedy_temperature, philox4x32_10_words

PURPOSES = {"draft": 1, "accept": 2, "residual": 3, "target": 4}
"""The Philox streams, by name: a random number's purpose is part of its counter (``uniform_noise``)."""
METHODS = ("rejection", "coupled")
"""The acceptance rules of ``rejection_sample`` and ``rejection_sample_tree`` (their ``method``)."""
TEMPERATURE_EPS = greedy_temperature()
"""Temperatures below this float32 value (1e-5; 0 included) are greedy: ``is_greedy``. Read from the
extension (csrc/include/specrt/sampling.h, kGreedyTemperature), never written down twice."""


def is_greedy(temperature: float) -> bool:
    """The one greedy rule in Python, the kernels' (sampling.h, is_greedy_temperature): a temperature
    is greedy, a one-hot row at the argmax, when its float32 value is not >= ``TEMPERATURE_EPS``
    (0, tiny, negative and NaN temperatures are greedy). The float32 rounding is the kernels': they
    read temperatures as float32, so a float just below the threshold that rounds up to it samples.

    Examples:
        >>> ops.is_greedy(0.0), ops.is_greedy(5e-6), ops.is_greedy(0.7)
        (True, True, False)
    """
    return not ctypes.c_float(float(temperature)).value >= TEMPERATURE_EPS


def probs_from_logits(logits: torch.Tensor, temperature, top_k, top_p, min_p=None,
                      check_values: bool | None = None) -> torch.Tensor:
    """The one sampling transform: temperature -> top-k -> softmax -> min-p -> top-p -> renormalise.

    Shape: logits [N, V] (any float dtype), temperature [N] (greedy where
    ``is_greedy``: below ``TEMPERATURE_EPS`` = 1e-5, 0 included), top_k [N] (0 = off),
    top_p [N] in (0, 1] (1 = off), min_p [N] in [0, 1] or None (0 = off).
    Returns: probs [N, V] float32. Greedy rows are one-hot at the argmax
    (NaN counts as -inf, ties to the lowest index). Ties at the top-k / top-p
    threshold are kept. min-p keeps every token whose probability is at least
    min_p times the largest (on the softmax numerators exp(x/t - max), which
    are >= min_p exactly then); top-k and min-p commute, top-p cuts the row
    renormalised after both. Draft and target rows of a request must get the
    same parameters, or acceptance silently drops.

    Examples:
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

    Examples:
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


def apply_token_bitmask(logits: torch.Tensor, bitmask, rows=None, check_values: bool | None = None) -> None:
    """A grammar's allowed tokens, in place, for many rows at once: -inf at logits[rows[i], t]
    wherever bit t % 32 of bitmask[i, t // 32] is 0 (the int32 word layout llguidance and xgrammar
    fill). Allowed logits keep their bits; bits past V are ignored (csrc/include/specrt/bitmask.h).

    Shape: logits [R, V] float32, bfloat16, float16 or float64 (mutated), bitmask [n, W] int32 with
    W >= ceil(V / 32) (a numpy array is taken without a copy on the CPU), rows [n] (default: every
    row, n = R).

    Examples:
        >>> ops.apply_token_bitmask(logits, bitmask, rows=[2, 5])   # bitmask [2, W]: rows 2 and 5
    """
    logits = _tensor(logits, "logits")
    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(np.ascontiguousarray(bitmask))
    bitmask = _tensor(bitmask, "bitmask")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be an int32 tensor (32 tokens per word), got {bitmask.dtype}")
    if bitmask.device != logits.device:
        if bitmask.device.type != "cpu":
            _same_device(bitmask, "bitmask", logits)
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        if bitmask.dim() != 2 or logits.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask must be [R, W] for the logits' R rows when rows is None, got bitmask "
                             f"{tuple(bitmask.shape)} for logits {tuple(logits.shape)}")
        rows = torch.arange(logits.shape[0], dtype=torch.int32, device=logits.device)
    elif not isinstance(rows, torch.Tensor):
        rows = list(rows)
        rows = torch.as_tensor(rows) if rows else torch.zeros(0, dtype=torch.int64)
        rows = rows.to(logits.device, non_blocking=True)
    rows = _as(rows, "rows", torch.int32, logits)
    _has_kernels(logits, "logits")
    torch.ops.specrt.apply_token_bitmask(logits, bitmask.contiguous(), rows, _check_values(logits, check_values))


def verify_greedy(target_logits: torch.Tensor, draft_token_ids, num_draft_tokens,
                  check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept draft i while it equals the target argmax at i.

    Shape: target_logits [B, K+1, V], draft_token_ids [B, K], num_draft_tokens [B] (0..K).
    Returns: (output_token_ids [B, K+1] int32 padded with -1, num_accepted [B] int32);
    request b emits num_accepted[b] + 1 tokens: its accepted drafts, then the
    target's argmax at the first mismatch (or the bonus token). NaN logits count
    as -inf; ties go to the lowest token id.

    Examples:
        >>> out, n = ops.verify_greedy(logits, torch.tensor([[5, 9]]), torch.tensor([2]))   # logits [1, 3, V]
    """
    target_logits = _float_input(target_logits, "target_logits")
    draft_token_ids = _as(draft_token_ids, "draft_token_ids", torch.int32, target_logits)
    num_draft_tokens = _as(num_draft_tokens, "num_draft_tokens", torch.int32, target_logits)
    _has_kernels(target_logits, "target_logits")
    return torch.ops.specrt.verify_greedy(target_logits, draft_token_ids, num_draft_tokens,
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

    Examples:
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

    Examples:
        >>> tokens = ops.sample_tokens(probs, torch.tensor([7, 7]), torch.tensor([30, 31]))   # probs [2, V]
    """
    code = _purpose_code(purpose)
    probs = _float_input(probs, "probs")
    seeds = _as(seeds, "seeds", torch.int64, probs)
    positions = _as(positions, "positions", torch.int64, probs)
    _has_kernels(probs, "probs")
    return torch.ops.specrt.sample_tokens(probs, seeds, positions, code, _check_values(probs, check_values))


def philox4x32_10(counter: Sequence[int], key: Sequence[int]) -> list[int]:
    """The shared header's Philox4x32-10 (for known-answer tests); words are taken mod 2^32."""
    counter = [_index(c, "counter") & 0xFFFFFFFF for c in counter]
    key = [_index(c, "key") & 0xFFFFFFFF for c in key]
    return philox4x32_10_words(counter, key)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, purpose: str, index: torch.Tensor) -> torch.Tensor:
    """The shared header's uniforms in (0, 1) for (seed, position, purpose, index) (testing hook, CPU).

    Shape: seeds, positions, index [N] (integers). Returns: [N] float32.

    Examples:
        >>> u = ops.uniform_noise(torch.tensor([7]), torch.tensor([30]), "accept", torch.tensor([0]))
    """
    code = _purpose_code(purpose)
    seeds = _as(_cpu_only(seeds, "seeds"), "seeds", torch.int64, seeds)
    positions = _as(positions, "positions", torch.int64, seeds)
    index = _as(index, "index", torch.int64, seeds)
    return torch.ops.specrt.uniform_noise(seeds, positions, code, index)


def log_det(x: torch.Tensor) -> torch.Tensor:
    """The shared header's deterministic float32 log (testing hook, CPU).

    Shape: x [N] positive normal floats. Returns: [N] float32.

    Examples:
        >>> ops.log_det(torch.tensor([1.0, 2.0]))   # tensor([0.0000, 0.6931])
    """
    x = _cpu_only(x, "x")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    return torch.ops.specrt.log_det(x.float().contiguous())
