"""Warm-up: a few requests so kernels, caches and the cost model settle before serving, then
the cost model calibrated (on typical prompts when given). Works on any engine with
LLMEngine's public API (the tensor-parallel one included)."""
from __future__ import annotations

from typing import Sequence

from specrt.config import SamplingParams


def warm_up(engine, prompts: Sequence | None = None, num_requests: int = 4, max_tokens: int = 16) -> None:
    """Run a few requests so kernels, caches and the cost model settle before serving, then
    calibrate the cost model (a speculative engine: the plain-step time the speedup estimate
    needs, the costs the budget policy plans with). ``prompts`` (text or token ids: typical
    requests) are what both run; without them, short synthetic prompts. Works on any engine with
    LLMEngine's public API (the tensor-parallel one included). The warm-up requests count in the
    metrics (the server resets them after); calibration leaves them alone."""
    if prompts:
        runs = list(prompts)[:max(num_requests, 1)]
    else:
        vocab = max(min(engine.vocab_size, engine.tokenizer.vocab_size) - 1, 1)
        runs = [[1 + (i * 7) % vocab] * 8 for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in runs:
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        engine.add_request(ids[-max(engine.max_model_len - max_tokens - 1, 1):], params, tag="warmup")
    while engine.has_unfinished():
        engine.step()
    engine.step()                     # releases the finished requests
    if engine.speculative:
        engine.calibrate(prompts=list(prompts) if prompts else None)
