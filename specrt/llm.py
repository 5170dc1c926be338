"""The Python API: ``LLM`` over one engine (single process or tensor parallel).

    llm = specrt.LLM(target="builtin", draft="builtin", spec=specrt.SpecConfig(max_draft_length=4))
    outs = llm.generate(["def fib(n):"], specrt.SamplingParams(temperature=0, max_tokens=64))
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from specrt.config import SamplingParams, SpecConfig
from specrt.step.distributed import create_engine
from specrt.step.engine import LLMEngine, RequestOutput
from specrt.step.warmup import warm_up


class LLM:
    """Generation over one engine.

    Thread safety: one LLM may be used from several threads at once. Every ``generate`` /
    ``generate_stream`` call shares one engine loop: the call holding the step lock advances the
    engine one step (every running request moves, whoever submitted it), and each output is routed
    to the call that submitted that request, so a call sees only its own requests' outputs and no
    output is lost. A call that ends early (a stream left with ``break``, ``close()`` or dropped and
    garbage-collected; an exception, KeyboardInterrupt included) aborts its unfinished requests and
    frees their KV. ``warmup`` runs with no call in flight (RuntimeError otherwise). Calls must be
    the engine's only stepper: an engine stepped elsewhere too (e.g. a server loop) would take
    these calls' outputs."""

    def __init__(self, target: str | Path = "builtin", draft: str | Path | None = None,
                 spec: SpecConfig | None = None, device=None, dtype=None, seed: int | None = None,
                 tensor_parallel_size: int = 1, *, target_quantize: str | None = None,
                 draft_quantize: str | None = "auto", draft_dtype=None, int8_activations: bool = False,
                 **engine_hooks):
        """``target_quantize`` / ``draft_quantize`` / ``draft_dtype`` / ``int8_activations``: see LLMEngine
        (weight-only quantized models that stay quantized — ``draft_quantize="auto"``, the default, is
        Q8_0 with int8 activations for a draft model on a CPU with AVX-512-VNNI, None keeps it in full
        precision; the draft's dtype; int8 activations in the quantized layers, CPU). ``engine_hooks``: LLMEngine's keyword hooks (model_loader, wrap_drafter;
        single process)."""
        for name, value in (("target_quantize", target_quantize), ("draft_dtype", draft_dtype),
                            ("int8_activations", int8_activations or None)):
            if value is not None:
                engine_hooks[name] = value
        if draft_quantize != "auto":      # None: a full-precision draft model
            engine_hooks["draft_quantize"] = draft_quantize
        if tensor_parallel_size != 1 and engine_hooks:
            raise ValueError(f"engine options {sorted(engine_hooks)} are not supported with tensor parallelism")
        self.engine = create_engine(target, draft, spec, device, dtype, seed,
                                    tensor_parallel_size=tensor_parallel_size, **engine_hooks)
        self.tokenizer = self.engine.tokenizer
        self._init_routing()

    def _init_routing(self) -> None:
        self._lock = threading.Lock()                 # held while stepping the engine / routing outputs
        self._holder: int | None = None               # the thread holding _lock
        self._owners: dict[str, deque] = {}           # unfinished request id -> its call's output queue
        self._aborts: deque[str] = deque()            # abandoned requests not aborted yet

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An LLM over an engine built elsewhere (e.g. with hooks, or shared with a server)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        llm._init_routing()
        return llm

    def _add_all(self, prompts, params, tags, tenants=None) -> list[str]:
        """Queue every prompt, or none (ValueError) if any request is bad."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif not isinstance(params, (list, tuple)):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return self.engine.add_requests(list(prompts), list(params), list(tags) if tags else None,
                                        tenants=list(tenants) if tenants else None)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 tags: Sequence[str] | None = None, tenants: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order. ``tenants``:
        per prompt, whose earlier outputs a scoped suffix drafter may draft from. Safe to call from
        several threads (see the class docstring)."""
        ids, box = self._submit(prompts, params, tags, tenants)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self._next(box):
                    if out.finished:
                        done[out.request_id] = out
        finally:
            if len(done) < len(ids):                  # raised (or interrupted): abort what still runs
                self._abandon(ids)
        return [done[i] for i in ids]

    def generate_stream(self, prompts, params=None, tags=None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (with new_token_ids / new_text) each time a request advances. The
        requests are queued at the first ``next()``; leaving the stream before they finish (break,
        ``close()``, garbage collection) aborts them and frees their KV."""
        ids, box = self._submit(prompts, params, tags)
        remaining = set(ids)
        try:
            while remaining:
                for out in self._next(box):
                    if out.finished:
                        remaining.discard(out.request_id)
                    yield out
        finally:
            if remaining:
                self._abandon(remaining)

    # ------------------------------------------------------------------ the shared engine loop
    @contextmanager
    def _locked(self):
        """Hold the step lock (recording the holder: a stream garbage-collected while this thread
        holds it, at any allocation, must not wait for the lock itself); abort the requests of
        streams collected meanwhile on the way out."""
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
                self._abort_pending()
            finally:
                self._holder = None

    def _submit(self, prompts, params, tags, tenants=None) -> tuple[list[str], deque]:
        """Queue the requests and register them to one new output queue (atomically: no step can
        run between the two, so none of their outputs goes unrouted)."""
        with self._locked():
            ids = self._add_all(prompts, params, tags, tenants)
            box: deque = deque()
            for i in ids:
                self._owners[i] = box
        return ids, box

    def _next(self, box: deque) -> list[RequestOutput]:
        """The outputs waiting in ``box``; if none, step the engine once first (routing every
        output to its call's queue). May return [] (the step did not advance these requests)."""
        with self._locked():
            self._abort_pending()
            if not box:
                for out in self.engine.step():
                    owner = self._owners.get(out.request_id)
                    if owner is None:                 # abandoned (or not submitted through this LLM)
                        continue
                    owner.append(out)
                    if out.finished:
                        self._owners.pop(out.request_id, None)
            outs = list(box)
            box.clear()
        return outs

    def _abandon(self, ids) -> None:
        """Abort the given requests still running (their KV is freed now; their final "abort"
        outputs, emitted at the next step, go nowhere)."""
        for i in ids:
            if self._owners.pop(i, None) is not None:
                self._aborts.append(i)
        if self._holder == threading.get_ident():
            return        # collected while this thread holds the lock: aborted when it lets go
        with self._locked():
            pass

    def _abort_pending(self) -> None:
        while self._aborts:
            self.engine.abort_request(self._aborts.popleft())

    def stats(self) -> dict:
        """A snapshot of the engine's counters: requests, tokens, tokens per target forward, acceptance
        per draft position, tree nodes per step, and ``estimated_speedup`` (None until the cost
        model has a plain-step time to divide by: ``warmup()`` calibrates it)."""
        return self.engine.metrics.snapshot()

    def warmup(self, num_requests: int = 4, max_tokens: int = 16, prompts: Sequence | None = None) -> None:
        """Run a few requests so kernels, caches and the cost model settle before serving, and
        calibrate the cost model (what the budget policy plans with; the plain-step time the
        speedup estimate divides by). ``prompts``: typical requests (text or token ids) to run and
        calibrate on (up to ``num_requests`` of them run first); without them, synthetic ones. Not
        while a generate call is in flight (RuntimeError): it runs the engine until idle."""
        with self._locked():
            if self._owners:
                raise RuntimeError("warmup() needs an idle LLM: generate calls are in flight")
            warm_up(self.engine, prompts, num_requests, max_tokens)
