"""Calibration: seed an idle engine's cost model with measured steps of both kinds.

For each batch size, throwaway greedy requests decode ``rounds`` x (``run`` plain steps, then
``run`` steps drafting max_draft_length tokens), so that serving starts with the costs known
(what the budget policy plans with, and the autoregressive step time the speedup estimate
divides by). Metrics and outputs are left as they were.
"""
from __future__ import annotations

from typing import Sequence

from specrt.config import SamplingParams


def calibrate(engine, batch_sizes: Sequence[int] = (1, 4), rounds: int = 4, run: int = 4,
              prompts: Sequence | None = None) -> None:
    """``engine``: an idle LLMEngine; ``prompts`` (text or token ids: typical requests) are what
    the throwaway requests decode (cut to fit; synthetic ones without)."""
    if not engine.speculative or engine.spec.max_draft_length == 0:
        return
    with engine.lock:
        if engine.has_unfinished():
            raise RuntimeError("calibrate() needs an idle engine (requests are queued or running)")
        saved, engine.metrics = engine.metrics, engine.metrics.fresh()
        K, steps = engine.spec.max_draft_length, 2 * rounds * run
        gen = max(1, min(steps * (K + 1) + 1, engine.max_model_len // 2))
        pool = engine.intake.calibration_prompts(prompts, engine.max_model_len - gen - 1)
        try:
            for B in batch_sizes:
                B = max(1, min(int(B), engine.spec.max_batch_size))
                # an explicit seed: calibration draws nothing from the engine's seed stream
                params = SamplingParams(temperature=0.0, ignore_eos=True, seed=0, max_tokens=gen)
                ids = [engine.add_request(pool[b % len(pool)], params, tag="calibration") for b in range(B)]
                for i in range(steps + 1):           # + the prefill step
                    engine.step(k=0 if i == 0 or ((i - 1) // run) % 2 == 0 else K)
                for rid in ids:
                    engine.abort_request(rid)
                engine.step(k=0)              # nothing runs: releases the aborted requests
        finally:
            engine.metrics = saved
