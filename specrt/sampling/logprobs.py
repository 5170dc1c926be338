"""The log-probabilities a step reports (``SamplingParams.logprobs`` / ``prompt_logprobs``; what
they are the log of: specrt.sampling.controls).

On the device until the step's one device->host copy: each verified row's output token's
(``output_logprobs``, from the transform's distribution) and each prompt row's next prompt
token's, PROMPT_LOGPROB_ROWS rows at a time (``prompt_logprobs``, ``PromptRows``); packed into
that copy (``packed``) and read back as TokenLogprob records per request (``records``). A row's
top-N itself: ``row_logprobs`` / ``logprob_records`` (specrt.sampling.transform).

``vb`` is the step's VerifyBatch (specrt.step.verify, a layer above): these functions read its
fields ``logprob_rows``, ``row_params``, ``row_request``, ``row_offset``, ``params``,
``prompt_rows`` and ``logits_indices``.
"""
from __future__ import annotations

import torch

from specrt.sampling.controls import TokenLogprob
from specrt.sampling.transform import RowLogprobs, logprob_records, row_logprobs

PROMPT_LOGPROB_ROWS = 256   # prompt rows (prompt_logprobs) whose [rows, V] logits exist at once


class PromptRows:
    """The prompt rows of a step that scores prompts, as final-normed hidden states [P, H] and the
    target's LM head: their logits are made PROMPT_LOGPROB_ROWS rows at a time (an 8k-token prompt
    never has its [P, V] logits in memory). ``head_of(vb, target, hidden_layers)`` says whether a
    step can: it then runs the target with ``logits_indices`` = the verified rows and ``all_hidden``."""

    def __init__(self, hidden: torch.Tensor, head):
        self.hidden, self.head = hidden, head

    @staticmethod
    def final_columns(target, hidden_layers) -> slice | None:
        """Where the final-normed state sits in the forward's hidden: all of it (no
        ``hidden_layers``), its block of the fused layer features (an EAGLE-3 drafter's list names
        the final norm, index num_layers), or None (the features leave it out)."""
        if hidden_layers is None:
            return slice(None)
        cfg, layers = target.config, [int(i) for i in hidden_layers]
        if cfg.num_layers not in layers:
            return None
        j = layers.index(cfg.num_layers)
        return slice(j * cfg.hidden_size, (j + 1) * cfg.hidden_size)

    @classmethod
    def head_of(cls, vb, target, hidden_layers) -> torch.nn.Module | None:
        """The target's LM head if this step's prompt rows are to be scored from their hidden
        states, else None (no prompt rows; a target without one; fused layer features without the
        final-normed state: the prompt rows' logits then come from the forward)."""
        head = getattr(target, "lm_head", None)
        if not vb.prompt_rows or not isinstance(head, torch.nn.Module) or \
                cls.final_columns(target, hidden_layers) is None:
            return None
        return head

    @classmethod
    def take(cls, vb, every_hidden: torch.Tensor, head, columns: slice = slice(None)) -> "PromptRows":
        """From the forward's hidden of every fed row [T, H] (or [T, k * H] fused features, whose
        ``columns`` hold the final-normed state)."""
        return cls(every_hidden[:, columns].index_select(0, vb.logits_indices[len(vb.row_request):]), head)

    def logits(self, a: int, e: int) -> torch.Tensor:
        """[e - a, V] float32: the logits of prompt rows a..e-1."""
        return self.head(self.hidden[a:e]).float()


def output_logprobs(vb, logits, probs, tokens) -> RowLogprobs | None:
    """Of each logprob row's output token (specrt.sampling.controls: the log of the distribution it
    was drawn from; the log-softmax of the controlled logits for a greedy request). ``logits`` [R, V]
    the controlled rows, ``probs`` [R, V] the transform's (None: every request greedy), ``tokens``
    [B, K+1] the emitted ones."""
    if not vb.logprob_rows:
        return None
    dev = logits.device
    rows = torch.tensor(vb.logprob_rows, dtype=torch.int64).to(dev, non_blocking=True)
    params = [vb.row_params[j] for j in vb.logprob_rows]
    logp = torch.log_softmax(logits.index_select(0, rows), -1)                        # [L, V]
    if probs is not None:
        greedy = torch.tensor([p.greedy for p in params]).to(dev, non_blocking=True)
        logp = torch.where(greedy[:, None], logp, probs.index_select(0, rows).log())
    req = [vb.row_request[j] for j in vb.logprob_rows]
    col = [min(vb.row_offset[j], tokens.shape[1] - 1) for j in vb.logprob_rows]
    tok = tokens[torch.tensor(req).to(dev, non_blocking=True), torch.tensor(col).to(dev, non_blocking=True)]
    return row_logprobs(logp, tok.clamp(min=0), [p.logprobs for p in params])


def prompt_logprobs(vb, logits, prompt: PromptRows | None = None) -> RowLogprobs | None:
    """Of each prompt row's next prompt token, PROMPT_LOGPROB_ROWS rows at a time: only each row's
    top-N and its token's log-probability are kept, never a [P, V] log-softmax. The rows' logits
    are ``logits`` [P, V], or (``prompt``) made from their hidden states a chunk at a time too."""
    if not vb.prompt_rows:
        return None
    P = len(vb.prompt_rows)
    dev = prompt.hidden.device if prompt is not None else logits.device
    tok = torch.tensor([t for _, t in vb.prompt_rows], dtype=torch.int64).to(dev, non_blocking=True)
    top_n = [vb.params[b].prompt_logprobs for b, _ in vb.prompt_rows]
    n = max(top_n)                    # every chunk keeps the same N columns (rows report their own)
    parts = []
    for a in range(0, P, PROMPT_LOGPROB_ROWS):
        e = min(a + PROMPT_LOGPROB_ROWS, P)
        x = prompt.logits(a, e) if prompt is not None else logits[a:e]               # [<= chunk, V]
        parts.append(row_logprobs(torch.log_softmax(x, -1), tok[a:e], [n] * (e - a)))
    n = min(n, parts[0].top_logprob.shape[1])
    return RowLogprobs(torch.cat([p.token_logprob for p in parts]), torch.cat([p.top_logprob for p in parts]),
                       torch.cat([p.top_token for p in parts]), [min(k, n) for k in top_n])


def _flat(x: RowLogprobs | None) -> list[torch.Tensor]:
    if x is None:
        return []
    return [x.token_logprob.float().view(torch.int32).reshape(-1), x.top_logprob.float().view(torch.int32).reshape(-1),
            x.top_token.to(torch.int32).reshape(-1)]


def _unflat(host: torch.Tensor, at: int, x: RowLogprobs | None) -> tuple[int, tuple | None]:
    """The host lists of ``x`` packed by _flat from ``host[at:]``; returns (next offset, lists)."""
    if x is None:
        return at, None
    L, N = x.top_logprob.shape
    lp = host[at:at + L].view(torch.float32).tolist()
    top_lp = host[at + L:at + L + L * N].view(torch.float32).view(L, N).tolist()
    top_tok = host[at + L + L * N:at + L + 2 * L * N].view(L, N).tolist()
    return at + L + 2 * L * N, (lp, top_lp, top_tok, x.top_n)


def packed(out: RowLogprobs | None, prompt: RowLogprobs | None) -> list[torch.Tensor]:
    """Both as flat int32 tensors (float32 bits), to ride along the step's one device->host copy."""
    return _flat(out) + _flat(prompt)


def records(vb, host: torch.Tensor, out: RowLogprobs | None, prompt: RowLogprobs | None,
            output_token_ids: list[list[int]]) -> tuple[dict[int, list[TokenLogprob]],
                                                        dict[int, list[TokenLogprob | None]]]:
    """From ``host`` (the int32 host copy of ``packed(out, prompt)``) and the emitted tokens [B][K+1]:
    ({request b: its verified rows' records}, {request b: its prompt tokens' records, the first None})."""
    logprobs, prompt_logprobs = {}, {}
    at, lists = _unflat(host, 0, out)
    if lists is not None:
        out_tokens = [output_token_ids[vb.row_request[j]][vb.row_offset[j]] for j in vb.logprob_rows]
        for j, rec in zip(vb.logprob_rows, logprob_records(out_tokens, *lists)):
            logprobs.setdefault(vb.row_request[j], []).append(rec)
    _, lists = _unflat(host, at, prompt)
    if lists is not None:
        for (b, _), rec in zip(vb.prompt_rows, logprob_records([t for _, t in vb.prompt_rows], *lists)):
            prompt_logprobs.setdefault(b, [None]).append(rec)
    return logprobs, prompt_logprobs
