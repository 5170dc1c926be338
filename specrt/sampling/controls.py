"""The logit controls of one request, on the host (no tensors): what its history holds for the
penalties, its bans, and the log-probability records a request returns.

The sampling transform of every row, draft and target alike (specrt.sampling.transform applies it):

    1. apply_penalties (one op for all rows): x + logit_bias; repetition_penalty on every token
       of the prompt or generated so far; frequency / presence penalty on every token generated
       so far (count times / once). "So far" = before that row's position: the prompt, the
       request's output, and the draft tokens earlier in the same step, so position i of a verify
       (or draft step i) sees exactly the history an autoregressive step would.
    2. masks (-inf): allowed_token_ids keeps only those; bad_words_ids bans a one-token sequence
       always and a longer one's last token when the history (prompt + output + earlier drafts)
       ends with its other tokens (transformers' NoBadWordsLogitsProcessor); min_tokens bans EOS.
       The longer ones are looked up in a BanTrie: a row's cost is bounded by the longest banned
       sequence, whatever the number of sequences. structured: every token the grammar's matcher,
       moved over the drafts before the row, refuses (specrt.structured; EOS only where it may end).
    3. probs_from_logits: temperature, top-k, min-p, top-p (temperature 0: argmax).

Histories: repetition_penalty counts the prompt and the output (as transformers and vLLM do);
presence / frequency count the output only (as OpenAI and vLLM do).

Log-probabilities (``SamplingParams.logprobs``): of the distribution each token was drawn from,
i.e. the log of step 3's output (-inf for a token that top-k / top-p / min-p removed); for a
greedy request (temperature 0: a one-hot distribution), the log-softmax of the step-2 logits
(temperature 1). Prompt log-probabilities (``prompt_logprobs``) are the model's own log-softmax
(no control applies to the prompt); the first prompt token has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.config import SamplingParams
from specrt.structured import Grammar, GrammarState


@dataclass
class TokenLogprob:
    """A token's log-probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, log-probability), most likely first; SamplingParams.logprobs long


@dataclass
class PenaltyEntries:
    """One request's apply_penalties entries (csrc/penalties_ops.h): its tokens, sorted."""

    token: np.ndarray       # [E] int32, strictly increasing
    count: np.ndarray       # [E] int32: times generated so far
    in_prompt: np.ndarray   # [E] bool
    bias: np.ndarray        # [E] float32: logit_bias


class BanTrie:
    """The multi-token banned sequences of one request, for the rule "ban the last token of a
    sequence when the history ends with its other tokens": a trie of the sequences' prefixes read
    backwards (last prefix token first), each node holding the last tokens of the sequences whose
    prefix it completes. ``banned_after(history)`` walks the history from its end: at most
    ``depth`` (the longest prefix) dictionary look-ups, whatever the number of sequences."""

    __slots__ = ("_next", "_bans", "depth")

    def __init__(self, words):
        children: list[dict[int, int]] = [{}]      # node -> {token: child node}; node 0 = the root
        bans: dict[int, set[int]] = {}              # node -> last tokens banned after its prefix
        depth = 0
        for w in words:
            node = 0
            for t in reversed(w[:-1]):
                nxt = children[node].get(t)
                if nxt is None:
                    nxt = children[node][t] = len(children)
                    children.append({})
                node = nxt
            bans.setdefault(node, set()).add(w[-1])
            depth = max(depth, len(w) - 1)
        self._next = children
        self._bans: list[np.ndarray | None] = [None] * len(children)
        for node, toks in bans.items():
            self._bans[node] = np.asarray(sorted(toks), dtype=np.int64)
        self.depth = depth

    def banned_after(self, history) -> np.ndarray:
        """The tokens [n] int64 (a token may repeat, banned by several sequences) that may not
        follow ``history`` (a token list: only its last ``depth`` tokens are read)."""
        nxt, bans, found, node = self._next, self._bans, [], 0
        for t in reversed(history[-self.depth:]):
            node = nxt[node].get(t)
            if node is None:
                break
            if bans[node] is not None:
                found.append(bans[node])
        if not found:
            return _NO_TOKENS
        return found[0] if len(found) == 1 else np.concatenate(found)


_NO_TOKENS = np.zeros(0, np.int64)


class ControlState:
    """A request's history for its controls (``Request.controls_state``): the prompt's tokens and
    the output's token counts, caught up with the output lazily (so nothing else has to tell it
    when tokens are appended, preempted or restored)."""

    __slots__ = ("params", "prompt_tokens", "counts", "seen", "_entries", "_entries_at", "single_bans",
                 "sequence_bans", "allowed", "grammar")

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], grammar: Grammar | None = None,
                 max_output: int | None = None):
        self.params = params
        self.prompt_tokens = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))   # sorted, distinct
        self.counts: dict[int, int] = {}
        self.seen = 0                  # output tokens folded into counts
        self._entries: PenaltyEntries | None = None
        self._entries_at = -1          # output length the cached entries describe
        words = params.bad_words_ids or []
        self.single_bans = np.asarray(sorted({w[0] for w in words if len(w) == 1}), dtype=np.int64)
        longer = [w for w in words if len(w) > 1]
        self.sequence_bans = BanTrie(longer) if longer else None    # the multi-token ones
        self.allowed = None if params.allowed_token_ids is None else np.asarray(params.allowed_token_ids, np.int64)
        if params.structured is not None and grammar is None:
            raise ValueError("structured: the request's grammar was not compiled (requests are queued through "
                             "LLMEngine.add_request, which compiles it)")
        # the output's matcher; closing within the output's limit (max_tokens, or the context's end if sooner)
        limit = min(params.max_tokens, max_output if max_output is not None else params.max_tokens)
        self.grammar = GrammarState(grammar, limit=limit if params.structured_close else None) \
            if params.structured is not None else None

    def catch_up(self, output_token_ids: list[int]) -> None:
        if len(output_token_ids) < self.seen:      # cannot happen today; recount rather than guess
            self.counts, self.seen = {}, 0
        for t in output_token_ids[self.seen:]:
            self.counts[t] = self.counts.get(t, 0) + 1
        self.seen = len(output_token_ids)

    def entries(self, output_token_ids: list[int]) -> PenaltyEntries:
        """The entries for the history prompt + output (cached until the output grows)."""
        if self._entries is None or self._entries_at != len(output_token_ids):
            self.catch_up(output_token_ids)
            self._entries, self._entries_at = self._build(), len(output_token_ids)
        return self._entries

    def _build(self) -> PenaltyEntries:
        p = self.params
        parts = []
        if p.repetition_penalty != 1.0:
            parts.append(self.prompt_tokens)
        uses_output = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        out_tok = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts)) if uses_output else \
            np.zeros(0, np.int64)
        parts.append(out_tok)
        bias = p.logit_bias or {}
        bias_tok = np.fromiter(bias, dtype=np.int64, count=len(bias))
        parts.append(bias_tok)
        token = np.unique(np.concatenate(parts))
        count = np.zeros(token.size, np.int32)
        if out_tok.size:
            count[np.searchsorted(token, out_tok)] = np.fromiter(self.counts.values(), np.int32, len(self.counts))
        in_prompt = np.zeros(token.size, bool)
        if p.repetition_penalty != 1.0:
            in_prompt[np.searchsorted(token, self.prompt_tokens)] = True
        values = np.zeros(token.size, np.float32)
        if bias:
            values[np.searchsorted(token, bias_tok)] = np.fromiter(bias.values(), np.float32, len(bias))
        return PenaltyEntries(token.astype(np.int32), count, in_prompt, values)


def control_state(r) -> ControlState | None:
    """The request's ControlState (made on first use), or None if it uses no logit control."""
    if not r.params.has_logit_controls:
        return None
    if r.controls_state is None:
        r.controls_state = ControlState(r.params, r.prompt_token_ids, getattr(r, "grammar", None),
                                        getattr(r, "max_output", None))
    return r.controls_state
