"""Forced-token drafts on and off, alternating in one process (issue 36): SmolLM2-135M bf16 with
its draft, chain K (``python -m bench.structured_forced_ab 4``), greedy, the held-out schemas of
bench/structured_schemas.json, 3 repeats. Off: the grammar's forced tokens are not proposed and
the draft model drafts those positions under the mask too. Prints each mode's speedup over plain
decoding with the schema per repeat, and forced / model."""
from __future__ import annotations

import random
import sys
import time
from statistics import median

import torch


def main(argv: list[str] | None = None) -> int:
    import specrt.drafters.model as model_drafter
    from specrt import LLM, SamplingParams, SpecConfig
    from specrt.structured import Structured

    from bench.runner import shared_loader
    from bench.structured import _prompt, load_cases

    argv = sys.argv[1:] if argv is None else argv
    k, repeats = int(argv[0]) if argv else 4, 3
    torch.set_num_threads(1)
    forced = model_drafter.forced_drafts
    state = {"on": True}
    model_drafter.forced_drafts = lambda b, ks, skip: forced(b, ks, skip) if state["on"] else {}
    loader = shared_loader({})
    ar = LLM(target="smollm2-135m", draft=None, spec=SpecConfig(max_batch_size=1), device="cpu", dtype="bfloat16",
             model_loader=loader)
    sp = LLM(target="smollm2-135m", draft="smollm2-135m-draft", device="cpu", dtype="bfloat16", model_loader=loader,
             spec=SpecConfig(max_draft_length=k, policy="fixed", tree="chain", lookup=None))
    cases = load_cases()
    prompts = [_prompt(ar.tokenizer, c) for c in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured=Structured("json_schema", c["schema"]))
              for c in cases]
    modes = {"ar": (ar, None), "forced": (sp, True), "model": (sp, False)}
    for eng, on in modes.values():               # warm-up
        state["on"] = bool(on)
        eng.generate([prompts[0]], params[0])
    secs = {m: [0.0] * repeats for m in modes}
    outs: dict = {m: [None] * len(prompts) for m in modes}
    for rep in range(repeats):
        for i in range(len(prompts)):
            order = list(modes)
            random.Random(100 * rep + i).shuffle(order)
            for m in order:
                eng, on = modes[m]
                state["on"] = bool(on)
                t0 = time.perf_counter()
                outs[m][i] = eng.generate([prompts[i]], params[i])[0].token_ids
                secs[m][rep] += time.perf_counter() - t0
    for m in ("forced", "model"):
        r = [secs["ar"][j] / secs[m][j] for j in range(repeats)]
        print(f"{m}: speedup per repeat {[round(x, 3) for x in r]}, median {median(r):.3f}, "
              f"identical to plain {outs[m] == outs['ar']}")
    print("forced / model per repeat", [round(secs["model"][j] / secs["forced"][j], 3) for j in range(repeats)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
