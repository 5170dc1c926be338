"""The drafter interface and the records a drafter hands the engine.

A drafter proposes up to K tokens per request for the target to verify. The engine calls,
each step:

    drafter.fence()                                    # before the step's KV writes (CUDA overlap)
    limits   = drafter.limit(batch, caps)              # before planning: caps it can fill
    proposal = drafter.propose(batch, ks, limits, stop_rule, pre_length)
    next_ks  = drafter.reserve_pre_draft(batch, proposal, next_ks)   # overlap: slots, before the verify
    drafter.mark_verify()                              # overlap: the pre-draft waits for what came before
    pre      = drafter.pre_draft(batch, ks, proposal, next_ks, stop_rules)   # overlap (model, self:N)
    drafter.observe_target(batch, vb, hidden)          # only if wants_target_hidden: after the target forward
    held     = drafter.on_commit(request, row, proposal, pre, kept)  # per request, after verify

and never asks which kind it has. Draft tokens and draft probabilities are always over the
TARGET's vocabulary (a drafter with another vocabulary maps its rows before sampling), so the
verify kernels see one layout whatever drafted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from specrt.attention import KVWindow

# stop_rule(request, depth, draft_prob, p_accept) -> stop drafting this request before token #depth
StopRule = Callable[[object, int, float, "float | None"], bool]
# pre_length(request, k, pre_draft) -> how many of a kept pre-draft's tokens to propose (None: draft afresh)
PreLength = Callable[[object, int, "PreDraft"], "int | None"]


@dataclass(frozen=True)
class DraftSettings:
    """What every drafter needs to know about the engine it drafts for."""

    vocab_size: int               # the target's: draft rows are over it
    eos_token_ids: list[int]      # masked while a request is below its min_tokens
    coupled: bool                 # acceptance == "coupled": drafts sample with the target's own noise
    device: torch.device
    kv_window: KVWindow | None = None   # the draft attends to sinks + a recent window (None: everything)


@dataclass
class DraftCost:
    """What drafting cost this step (the cost model's draft sample)."""

    seconds: float = 0.0          # host time of the drafting phase
    forwards: int = 0             # draft forwards run (the depth the cost model sees)
    tokens_fed: int = 0           # tokens the draft consumed, catch-up included
    attended: int = 0             # sum over forwards of the rows' sequence lengths
    events: tuple | None = None   # CUDA: (start, end) timing events around the drafting

    def measured_seconds(self) -> float:
        """Host time, or on CUDA the device time when longer (the host only enqueues; the step's
        one sync has completed the events by the time this is read)."""
        if self.events is None:
            return self.seconds
        try:
            return max(self.seconds, self.events[0].elapsed_time(self.events[1]) / 1e3)
        except RuntimeError:
            return self.seconds


@dataclass
class DraftLimits:
    """What a drafter can propose this step, found before the policy plans."""

    caps: list[int]                                  # [B] most tokens each request can draft
    known: dict[Hashable, list[int]] = field(default_factory=dict)   # request id -> proposal already
                                                     # made to find its cap (n-gram); drafts are its prefixes
    seconds: float = 0.0                             # host time spent finding the caps (the n-gram
                                                     # search), paid on plain steps too
    chains: dict[Hashable, int] = field(default_factory=dict)   # request id -> length of a proposal that is
                                                     # one chain (verified causally: a tree step may let it
                                                     # run past the tree's node budget)


@dataclass
class DraftProposal:
    """One step's drafts."""

    draft_token_ids: torch.Tensor       # [B, K] int32 on the device, -1 padded (target vocabulary)
    num_draft_tokens: list[int]         # [B] host: tokens proposed (<= the K asked)
    draft_probs: torch.Tensor | None    # [B, K, V] float32 over the target's vocabulary; None: one-hot drafts
    draft_cached: list[int] | None      # [B] positions each request's draft KV holds now; None: no KV of its own
    cost: DraftCost = field(default_factory=DraftCost)
    pre_drafts_used: int = 0            # overlap pre-drafts this proposal consumed
    lookup_rows: frozenset[int] = frozenset()   # rows drafted by prompt lookup: their draft KV did not advance
    node_parents: list[list[int]] | None = None  # [B][n_b] host: each node's parent (-1: the pending token;
                                                 # specrt.drafters.tree); None: every request's drafts are a chain
    expected_accepted: list[float] | None = None  # [B] a tree's nodes the draft expects accepted (the sum
                                                  # of their path probabilities); None: not a model tree

    def parents(self, b: int) -> list[int]:
        """Request b's node parents (a chain's when the proposal has no tree)."""
        if self.node_parents is None:
            return list(range(-1, self.num_draft_tokens[b] - 1))
        return self.node_parents[b]

    @property
    def is_tree(self) -> bool:
        """Some request's nodes branch (else every proposal is a chain)."""
        return self.node_parents is not None and any(
            any(p != j - 1 for j, p in enumerate(ps)) for ps in self.node_parents)


@dataclass
class PreDraft:
    """Overlap: one request's next-round drafts, made while this round verified, assuming every
    draft of this round is accepted and the bonus token equals ``guess``. Kept only if that holds,
    and used only by the step right after (``context_len``)."""

    guess: torch.Tensor                 # [] int32 on the device: the assumed bonus token
    draft_token_ids: torch.Tensor       # [k] int32
    draft_probs: torch.Tensor | None    # [k, V] float32 or None
    num_tokens: int                     # k
    draft_cached: int                   # positions the draft KV holds if it is kept
    seconds: float                      # its share of the pre-drafting's host time
    context_len: int = 0                # the request's context length in the step it is for
    confidence: list[float] | None = None   # q(x) at each depth its stop rule looked at (None: no rule)
    p_accept: list[float | None] | None = None   # the acceptance head's estimate at those depths


def no_drafts(batch_size: int, device) -> DraftProposal:
    """The proposal of a step that drafts nothing."""
    return DraftProposal(torch.full((batch_size, 0), -1, dtype=torch.int32, device=device), [0] * batch_size,
                         None, None)


class Drafter:
    """Base class: proposes nothing beyond what subclasses add; every hook has a safe default."""

    name = "none"          # for display (server, metrics); the engine never branches on it
    caps_vary = False      # proposal lengths come and go every step: the policy must plan every step
    supports_pre_draft = False   # overlap: can draft the next round while this one verifies
    grows_trees = False          # propose_tree grows real trees (else it proposes a chain)
    default_draft_length: int | None = None   # max_draft_length when the SpecConfig does not name one
    reads_target_kv = False      # drafts from the target's own KV cache (self:N)
    draft_params = None          # research hook: the sampling parameters of draft rows (None: the request's)
    wants_target_hidden = False  # the target's verify forward returns every fed row's final-normed
                                 # hidden state, handed to observe_target (feature drafts); others pay nothing
    target_hidden_layers: tuple[int, ...] | None = None  # ... of these target layers, concatenated
                                                         # (LlamaForCausalLM.forward hidden_layers)

    def cache_configs(self) -> dict:
        """KV caches this drafter needs beside the target's: {name: ModelConfig}."""
        return {}

    def bind(self, kv) -> None:
        """The engine's PagedKVCache (built with ``cache_configs``); called again if it is rebuilt."""

    def size_bytes(self) -> int | None:
        """Bytes of weights one draft forward reads (None: no model), for the draft-size guard."""
        return None

    def limit(self, batch, caps: list[int]) -> DraftLimits:
        """Caps this step (at most the engine's caps)."""
        return DraftLimits(list(caps))

    def catchup(self, batch) -> list[int]:
        """Cost hint: tokens each request's draft must consume before it can draft (its KV lag)."""
        return [0] * len(batch)

    def step_model(self) -> tuple[torch.nn.Module, int | None] | None:
        """Cost hint: (the network one draft forward runs, how many of its layers; None: all),
        or None when drafting runs no network (n-gram). Benchmarks time a draft step with it."""
        return None

    def propose(self, batch, ks: list[int], limits: DraftLimits | None, stop_rule: StopRule | None,
                pre_length: PreLength | None = None) -> DraftProposal:
        raise NotImplementedError

    def propose_tree(self, batch, budgets: list[int], depths: list[int], shape) -> DraftProposal:
        """A token tree per request of at most ``budgets[b]`` nodes and ``depths[b]`` levels, grown
        to ``shape`` (specrt.drafters.tree.TreeShape). Default: a chain of min(budget, depth) tokens."""
        return self.propose(batch, [min(n, d) for n, d in zip(budgets, depths)],
                            self.limit(batch, [min(n, d) for n, d in zip(budgets, depths)]), None)

    def fence(self) -> None:
        """Before a step's first KV write: make it wait for a pre-draft still running (CUDA)."""

    def reserve_pre_draft(self, batch, proposal: DraftProposal, next_ks: list[int]) -> list[int]:
        """Overlap: reserve KV slots for pre-drafting ``next_ks`` tokens; returns what can be drafted."""
        return [0] * len(batch)

    def mark_verify(self) -> None:
        """Overlap: the verification is about to be enqueued."""

    def pre_draft(self, batch, ks: list[int], proposal: DraftProposal, next_ks: list[int],
                  stop_rules: list | None = None) -> dict[int, PreDraft]:
        """Overlap: {row: PreDraft} for rows with next_ks[row] > 0 it could pre-draft (default: none)."""
        return {}

    def observe_target(self, batch, vb, hidden: torch.Tensor) -> None:
        """Called right after the target's verify forward when ``wants_target_hidden``: ``hidden``
        [T, H] the final-normed state of every fed row (vb: the VerifyBatch; request b's fed rows
        start at row vb.query_start[b], position vb.query_position[b]). Rows past what the target
        accepts are not verified yet: on_commit tells (request.target_cached)."""

    def on_finish(self, request) -> None:
        """The request ended (any reason): what the drafter learns from it (suffix drafting)."""

    def forget_outputs(self) -> None:
        """Drop what earlier requests wrote from the drafter's history (suffix drafting's global
        index); what it learned about acceptance is kept."""

    def source_stats(self) -> dict | None:
        """Per draft source (suffix drafting: "request", "global"): lookups, matches, drafted,
        accepted; None when the drafter has one source."""
        return None

    def on_commit(self, request, row: int, proposal: DraftProposal, pre: PreDraft | None, kept: bool) -> int | None:
        """After verification (request.target_cached is updated): the positions this request's
        draft KV now holds, or None if the drafter has no KV of its own."""
        return None
