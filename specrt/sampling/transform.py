"""The sampling transform of a call's rows (a verify's K+1 rows per request, or a draft step's
rows), shared by draft and target rows, and the log-probabilities it reports.

Draft and target rows of a request always get the same parameters and controls (a mismatch
silently ruins acceptance) and the same ``min_tokens`` EOS mask, so they sample from the same
constrained distribution. The order of the transform and the exact definitions of the controls
and of the log-probabilities: specrt.sampling.controls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from specrt import ops
from specrt.config import SamplingParams
from specrt.sampling.controls import ControlState, TokenLogprob, control_state
from specrt.structured import bitmask_width

_INT32_MAX = 2 ** 31 - 1
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class TransformRows(NamedTuple):
    """probs_from_logits' per-row parameters [R]."""

    temperature: torch.Tensor      # [R] float32
    top_k: torch.Tensor            # [R] int32
    top_p: torch.Tensor            # [R] float32
    min_p: torch.Tensor | None     # [R] float32; None: no row uses min-p


def param_rows(params: list[SamplingParams], counts: list[int], device) -> TransformRows:
    """Request i's parameters repeated counts[i] times. Values beyond the kernels' types mean the
    same clamped (a top_k >= the vocabulary keeps every token; a temperature beyond float32
    flattens the distribution like the largest one), so no request's parameters can break its
    batch's step."""
    temps, topk, topp, minp = [], [], [], []
    for p, c in zip(params, counts):
        temps += [min(p.temperature, _FLOAT32_MAX)] * c
        topk += [min(p.top_k, _INT32_MAX)] * c
        topp += [p.top_p] * c
        minp += [p.min_p] * c

    def dev(x, dtype=torch.float32):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    return TransformRows(dev(temps), dev(topk, torch.int32), dev(topp), dev(minp) if any(minp) else None)


def probs_from_logits(logits: torch.Tensor, rows: TransformRows) -> torch.Tensor:
    """probs [R, V] of the (already controlled) logits [R, V]."""
    return ops.probs_from_logits(logits, rows.temperature, rows.top_k, rows.top_p, min_p=rows.min_p,
                                 check_values=False)


# ----------------------------------------------------------------------------- logit controls
@dataclass
class PenaltyTable:
    """apply_penalties' per-request inputs for a batch of B requests (csrc/penalties_ops.h)."""

    entry_start: torch.Tensor          # [B+1] int64
    entry_token: torch.Tensor          # [E] int32
    entry_count: torch.Tensor          # [E] int32
    entry_in_prompt: torch.Tensor      # [E] bool
    entry_bias: torch.Tensor           # [E] float32
    repetition_penalty: torch.Tensor   # [B] float32
    frequency_penalty: torch.Tensor    # [B] float32
    presence_penalty: torch.Tensor     # [B] float32


@dataclass
class BatchControls:
    """The logit controls of a batch of B requests, built once per step and call site; any subset
    of rows (request b, after its drafts [:i]) is then controlled by ``apply_controls``."""

    states: list[ControlState | None]   # [B] host: None for a request without logit controls
    penalties: PenaltyTable | None      # None: no request has a penalty or bias
    context_tail: list[list[int]] | None   # [B] host: each request's last L context tokens (fewer if its
                                           # context is shorter; L = the longest bad-word prefix); None: no
                                           # multi-token bad word


def batch_controls(batch, device) -> BatchControls | None:
    """The controls of ``batch`` (requests), or None when none uses a logit control (nothing to do)."""
    states = [control_state(r) for r in batch]
    if all(s is None for s in states):
        return None
    for r, s in zip(batch, states):
        if s is not None and s.grammar is not None:
            s.grammar.sync(r.output_token_ids)       # the matcher at the committed output
    penalties = _penalty_table(batch, states, device) if any(
        s is not None and s.params.has_penalties for s in states) else None
    tail_len = max((s.sequence_bans.depth for s in states if s is not None and s.sequence_bans is not None),
                   default=0)
    tail = [_context_tail(r, tail_len) for r in batch] if tail_len else None
    return BatchControls(states, penalties, tail)


def _context_tail(r, n: int) -> list[int]:
    """The last n tokens of r's context (prompt + output), without copying the whole context."""
    out = r.output_token_ids
    if len(out) >= n:
        return out[len(out) - n:]
    prompt = r.prompt_token_ids
    return prompt[max(len(prompt) - (n - len(out)), 0):] + out


def _penalty_table(batch, states, device) -> PenaltyTable:
    start, parts = [0], []
    for r, s in zip(batch, states):
        e = s.entries(r.output_token_ids) if s is not None and s.params.has_penalties else None
        if e is not None:
            parts.append(e)
        start.append(start[-1] + (0 if e is None else e.token.size))

    def cat(name, dtype):
        x = np.concatenate([getattr(e, name) for e in parts]) if parts else np.zeros(0, dtype)
        return torch.from_numpy(np.ascontiguousarray(x, dtype=dtype)).to(device, non_blocking=True)

    def per_request(name):
        return torch.tensor([getattr(r.params, name) for r in batch], dtype=torch.float32).to(device, non_blocking=True)

    return PenaltyTable(torch.tensor(start, dtype=torch.int64).to(device, non_blocking=True),
                        cat("token", np.int32), cat("count", np.int32), cat("in_prompt", np.bool_),
                        cat("bias", np.float32), per_request("repetition_penalty"), per_request("frequency_penalty"),
                        per_request("presence_penalty"))


def apply_controls(logits: torch.Tensor, ctl: BatchControls, row_request: list[int], row_offset: list[int],
                   draft_token_ids: torch.Tensor) -> None:
    """In place on logits [R, V]: row r is request ``row_request[r]`` (of the batch ``ctl`` was built
    for) after its drafts ``draft_token_ids[b, :row_offset[r]]`` ([B, K] int32, on the device)."""
    dev, V = logits.device, logits.shape[1]

    def t(x, dtype=torch.int64):      # host -> device copies only
        return torch.as_tensor(x, dtype=dtype).to(dev, non_blocking=True)

    if ctl.penalties is not None:
        p = ctl.penalties
        ops.apply_penalties(logits, t(row_request, torch.int32), t(row_offset, torch.int32), draft_token_ids,
                            p.entry_start, p.entry_token, p.entry_count, p.entry_in_prompt, p.entry_bias,
                            p.repetition_penalty, p.frequency_penalty, p.presence_penalty, check_values=False)
    states = [ctl.states[b] for b in row_request]
    # one-token bad words: -inf at every row of the request
    bans = [(r, s.single_bans) for r, s in enumerate(states) if s is not None and s.single_bans.size]
    if bans:
        rows = np.concatenate([np.full(b.size, r) for r, b in bans])
        logits[t(rows), t(np.concatenate([b for _, b in bans]))] = float("-inf")
    if ctl.context_tail is not None:
        _ban_sequences(logits, ctl, states, row_request, row_offset, draft_token_ids)
    # allowed_token_ids: every other token of the row -inf
    allowed = [(r, s.allowed) for r, s in enumerate(states) if s is not None and s.allowed is not None]
    if allowed:
        rows = t([r for r, _ in allowed])
        keep = torch.zeros(len(allowed), V, dtype=torch.bool, device=dev)
        keep[t(np.concatenate([np.full(a.size, j) for j, (_, a) in enumerate(allowed)])),
             t(np.concatenate([a for _, a in allowed]))] = True
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    if any(s is not None and s.grammar is not None for s in states):
        _mask_grammars(logits, states, row_request, row_offset, draft_token_ids)


def _ban_sequences(logits, ctl: BatchControls, states, row_request, row_offset, draft_token_ids) -> None:
    """Multi-token bad words: ban the last token at the rows whose history (context tail, then the
    drafts before the row) ends with the word's other tokens, looked up in each request's BanTrie
    (per row: at most the longest prefix's length of look-ups, whatever the number of words). The
    drafts come to the host only when a row with such words follows some."""
    rows = [r for r, s in enumerate(states) if s is not None and s.sequence_bans is not None]
    drafts = draft_token_ids.tolist() if any(row_offset[r] for r in rows) else None
    hit_rows, hit_tokens = [], []
    for r in rows:
        b, o = row_request[r], row_offset[r]
        history = ctl.context_tail[b] + drafts[b][:o] if o else ctl.context_tail[b]
        tokens = states[r].sequence_bans.banned_after(history)
        if tokens.size:
            hit_rows.append(np.full(tokens.size, r, np.int64))
            hit_tokens.append(tokens)
    if hit_rows:
        dev = logits.device
        logits[torch.from_numpy(np.concatenate(hit_rows)).to(dev, non_blocking=True),
               torch.from_numpy(np.concatenate(hit_tokens)).to(dev, non_blocking=True)] = float("-inf")


def _mask_grammars(logits, states, row_request, row_offset, draft_token_ids) -> None:
    """structured: each grammar row's allowed tokens after its drafts (the request's matcher moved
    over them: specrt.structured.GrammarState), as one [n, W] int32 bitmask made on the host, then
    every other token of the row -inf (ops.apply_token_bitmask: one op over all rows). A row after a
    draft the grammar refuses (or after an EOS draft) is left as it is: it is never read. The drafts come to the host only when a
    grammar row follows some (one intentional copy: a device sync on CUDA, as for bad_words_ids)."""
    rows = [r for r, s in enumerate(states) if s is not None and s.grammar is not None]
    drafts = draft_token_ids.tolist() if any(row_offset[r] for r in rows) else None
    V = logits.shape[1]
    width = max(states[rows[0]].grammar.grammar.mask_width, bitmask_width(V))   # >= V bits (one tokenizer)
    bitmask = np.full((len(rows), width), -1, dtype=np.int32)                   # [n, W]: all allowed
    for i, r in enumerate(rows):
        g, o = states[r].grammar, row_offset[r]
        if g.seek(drafts[row_request[r]][:o] if o else []):
            g.fill(bitmask, i)
    ops.apply_token_bitmask(logits, bitmask, rows, check_values=False)


# ----------------------------------------------------------------------------- log-probabilities
@dataclass
class RowLogprobs:
    """Log-probabilities at some rows, on the device until the step's one device->host copy."""

    token_logprob: torch.Tensor   # [L] float32: of each row's token
    top_logprob: torch.Tensor     # [L, N] float32: the N most likely (N = the most any row asked for)
    top_token: torch.Tensor       # [L, N] int32
    top_n: list[int]              # [L] host: how many of the N each row reports


def row_logprobs(logp: torch.Tensor, tokens: torch.Tensor, top_n: list[int]) -> RowLogprobs:
    """From log-probabilities logp [L, V] and each row's token [L] (int, >= 0)."""
    n = min(max(top_n, default=0), logp.shape[1])
    top = logp.topk(n, dim=1) if n else None
    return RowLogprobs(logp.gather(1, tokens.long()[:, None])[:, 0],
                       top.values if top is not None else logp.new_zeros(logp.shape[0], 0),
                       (top.indices if top is not None else logp.new_zeros(logp.shape[0], 0)).to(torch.int32),
                       [min(k, n) for k in top_n])


def logprob_records(token_ids: list[int], token_logprob: list[float], top_logprob: list[list[float]],
                    top_token: list[list[int]], top_n: list[int]) -> list[TokenLogprob]:
    """Host lists (one entry per row) -> TokenLogprob records."""
    return [TokenLogprob(t, lp, list(zip(ids[:n], lps[:n])))
            for t, lp, lps, ids, n in zip(token_ids, token_logprob, top_logprob, top_token, top_n)]


def mask_eos(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
             eos_token_ids: list[int]) -> None:
    """min_tokens, in place: the EOS logits of row i are -inf when it would emit output token
    #output_index[i] < params[i].min_tokens."""
    rows = [i for i, (oi, p) in enumerate(zip(output_index, params)) if oi < p.min_tokens]
    if rows and eos_token_ids:
        eos = [e for e in eos_token_ids if e < logits.shape[1]]
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits[idx[:, None], torch.tensor(eos, dtype=torch.int64, device=logits.device)[None, :]] = float("-inf")


def pad_rows(rows: torch.Tensor, counts: list[int], K: int, pad_index: torch.Tensor) -> torch.Tensor:
    """The ragged [R, V] rows (request b's counts[b] rows in order) as [B, K+1, V]. A row past a
    request's drafts + 1 is never read by the verify kernels, so it is left unwritten (no memset
    of B*(K+1)*V values); with every request at K+1 rows the view alone."""
    B, V = len(counts), rows.shape[1]
    if all(c == K + 1 for c in counts):
        return rows.view(B, K + 1, V)
    padded = rows.new_empty(B * (K + 1), V)
    padded[pad_index] = rows
    return padded.view(B, K + 1, V)
