"""The drafter interface and the records a drafter hands the engine.

A drafter proposes up to k tokens per request for the target to verify. The engine calls,
each step:

    limits   = drafter.limit(batch, max_ks)            # before planning: what it can fill, its KV lag
    proposal = drafter.propose(batch, DraftAsk(ks, limits, stop_rule))   # a chain per request, or
                                                       # DraftAsk(depths, tree=shape, nodes=budgets): trees
    held     = drafter.on_commit(request, row, proposal)   # per request, after verification

plus ``cache_configs`` / ``bind`` (its KV caches) and ``size_bytes`` / ``step_model`` (cost
hints), and never asks which kind it has. What only some drafters do is an optional capability,
a class they also derive from, checked with isinstance once when the engine is built:
``ReadsTarget`` (the verify forward's hidden states: feature drafts), ``History`` (what finished
requests leave behind: suffix drafting, a lookup in front of a model) and
``specrt.drafters.predraft.PreDrafting`` (drafting the next step while this one verifies).

Draft tokens and draft probabilities are always over the TARGET's vocabulary (a drafter with
another vocabulary maps its rows before sampling), so the verify kernels see one layout whatever
drafted. Adding a drafter: a module with its class and one ``register_drafter`` line
(specrt.drafters.spec; the built-in ones are registered in specrt.drafters.factory).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from specrt.models.attention import KVWindow

# stop_rule(request, depth, draft_prob, p_accept) -> stop drafting this request before token #depth
StopRule = Callable[[object, int, float, "float | None"], bool]


class DrafterState:
    """Base of what a drafter keeps per request (``request.drafter_state``): each drafter module
    defines its own record (an n-gram index, a suffix tree, the target's features, ...)."""

    __slots__ = ()


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

    max_ks: list[int]                                # [B] most tokens each request can draft
    known: dict[Hashable, list[int]] = field(default_factory=dict)   # request id -> proposal already
                                                     # made to find its max_k (n-gram); drafts are its prefixes
    seconds: float = 0.0                             # host time spent finding max_ks (the n-gram
                                                     # search), paid on plain steps too
    chains: dict[Hashable, int] = field(default_factory=dict)   # request id -> length of a proposal that is
                                                     # one chain (verified causally: a tree step may let it
                                                     # run past the tree's node budget)
    catchup: list[int] | None = None                 # [B] cost hint: tokens each request's draft must consume
                                                     # before it can draft (its KV lag); None: no lag


@dataclass
class DraftAsk:
    """What the engine asks ``propose`` for: a chain of up to ``ks[b]`` tokens per request, or,
    with ``tree``, a token tree per request of at most ``nodes[b]`` nodes and ``ks[b]`` levels
    (a chain is the tree whose nodes have one child; only drafters with ``grows_trees`` get trees)."""

    ks: list[int]                            # [B] tokens per request (a tree: its depth); 0: none
    limits: DraftLimits | None = None        # what ``limit`` found this step (None: not asked)
    stop_rule: StopRule | None = None        # the policy's early stop per draft token (None: draft all k)
    tree: TreeShape | None = None            # how trees grow; None: chains (specrt.drafters.tree.TreeShape,
                                             # an annotation only: that module imports this one)
    nodes: list[int] | None = None           # [B] a tree's node budget per request (with ``tree``)


@dataclass
class DraftProposal:
    """One step's drafts."""

    draft_token_ids: torch.Tensor       # [B, K] int32 on the device, -1 padded (target vocabulary)
    num_draft_tokens: list[int]         # [B] host: tokens proposed (<= the K asked)
    draft_probs: torch.Tensor | None    # [B, K, V] float32 over the target's vocabulary; None: one-hot drafts
    draft_cached: list[int] | None      # [B] positions each request's draft KV holds now; None: no KV of its own
    cost: DraftCost = field(default_factory=DraftCost)
    reused: int = 0                     # requests whose drafts were made in an earlier step (a kept
                                        # pre-draft: specrt.drafters.predraft)
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


def no_drafts(batch_size: int, device) -> DraftProposal:
    """The proposal of a step that drafts nothing."""
    return DraftProposal(torch.full((batch_size, 0), -1, dtype=torch.int32, device=device), [0] * batch_size,
                         None, None)


class Drafter:
    """Base class: proposes nothing beyond what subclasses add; every hook has a safe default."""

    name = "none"          # for display (server, metrics); the engine never branches on it
    limits_vary = False    # proposal lengths come and go every step: the policy must plan every step
    grows_trees = False    # ``propose`` grows real trees when asked (else the engine asks for chains)
    default_max_draft_length: int | None = None   # max_draft_length when the SpecConfig does not name one
    draft_params = None    # research hook: the sampling parameters of draft rows (None: the request's)

    def cache_configs(self) -> dict:
        """KV caches this drafter needs beside the target's: {name: ModelConfig}."""
        return {}

    def bind(self, kv) -> None:
        """The engine's PagedKVCache (built with ``cache_configs``); called again if it is rebuilt."""

    def size_bytes(self) -> int | None:
        """Bytes of weights one draft forward reads (None: no model), for the draft-size guard."""
        return None

    def step_model(self) -> tuple[torch.nn.Module, int | None] | None:
        """Cost hint: (the network one draft forward runs, how many of its layers; None: all),
        or None when drafting runs no network (n-gram). Benchmarks time a draft step with it."""
        return None

    def limit(self, batch, max_ks: list[int]) -> DraftLimits:
        """The most tokens each request can draft this step (at most the engine's ``max_ks``) and
        the draft's KV lag (``catchup``)."""
        return DraftLimits(list(max_ks))

    def propose(self, batch, ask: DraftAsk) -> DraftProposal:
        """This step's drafts (``ask``: chains or trees, module docstring)."""
        raise NotImplementedError

    def on_commit(self, request, row: int, proposal: DraftProposal) -> int | None:
        """After verification (request.target_cached is updated): the positions this request's
        draft KV now holds, or None if the drafter has no KV of its own."""
        return None


class ReadsTarget(ABC):
    """Capability: the target's verify forward returns every fed row's final-normed hidden state
    (or, with ``target_hidden_layers``, these layers' states concatenated:
    LlamaForCausalLM.forward hidden_layers) and hands it to ``observe_target`` (feature drafts);
    an engine whose drafter lacks it pays nothing for them."""

    target_hidden_layers: tuple[int, ...] | None = None

    @abstractmethod
    def observe_target(self, batch, vb, hidden: torch.Tensor) -> None:
        """Called right after the target's verify forward: ``hidden`` [T, H] the state of every fed
        row (vb: the VerifyBatch; request b's fed rows start at row vb.query_start[b], position
        vb.query_position[b]). Rows past what the target accepts are not verified yet: on_commit
        tells (request.target_cached)."""


class History(ABC):
    """Capability: the drafter learns from finished requests (suffix drafting, a lookup in front
    of a model) and can forget what it learned."""

    @abstractmethod
    def on_finish(self, request) -> None:
        """The request ended (any reason): what the drafter learns from it."""

    @abstractmethod
    def forget_outputs(self) -> None:
        """Drop what earlier requests wrote from the drafter's history (suffix drafting's global
        index); what it learned about acceptance is kept."""

    @abstractmethod
    def source_stats(self) -> dict | None:
        """Per draft source (suffix drafting: "request", "global"): lookups, matches, drafted,
        accepted; None when the drafter has one source."""
