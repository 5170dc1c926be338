"""Pre-drafting (overlap): draft round N+1 while the target verifies round N, as an optional
capability (``PreDrafting``) of the drafters that can (a draft model, a reduced-vocabulary draft,
self:N; not a feature draft, whose next catch-up needs this round's verified features, nor the
lookups, whose proposals cost microseconds). The engine checks it once, when it is built
(specrt.step.overlap plans and runs it); every other module sees a drafter without it.

A pre-draft assumes every draft of this round is accepted and the bonus token equals the draft's
own guess; it is kept (``settle``) only if that holds, and then proposed by the very next step
(``ModelPreDrafting._take_earlier``: the first tokens are what drafting afresh would propose, the
same context, positions and noise), so it never changes the output.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from specrt.drafters.base import DraftProposal, DrafterState
from specrt.sampling.transform import batch_controls

# length(request, k, pre_draft) -> how many of a kept pre-draft's tokens to propose (None: draft afresh)
PreLength = Callable[[object, int, "PreDraft"], "int | None"]


@dataclass
class PreDraft(DrafterState):
    """One request's next-round drafts, made while this round verified, assuming every draft of
    this round is accepted and the bonus token equals ``guess``. Kept only if that holds, and used
    only by the step right after (``context_len``)."""

    guess: torch.Tensor                 # [] int32 on the device: the assumed bonus token
    draft_token_ids: torch.Tensor       # [k] int32
    draft_probs: torch.Tensor | None    # [k, V] float32 or None
    num_tokens: int                     # k
    draft_cached: int                   # positions the draft KV holds if it is kept
    seconds: float                      # its share of the pre-drafting's host time
    context_len: int = 0                # the request's context length in the step it is for
    confidence: list[float] | None = None   # q(x) at each depth its stop rule looked at (None: no rule)
    p_accept: list[float | None] | None = None   # the acceptance head's estimate at those depths
    length: PreLength | None = None     # the policy's rule for how many tokens the next step proposes
                                        # (None: all k it asks for, when it holds them)


class PreDrafting(ABC):
    """Capability: drafts the next round while this one verifies. Per step the engine (through
    specrt.step.overlap.Overlap) calls ``fence`` before its first KV write, ``reserve_pre_draft`` before
    the verification is enqueued, ``mark_verify`` right before it, ``pre_draft`` right after the
    verify forward was launched, and ``settle`` per request at the commit."""

    reads_target_kv = False   # the pre-draft reads the KV the verification writes (self:N): on CUDA it
                              # runs after the verification

    @abstractmethod
    def fence(self) -> None:
        """Before a step's first KV write: make it wait for a pre-draft still running (CUDA)."""

    @abstractmethod
    def reserve_pre_draft(self, batch, proposal: DraftProposal, ks: list[int]) -> list[int]:
        """KV slots for pre-drafting ``ks[b]`` tokens per request; returns what can be pre-drafted."""

    @abstractmethod
    def mark_verify(self) -> None:
        """The verification is about to be enqueued."""

    @abstractmethod
    def pre_draft(self, batch, proposal: DraftProposal, ks: list[int], stop_rules: list | None = None,
                  length: PreLength | None = None) -> dict[int, PreDraft]:
        """{row: PreDraft} for the rows with ks[row] > 0 it could pre-draft."""

    @abstractmethod
    def settle(self, request, pre: PreDraft, kept: bool, held: int | None) -> int | None:
        """At the commit of a request that got ``pre`` (``kept``: its premise held): the positions
        its draft KV holds now (``held``: what on_commit said without the pre-draft)."""


class ModelPreDrafting(PreDrafting):
    """PreDrafting for a draft network (specrt.drafters.model.ModelDrafterBase, which it is mixed
    into): the pre-draft runs on the draft stream; a kept one waits in ``request.drafter_state``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._verify_event = None     # recorded by mark_verify: the pre-draft waits for it, not the verification

    def fence(self) -> None:
        if self._stream is not None:   # the main stream's next KV writes wait for a running pre-draft
            torch.cuda.current_stream(self.settings.device).wait_stream(self._stream)

    def _take_earlier(self, batch, ks: list[int], skip) -> dict[int, tuple]:
        """Every request's kept pre-draft, forgotten (it is for the very next step only); returns
        {row: (n, draft_token_ids [n], draft_probs [n, V] or None)} for the rows not in ``skip``
        that propose n of its tokens."""
        out = {}
        for b, r in enumerate(batch):
            pre, r.drafter_state = r.drafter_state, None
            n = None if b in skip else _usable(r, pre, ks[b])
            if n is not None:
                out[b] = (n, pre.draft_token_ids[:n], None if pre.draft_probs is None else pre.draft_probs[:n])
        return out

    def settle(self, request, pre: PreDraft, kept: bool, held: int | None) -> int | None:
        if kept:                       # the assumption held: the next step drafts from the pre-draft
            request.drafter_state = pre
        if held is None:               # no KV of its own (self:N: a kept pre-draft holds no KV)
            return None
        # a pending pre-draft's positions stay valid; otherwise only what the target accepted
        return pre.draft_cached if kept else min(pre.draft_cached, request.target_cached)

    def reserve_pre_draft(self, batch, proposal: DraftProposal, ks: list[int]) -> list[int]:
        """KV slots for the next round's pre-drafts, taken before the verification is enqueued (a
        copy-on-write copy they cause then precedes it); 0 for rows that got none."""
        kv, n_of = self.kv, proposal.num_draft_tokens
        out = []
        for b, r in enumerate(batch):
            k = 0 if b in proposal.lookup_rows else ks[b]   # a lookup row's draft KV did not advance
            need = r.context_len + n_of[b] + k - kv.num_tokens(r.request_id)
            ok = k > 0 and kv.append_slots(r.request_id, max(need, 0))
            out.append(k if ok else 0)
        return out

    def mark_verify(self) -> None:
        if self._stream is not None:   # what the pre-draft waits for: everything before the verification
            self._verify_event = torch.cuda.Event()
            self._verify_event.record()

    def pre_draft(self, batch, proposal: DraftProposal, ks: list[int], stop_rules: list | None = None,
                  length: PreLength | None = None) -> dict[int, PreDraft]:
        """While the target verifies this round, draft the next one (``ks[b]`` tokens) assuming every
        draft is accepted and the bonus token equals the draft's own guess. Enqueued on the draft stream
        after what preceded the verification (a drafter reading the target's KV: after the
        verification), so on CUDA it runs concurrently. ``stop_rules[b](depth, q(x), p_accept)``:
        the policy's prediction of where the next step stops drafting (each answer a host sync);
        ``length``: the policy's rule the next step applies to a kept pre-draft (PreDraft.length)."""
        rows = [b for b in range(len(batch)) if ks[b] > 0]
        if not rows:
            return {}
        t0 = time.perf_counter()
        main = torch.cuda.current_stream(self.settings.device) if self._stream is not None else None
        with self._on_stream(after=None if self.reads_target_kv else self._verify_event):
            # the logit controls' history each pre-drafted token assumes (None: no request has controls)
            assumed = _AssumedHistory.make(batch, proposal, rows, max(ks[b] for b in rows), self.settings.device)
            guess, base = self._pre_guess(batch, rows, proposal, main, assumed)
            out = self._pre_steps(batch, rows, [ks[b] for b in rows], guess, base,
                                  [stop_rules[b] if stop_rules else None for b in rows], assumed)
        seconds = (time.perf_counter() - t0) / len(rows)
        return {b: PreDraft(guess[i], out.ids[i, :out.n[i]], None if out.probs is None else out.probs[i, :out.n[i]],
                            out.n[i], out.held[i], seconds, base[i] + 1, out.conf[i], out.p_acc[i], length)
                for i, b in enumerate(rows)}

    def _pre_guess(self, batch, rows: list[int], proposal: DraftProposal, main, assumed: "_AssumedHistory | None"):
        """Feed each row's last draft x_n; guess the bonus token at position L + n. Returns (guess
        [rows] int32, the bonus positions). The main stream waits for the guesses (the step's
        device->host copy reads them), not for the rest of the pre-draft."""
        dev, n_of = self.settings.device, proposal.num_draft_tokens
        reqs = [batch[b] for b in rows]
        width = proposal.draft_token_ids.shape[1]
        last = torch.tensor([b * width + n_of[b] - 1 for b in rows], dtype=torch.int64).to(dev, non_blocking=True)
        feed = proposal.draft_token_ids.view(-1).index_select(0, last).long()
        base = [r.context_len + n_of[b] for b, r in zip(rows, reqs)]   # position of the bonus
        # a drafter on the target's KV does not rewrite x_n's slot: the verification wrote the target's own
        q, _, _ = self._forward(reqs, feed, base, [1] * len(rows), [r.num_generated + n_of[b] for b, r in zip(rows, reqs)],
                                history=assumed.at(list(range(len(rows))), 0) if assumed else None,
                                write=not self.reads_target_kv)
        if self.settings.coupled:
            guess = self._sample(q, reqs, base)        # the target's own race noise: likely the bonus
        else:
            guess = q.argmax(-1).to(torch.int32)       # the draft's most likely bonus
        if assumed:
            assumed.append(None, 0, guess)
        if main is not None:          # the main stream reads the guesses: it waits for them alone
            ready = torch.cuda.Event()
            ready.record(self._stream)
            main.wait_event(ready)
            guess.record_stream(main)
        return guess, base

    def _pre_steps(self, batch, rows: list[int], ks: list[int], guess, base: list[int], rules: list,
                   assumed: "_AssumedHistory | None"):
        """The pre-draft's drafting loop from the guessed bonus; rows with a stop rule stop where
        it says (the token it stops at is not proposed)."""
        dev, V = self.settings.device, self.settings.vocab_size
        reqs = [batch[b] for b in rows]
        R, K = len(rows), max(ks)
        need_probs = not self.settings.coupled and any(not r.params.greedy for r in reqs)
        out = _PreOut(torch.full((R, K), -1, dtype=torch.int32, device=dev),
                      torch.zeros(R, K, V, device=dev) if need_probs else None, list(ks),
                      [base[i] + ks[i] for i in range(R)],
                      [[] if rules[i] else None for i in range(R)],
                      [[] if rules[i] and self.accept_head is not None else None for i in range(R)])
        feed = guess.long()
        active = list(range(R))
        for j in range(K):
            active = [i for i in active if j < out.n[i]]
            if not active:
                break
            sel = torch.tensor(active, dtype=torch.int64).to(dev, non_blocking=True)
            sub = [reqs[i] for i in active]
            seq = [base[i] + 1 + j for i in active]
            q, logits, hidden = self._forward(sub, feed.index_select(0, sel), seq, [1] * len(active),
                                              [reqs[i].num_generated + (base[i] - reqs[i].context_len) + 1 + j
                                               for i in active],
                                              history=assumed.at(active, 1 + j) if assumed else None)
            y = self._sample(q, sub, seq)
            if assumed:
                assumed.append(sel, 1 + j, y)
            out.ids[sel, j] = y
            if out.probs is not None:
                out.probs[sel, j] = q
            ruled = [a for a, i in enumerate(active) if rules[i] is not None]
            if ruled:
                for a, stop in self._pre_stops(ruled, [active[a] for a in ruled], rules, out, j, logits, hidden, y):
                    if stop:
                        i = active[a]
                        out.n[i], out.held[i] = j, base[i] + 1 + j
            feed = torch.zeros(R, dtype=torch.int64, device=dev)
            feed[sel] = y.long()
        return out

    def _pre_stops(self, ruled: list[int], idx: list[int], rules, out: "_PreOut", depth: int, logits, hidden, y):
        """(position in the active rows, stop?) for rows with a stop rule at ``depth``; records the
        values the next step replays (one host sync, as drafting with such a policy does)."""
        sel = torch.tensor(ruled, dtype=torch.int64).to(logits.device, non_blocking=True)
        lg = logits.index_select(0, sel)
        qx = torch.softmax(lg, -1).gather(1, y.index_select(0, sel).long()[:, None])[:, 0]
        p_acc = None
        if self.accept_head is not None:
            p_acc = self.accept_head(hidden.index_select(0, sel).float(), qx).float().cpu().tolist()
        qx = qx.cpu().tolist()
        res = []
        for t, (a, i) in enumerate(zip(ruled, idx)):
            pa = None if p_acc is None else p_acc[t]
            out.conf[i].append(qx[t])
            if out.p_acc[i] is not None:
                out.p_acc[i].append(pa)
            res.append((a, rules[i](depth, qx[t], pa)))
        return res

def _usable(r, pre, k: int) -> int | None:
    """How many of a kept pre-draft's tokens request r proposes this step (its first n are what
    drafting afresh would propose: the same context, positions and noise), or None: draft afresh."""
    if not isinstance(pre, PreDraft) or pre.context_len != r.context_len:
        return None                # not a pre-draft for this very step
    if pre.length is not None:
        return pre.length(r, k, pre)
    return k if k <= pre.num_tokens else None


class _PreOut:
    """The pre-draft loop's results per pre-drafted row."""

    def __init__(self, ids, probs, n, held, conf, p_acc):
        self.ids = ids          # [R, K] int32 drafted tokens (-1 padded)
        self.probs = probs      # [R, K, V] float32 or None
        self.n = n              # [R] tokens proposed (cut where a stop rule stopped)
        self.held = held        # [R] positions the draft KV holds if the pre-draft is kept
        self.conf = conf        # [R] q(x) per depth evaluated, or None (no stop rule)
        self.p_acc = p_acc      # [R] the acceptance head's estimate per depth, or None

class _AssumedHistory:
    """Overlap: the history a pre-draft assumes for the logit controls, per request b of the batch:
    this round's drafts [:n_b], then the guessed bonus token, then the pre-drafts so far."""

    def __init__(self, ctl, tokens: torch.Tensor, rows: list[int], start: torch.Tensor, n_of: list[int]):
        self.ctl = ctl
        self.tokens = tokens      # [B, W + 1 + K] int32, -1 padded (W: this round's width, K: the longest pre-draft)
        self.rows = rows          # pre-drafted rows of the batch
        self.start = start        # [len(rows)] int64: where each row's guess goes (n_b)
        self.n_of = n_of          # [B] this round's draft counts

    @staticmethod
    def make(batch, proposal: DraftProposal, rows: list[int], K: int, dev) -> "_AssumedHistory | None":
        ctl = batch_controls(batch, dev)
        if ctl is None:
            return None
        width = proposal.draft_token_ids.shape[1]
        tokens = torch.full((len(batch), width + 1 + K), -1, dtype=torch.int32, device=dev)
        tokens[:, :width] = proposal.draft_token_ids
        n_of = proposal.num_draft_tokens
        start = torch.tensor([n_of[b] for b in rows], dtype=torch.int64).to(dev, non_blocking=True)
        return _AssumedHistory(ctl, tokens, rows, start, n_of)

    def at(self, active: list[int], step: int) -> tuple:
        """apply_controls' history for the active pre-draft rows producing token n_b + step."""
        return self.ctl, [self.rows[i] for i in active], [self.n_of[self.rows[i]] + step for i in active], self.tokens

    def append(self, sel: torch.Tensor | None, step: int, tokens: torch.Tensor) -> None:
        """Record the tokens [len(sel)] the selected rows (None: all) produced at n_b + step."""
        rows = torch.tensor(self.rows, dtype=torch.int64).to(self.tokens.device, non_blocking=True)
        start = self.start
        if sel is not None:
            rows, start = rows.index_select(0, sel), start.index_select(0, sel)
        self.tokens[rows, start + step] = tokens.to(torch.int32)
