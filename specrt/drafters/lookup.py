"""Prompt lookup in front of a draft model (``draft="MODEL+ngram[:min[:max]]"``).

Before a model drafter runs its network, each request whose context ends with an n-gram that
occurred earlier in it takes the continuation of that occurrence as its drafts (at most its K),
and skips the draft forwards this step. The others draft with the model as usual. Copies of
earlier text (code edits, quoted passages, lists) are then drafted for free and often right,
where a small draft is weakest; the model covers the rest.

Exactness is unchanged: a lookup draft is a deterministic proposal, so its draft distribution
is one-hot (q = 1 at the proposed token), which rejection sampling verifies like any other.
The draft model's KV does not advance on a lookup step; its next proposal catches up over the
longer tail in its one catch-up forward.
"""
from __future__ import annotations

import torch

from specrt.drafters.ngram import NgramProposer, NgramState
from specrt.drafters.suffix import SuffixLookup, SuffixSettings
from specrt.sampling.controls import control_state

DEFAULT_MIN_N = 2   # a single-token match is a weak signal; the model drafts those steps
# the most requests a step may hold for the lookup to draft: past it every verify row costs nearly
# its share of a compute-bound forward, and the lookup's weak matches cost more than they save
LOOKUP_MAX_BATCH = 2


class PromptLookup:
    """Per-request n-gram proposals (each request's index lives in ``request.lookup_state``)."""

    name = "ngram"        # the lookup's part of its drafter's name ("model+ngram")

    def __init__(self, proposer: NgramProposer):
        self.proposer = proposer

    @classmethod
    def parse(cls, spec: str) -> "PromptLookup":
        """``"ngram"`` (n from 2 to 4) or ``"ngram:MIN[:MAX]"``; ValueError naming the argument."""
        name, *sizes = spec.split(":")
        if name != "ngram" or len(sizes) > 2:
            raise ValueError(f"draft: the lookup after '+' must be 'ngram[:min[:max]]', got {spec!r}")
        try:
            n = [int(s) for s in sizes]
        except ValueError:
            raise ValueError(f"draft: n-gram sizes must be integers, got {spec!r}") from None
        lo = n[0] if n else DEFAULT_MIN_N
        return cls(NgramProposer(lo, n[1] if len(n) > 1 else max(lo, 4)))

    def committed(self, request, row: int, proposal) -> None:
        """After a verify (suffix lookup counts what its drafts got accepted)."""

    def finished(self, request) -> None:
        """The request ended (suffix lookup indexes its output)."""

    def forget_outputs(self) -> None:
        """Drop earlier requests' outputs (suffix lookup's global index)."""

    def source_stats(self) -> dict | None:
        return None

    def propose(self, batch, ks: list[int], skip: list[bool]) -> dict[int, list[int]]:
        """{row: tokens} for the rows (not ``skip``, K > 0) whose context has a match; 1..K tokens
        (none for a batch of more than LOOKUP_MAX_BATCH requests)."""
        out = {}
        if len(batch) > LOOKUP_MAX_BATCH:
            return out
        for b, r in enumerate(batch):
            if skip[b] or ks[b] <= 0:
                continue
            if r.lookup_state is None:
                r.lookup_state = NgramState()
            prop = self.proposer.propose(r.token_ids, ks[b], r.lookup_state)
            if prop:
                out[b] = prop
        return out


class SuffixPromptLookup(PromptLookup):
    """Suffix drafting in front of a draft model (``draft="MODEL+suffix[:key=value,...]"``): each
    request's most probable suffix chain, when its history (or earlier outputs) matches."""

    name = "suffix"

    def __init__(self, spec: str, coupled: bool = False):
        self.suffix = SuffixLookup(SuffixSettings.parse(spec), coupled)

    def propose(self, batch, ks: list[int], skip: list[bool]) -> dict[int, list[int]]:
        out = {}
        big = len(batch) > LOOKUP_MAX_BATCH
        for b, r in enumerate(batch):      # (a big batch still indexes each request's new tokens)
            tree = self.suffix.tree(r, 0 if skip[b] or big else ks[b], "lookup_state")
            chain = [] if tree is None else tree.chain(ks[b])
            if chain:
                out[b] = chain
                r.lookup_state.source, r.lookup_state.depth = tree.source, len(chain)
        return out

    def committed(self, request, row: int, proposal) -> None:
        if row in proposal.lookup_rows:
            self.suffix.record(request, proposal.num_draft_tokens[row],
                               request.target_cached - request.context_len, "lookup_state")
        elif getattr(request.lookup_state, "source", None) is not None:
            request.lookup_state.source = None

    def finished(self, request) -> None:
        self.suffix.finished(request)

    def forget_outputs(self) -> None:
        self.suffix.forget_outputs()

    def source_stats(self) -> dict | None:
        return self.suffix.source_stats()


def forced_drafts(batch, ks: list[int], skip: list[bool]) -> dict[int, list[int]]:
    """{row: tokens} for structured-output rows (not ``skip``, K > 0) whose grammar forces the next
    tokens (a JSON key, a closing brace): up to K of them drafted with no forward. A forced token
    is not certain to be the target's (the mask may also allow a shorter token), so it is
    verified like any draft; usually it is accepted."""
    out = {}
    for b, r in enumerate(batch):
        if skip[b] or ks[b] <= 0 or r.params.structured is None:
            continue
        st = control_state(r)
        toks = st.grammar.forced(r.output_token_ids, ks[b]) if st is not None and st.grammar is not None else []
        if toks:
            out[b] = toks
    return out


def make_lookup(spec: str, coupled: bool = False) -> PromptLookup:
    """The lookup after '+' in ``draft="MODEL+..."``: "ngram[:min[:max]]" or "suffix[:key=value,...]".
    ``coupled``: the engine's acceptance is "coupled" (suffix lookup may then draft sampled rows
    from other requests' outputs)."""
    if spec.split(":", 1)[0] == "suffix":
        return SuffixPromptLookup(spec, coupled)
    return PromptLookup.parse(spec)


def fill_lookup_rows(found: dict[int, list[int]], draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
    """Write the lookup drafts into the proposal: ids [B, K] and, when the step samples, one-hot
    draft probabilities [B, K, V]."""
    if not found:
        return
    dev = draft_ids.device
    rows = torch.tensor([b for b, p in found.items() for _ in p], dtype=torch.int64)
    cols = torch.tensor([j for p in found.values() for j in range(len(p))], dtype=torch.int64)
    toks = torch.tensor([t for p in found.values() for t in p], dtype=torch.int64)
    rows, cols, toks = rows.to(dev), cols.to(dev), toks.to(dev)
    draft_ids[rows, cols] = toks.to(torch.int32)
    if draft_probs is not None:
        draft_probs[rows, cols] = 0.0
        draft_probs[rows, cols, toks] = 1.0
