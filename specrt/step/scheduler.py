"""Continuous batching: per-request state, admission, KV reservation, preemption.

Holds no tensors: it books KV blocks through the engine's PagedKVCache.

Each step the engine asks for a batch: running requests first (oldest first),
then waiting requests admitted while there is room in the batch and the KV
cache can hold their prompt. When the cache runs short mid-run a request first
drafts nothing that step; if that is not enough the newest running request is
preempted (its blocks freed, its state reset to "nothing cached") and requeued
at the front; it later recomputes its context.

What that reproduces (tests/test_engine.py::test_what_preemption_reproduces):
the output distribution never changes. Greedy requests and acceptance="coupled"
emit exactly the tokens they would have emitted alone (both equal autoregressive
decoding with the same seed, whatever was drafted). Under acceptance="rejection"
a seeded request's tokens depend on how many tokens were drafted at each step, so
a request squeezed by the cache (drafts dropped, or preempted and recomputed) may
emit different tokens than alone: another sample from the same distribution.

What the prefix cache changes: not the draft lengths. The first step after a request's
admission (``Request.just_admitted``) never drafts, whether it computes the prompt or finds
all but its last token cached, so a seeded request's tokens under acceptance="rejection"
are the same cold and warm (tests/test_hostile_seeded_cache.py; a row computed alone rather
than within the prompt's forward may differ in ulps, as in plain decoding).
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, NamedTuple, Union

from specrt.config import SamplingParams
from specrt.observability.metrics import RequestStats
from specrt.policy import RequestPolicyState
from specrt.sampling.controls import ControlState, TokenLogprob
from specrt.structured import Grammar

if TYPE_CHECKING:   # the drafters' per-request records (annotations only: no import of the drafters at run time)
    from specrt.drafters.base import DrafterState
    from specrt.drafters.ngram import NgramState
    from specrt.drafters.suffix import SuffixState

# what a lookup in front of a model keeps: an n-gram or suffix index (a drafter's own record:
# a DrafterState, defined by its module)
LookupState = Union["NgramState", "SuffixState"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """A request's state as the caller sees it after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    new_token_ids: list[int] = field(default_factory=list)   # streaming: tokens added by the last step
    new_text: str = ""
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None          # per generated token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # per prompt token, the first None


@dataclass(eq=False)      # compared by identity: deque.remove / `in` must not compare every field
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                         # the request's Philox key (drawn at admission when unseeded)
    prompt: str | None = None
    tag: str = "default"
    tenant: str | None = None         # whose history suffix drafting may read (SuffixSettings.scoped)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    target_cached: int = 0            # positions whose target KV is written (and valid)
    draft_cached: int = 0             # positions whose draft-model KV is written (and valid)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str = ""
    num_preemptions: int = 0
    waited_steps: int = 0             # steps it has been waiting (admission by acceptance bounds it)
    just_admitted: bool = False       # its first step since (re)admission has not committed yet: it drafts
                                      # nothing, whatever the prefix cache held (LLMEngine._k_cap)
    stats: RequestStats = field(default_factory=RequestStats)
    # acceptance history (1 = accepted, 0 = rejected) of the last drafted positions, for policies
    accept_history: deque = field(default_factory=lambda: deque(maxlen=64))
    policy_state: RequestPolicyState = field(default_factory=RequestPolicyState)
    drafter_state: DrafterState | None = None   # the drafter's own record for this request
    lookup_state: LookupState | None = None     # a model drafter's prompt-lookup index (draft="MODEL+ngram")
    evidence_class: int | None = None     # what the drafter's current proposal rests on (n-gram: the
                                          # matched suffix length); the budget policy pools acceptance by it
    controls_state: ControlState | None = None  # history for penalties and bans (specrt.sampling.controls.control_state)
    grammar: Grammar | None = None        # the compiled grammar of params.structured (at intake)
    max_output: int | None = None         # output tokens the context leaves room for (at intake; None: no bound)
    output_logprobs: list[TokenLogprob] | None = None         # [num_generated] when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [len(prompt)] once computed (prompt_logprobs)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def context_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def output(self, prev_tokens: int, prev_text: int) -> RequestOutput:
        """Its output, with what was added since it had ``prev_tokens`` tokens and ``prev_text`` chars."""
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids), text=self.text,
                             token_ids=list(self.output_token_ids), finished=self.finished,
                             finish_reason=self.finish_reason, metrics=self.stats.summary(),
                             new_token_ids=list(self.output_token_ids[prev_tokens:]),
                             new_text=self.text[prev_text:], error=self.error,
                             logprobs=None if self.output_logprobs is None else list(self.output_logprobs),
                             prompt_logprobs=self.prompt_logprobs)

    def append_tokens(self, emitted: list[int], eos_token_ids: list[int], max_model_len: int, decode,
                      logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Append this step's tokens (and their ``logprobs``) up to the first stop; returns the finish
        reason ("stop", "length") or None. ``decode(token_ids) -> str`` renders the text (cut before
        a stop string)."""
        p, reason = self.params, None
        for j, t in enumerate(emitted):
            self.output_token_ids.append(t)
            if logprobs is not None:
                if self.output_logprobs is None:
                    self.output_logprobs = []
                self.output_logprobs.append(logprobs[j])
            if t in eos_token_ids and not p.ignore_eos and self.num_generated >= p.min_tokens:
                reason = "stop"
                break
            if self.num_generated >= p.max_tokens or self.context_len >= max_model_len:
                reason = "length"
                break
        self.text = decode(self.output_token_ids)
        if p.stop and reason is None:
            for s in p.stop:
                i = self.text.find(s)
                if i >= 0:
                    self.text = self.text[:i]
                    return "stop"
        return reason


class SavedRequest(NamedTuple):
    """A running request's state before a step (``Scheduler.restore`` puts it back)."""

    request: Request
    target_cached: int
    draft_cached: int
    drafter_state: DrafterState | None
    num_tokens: int          # KV slots it held


class Scheduler:
    """Admission with a batch-size cap (first come first served, or grouped by predicted
    acceptance); LIFO preemption. Owns the requests' KV blocks (through the PagedKVCache: the
    block copies that causes are applied there).

    ``admission="acceptance"``: when more requests wait than the batch has room for, admit those
    whose ``predict(request)`` (expected accepted drafts per step as a share of K) is closest to
    the running batch's mean (to the oldest waiting request's when nothing runs), so that a step
    verifies requests that draft alike. No request starves: one that has waited ``max_wait``
    steps, or was preempted, is admitted before any other (first come first served among them)."""

    def __init__(self, max_batch_size: int, kv, max_draft_length: int = 0, admission: str = "fifo",
                 max_wait: int = 64, predict: Callable[[Request], float] | None = None):
        self.max_batch_size = max_batch_size
        self.kv = kv
        self.step_slots = max_draft_length + 1  # slots a running request may need per step
        self.admission = admission
        self.max_wait = max_wait
        self.predict = predict
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[Hashable, Request] = {}

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests to running while the batch has room and ``try_allocate`` reserves
        their prompt, in ``admission_order``. Returns the requests refused for good (finished with
        an error here: too big for the cache, or their admission raised; the engine reports them)."""
        refused = []
        for req in self.admission_order():
            if len(self.running) >= self.max_batch_size:
                break
            try:
                ok = self.try_allocate(req)
            except Exception as e:   # noqa: BLE001 - this request's fault alone: the queue goes on
                self.finish(req, "error", f"{type(e).__name__}: {e}")
                if self.kv.has_request(req.request_id):
                    self.kv.free(req.request_id)
            if req.status == RequestStatus.FINISHED:   # refused for good
                refused.append(req)
                continue
            if not ok:
                break
            if self.waiting[0] is req:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for req in self.waiting:
            req.waited_steps += 1
        return refused

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order admission tries them."""
        room = self.max_batch_size - len(self.running)
        if self.admission == "fifo" or self.predict is None or len(self.waiting) <= room or room <= 0:
            return list(self.waiting)
        due = [r for r in self.waiting if r.waited_steps >= self.max_wait or r.num_preemptions]
        rest = [r for r in self.waiting if not (r.waited_steps >= self.max_wait or r.num_preemptions)]
        if self.running:
            ref = sum(self.predict(r) for r in self.running) / len(self.running)
        else:
            ref = self.predict(self.waiting[0])
        key = {id(r): (abs(self.predict(r) - ref), i) for i, r in enumerate(rest)}
        rest.sort(key=lambda r: key[id(r)])
        return due + rest

    def try_allocate(self, req: Request) -> bool:
        """Reserve the prompt's blocks, keeping a step's slots for every running request's next step;
        a request the cache could never hold is finished with an error (True: stop waiting)."""
        kv = self.kv
        if not kv.can_allocate(req.context_len + len(self.running) * self.step_slots):
            if not self.running and not kv.can_allocate(req.context_len + self.step_slots):
                self.finish(req, "error", f"the KV cache ({kv.num_blocks} blocks of {kv.block_size}) cannot hold "
                                          f"this request's {req.context_len} tokens")
                return True
            return False
        cached = kv.allocate(req.request_id, req.token_ids)
        if cached is None:
            return False
        req.target_cached = min(cached, req.context_len - 1)
        req.draft_cached = min(kv.cached_in_all_caches(req.request_id), req.target_cached)
        req.just_admitted = True
        return True

    def reserve(self, batch: list[Request], ks: list[int]) -> tuple[list[Request], list[int], list[Request],
                                                                    list[Request]]:
        """Give every request slots for positions [target_cached, context + K); on shortage drop
        its drafts, then preempt the newest other request; never crash. Returns (kept, their K,
        preempted, failed: finished here with an error, their blocks freed)."""
        kept, kept_k, preempted, failed = [], [], [], []
        for r, k in zip(batch, ks):
            if r.status != RequestStatus.RUNNING:
                continue
            while True:
                need = r.context_len + k - self.kv.num_tokens(r.request_id)
                if self.kv.append_slots(r.request_id, max(need, 0)):
                    break
                if k > 0:
                    k = 0
                    continue
                victim = self.preempt_newest(exclude=r)
                if victim is None:
                    self.finish(r, "error", "the KV cache is too small for this request")
                    self.kv.free(r.request_id)
                    failed.append(r)
                    break
                preempted.append(victim)
                if victim in kept:
                    i = kept.index(victim)
                    kept.pop(i)
                    kept_k.pop(i)
            if r.status == RequestStatus.RUNNING:
                kept.append(r)
                kept_k.append(k)
        return kept, kept_k, preempted, failed

    def save(self, batch: list[Request]) -> list[SavedRequest]:
        return [SavedRequest(r, r.target_cached, r.draft_cached, r.drafter_state, self.kv.num_tokens(r.request_id))
                for r in batch]

    def restore(self, saved: list[SavedRequest]) -> None:
        """Undo a step that failed before its commit: positions, drafter state and KV slots as
        saved (requests it preempted or finished stay so)."""
        for s in saved:
            r = s.request
            if r.status == RequestStatus.RUNNING and self.kv.has_request(r.request_id):
                r.target_cached, r.draft_cached, r.drafter_state = s.target_cached, s.draft_cached, s.drafter_state
                extra = self.kv.num_tokens(r.request_id) - s.num_tokens
                if extra > 0:
                    self.kv.rollback(r.request_id, extra)

    def preempt_newest(self, exclude: Request | None = None) -> Request | None:
        """Move the most recently admitted running request (not ``exclude``) back to the front of
        the queue, free its blocks and return it."""
        for req in reversed(self.running):
            if req is not exclude:
                self.running.remove(req)
                self.kv.free(req.request_id)
                req.status = RequestStatus.WAITING
                req.target_cached = 0
                req.draft_cached = 0
                req.num_preemptions += 1
                self.waiting.appendleft(req)
                return req
        return None

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status == RequestStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:          # (deque.remove's miss would build the request's repr: milliseconds)
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    def release(self, req: Request) -> None:
        """Forget a finished request."""
        self.requests.pop(req.request_id, None)
