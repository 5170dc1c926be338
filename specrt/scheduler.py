"""Continuous batching: per-request state, admission, preemption. Never touches devices.

Each step the engine asks for a batch: running requests first (oldest first),
then waiting requests admitted while there is room in the batch and the KV
cache can hold their prompt. When the cache runs out mid-run the newest
running request is preempted (its blocks freed, its state reset to "nothing
cached") and requeued at the front; it later recomputes its context and, by
the randomness rule, continues with exactly the tokens it would have produced.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from specrt.config import SamplingParams
from specrt.metrics import RequestStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                         # the request's Philox key (drawn at admission when unseeded)
    prompt: str | None = None
    tag: str = "default"
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    target_cached: int = 0            # positions whose target KV is written (and valid)
    draft_cached: int = 0             # positions whose draft-model KV is written (and valid)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str = ""
    num_preemptions: int = 0
    stats: RequestStats = field(default_factory=RequestStats)
    # acceptance history (1 = accepted, 0 = rejected) of the last drafted positions, for policies
    accept_history: deque = field(default_factory=lambda: deque(maxlen=64))
    policy_state: dict = field(default_factory=dict)
    drafter_state: dict = field(default_factory=dict)   # e.g. the n-gram drafter's index of this context

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


class Scheduler:
    """FIFO admission with a batch-size cap; LIFO preemption."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
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

    def admit(self, try_allocate) -> list[Request]:
        """Move waiting requests to running while the batch has room and
        ``try_allocate(request) -> bool`` reserves their prompt. Returns the admitted."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            ok = try_allocate(req)
            if req.status == RequestStatus.FINISHED:   # refused for good (try_allocate finished it)
                continue
            if not ok:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

    def preempt_newest(self, exclude: Request | None = None) -> Request | None:
        """Pick the most recently admitted running request (not ``exclude``), move it back
        to the front of the queue and return it (the engine frees its blocks)."""
        for req in reversed(self.running):
            if req is not exclude:
                self.running.remove(req)
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
        try:
            self.waiting.remove(req)
        except ValueError:
            pass
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    def release(self, req: Request) -> None:
        """Forget a finished request."""
        self.requests.pop(req.request_id, None)
