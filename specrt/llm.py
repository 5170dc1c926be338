"""The Python API: ``LLM`` over one engine (single process or tensor parallel).

    llm = specrt.LLM(target="builtin", draft="builtin", spec=specrt.SpecConfig(max_draft_length=4))
    outs = llm.generate(["def fib(n):"], specrt.SamplingParams(temperature=0, max_tokens=64))
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from specrt.config import SamplingParams, SpecConfig
from specrt.distributed import create_engine
from specrt.engine import LLMEngine, RequestOutput
from specrt.warmup import warm_up


class LLM:
    def __init__(self, target: str | Path = "builtin", draft: str | Path | None = None,
                 spec: SpecConfig | None = None, device=None, dtype=None, seed: int | None = None,
                 tensor_parallel_size: int = 1, *, target_quantize: str | None = None,
                 draft_quantize: str | None = None, draft_dtype=None, int8_activations: bool = False,
                 **engine_hooks):
        """``target_quantize`` / ``draft_quantize`` / ``draft_dtype`` / ``int8_activations``: see LLMEngine
        (weight-only quantized models that stay quantized; the draft's dtype; int8 activations in the
        quantized layers, CPU). ``engine_hooks``: LLMEngine's keyword hooks (model_loader, wrap_drafter;
        single process)."""
        for name, value in (("target_quantize", target_quantize), ("draft_quantize", draft_quantize),
                            ("draft_dtype", draft_dtype), ("int8_activations", int8_activations or None)):
            if value is not None:
                engine_hooks[name] = value
        if tensor_parallel_size != 1 and engine_hooks:
            raise ValueError(f"engine options {sorted(engine_hooks)} are not supported with tensor parallelism")
        self.engine = create_engine(target, draft, spec, device, dtype, seed,
                                    tensor_parallel_size=tensor_parallel_size, **engine_hooks)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An LLM over an engine built elsewhere (e.g. with hooks, or shared with a server)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
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
        per prompt, whose earlier outputs a scoped suffix drafter may draft from."""
        ids = self._add_all(prompts, params, tags, tenants)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def generate_stream(self, prompts, params=None, tags=None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (with new_token_ids / new_text) each time a request advances."""
        ids = set(self._add_all(prompts, params, tags))
        remaining = set(ids)
        while remaining:
            for out in self.engine.step():
                if out.request_id in ids:
                    yield out
                    if out.finished:
                        remaining.discard(out.request_id)

    def stats(self) -> dict:
        return self.engine.metrics.snapshot()

    def warmup(self, num_requests: int = 4, max_tokens: int = 16, prompts: Sequence | None = None) -> None:
        """Run a few requests so kernels, caches and the cost model settle before serving, and
        calibrate the cost model (what the budget policy plans with; the plain-step time the
        speedup estimate divides by). ``prompts``: typical requests (text or token ids) to run and
        calibrate on (up to ``num_requests`` of them run first); without them, synthetic ones."""
        warm_up(self.engine, prompts, num_requests, max_tokens)
