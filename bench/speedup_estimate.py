"""Does the runtime's speedup estimate agree with a measured speedup? (issue 16, item 3)

The runtime estimates its speedup without running autoregressive decoding: the cost model's
fit of the engine's own measured plain (K=0) steps prices the emitted tokens, over the
measured step time (specrt.metrics). This script measures the real thing on the same prompts
(an autoregressive engine and the speculative one, alternating, medians over repeats) and
prints both, per drafter.

    python bench/speedup_estimate.py                       # the built-in pair
    python bench/speedup_estimate.py --target T --draft D --drafters model,ngram

Standalone (not part of `specrt bench`); numbers and the check are recorded in bench/README.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def prompts_for(llm, n: int, max_tokens: int) -> list[list[int]]:
    from specrt.benchmarks import build_prompts

    cats = build_prompts(llm.tokenizer, n, max_tokens)
    return [p["token_ids"] for items in cats.values() for p in items]


def timed(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    for p in prompts:                    # batch 1: one request at a time
        llm.generate([p], params)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="builtin")
    ap.add_argument("--draft", default="builtin", help="the draft model for the 'model' drafter")
    ap.add_argument("--drafters", default="model,ngram", help="comma list of: model, ngram, self:N")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category")
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None)
    ap.add_argument("--calibrate-once", action="store_true",
                    help="calibrate only at warm-up (default: again before every repeat, so that the plain "
                         "steps the estimate rests on span the same machine states as the measurement)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import specrt
    from specrt import SamplingParams, SpecConfig

    ar = specrt.LLM(args.target, None, spec=SpecConfig(max_batch_size=1), device=args.device)
    prompts = prompts_for(ar, args.prompts, args.prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {}
    for d in args.drafters.split(","):
        draft = args.draft if d == "model" else d
        engines[d] = specrt.LLM(args.target, draft, spec=SpecConfig(max_draft_length=args.k, max_batch_size=1),
                                device=args.device)
    ar.warmup(2, 8)
    for llm in engines.values():
        llm.warmup(prompts=prompts[:4])      # calibrates: the plain-step time the estimate needs
        llm.engine.reset_metrics()
    times = {name: [] for name in ["ar", *engines]}
    for _ in range(args.repeats):
        if not args.calibrate_once:
            for llm in engines.values():
                llm.engine.calibrate(prompts=prompts[:4])      # untimed; leaves the metrics alone
        # alternate whole passes (prompt by prompt would measure the cost of switching the caches
        # between models, which a serving process never pays and the estimate cannot see)
        times["ar"].append(timed(ar, prompts, params))
        for name, llm in engines.items():
            times[name].append(timed(llm, prompts, params))
    ratios = {name: sorted(a / b for a, b in zip(times["ar"], times[name])) for name in engines}
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, batch 1, greedy, K={args.k}, {args.repeats} "
          f"alternating repeats, {args.threads} thread(s)")
    print(f"{'drafter':<10}{'measured':>10}{'estimate':>10}{'diff':>8}{'tau':>7}{'draft share':>13}"
          f"{'AR step (est.)':>16}")
    for name, llm in engines.items():
        meas = statistics.median(ratios[name])          # the median of the paired per-repeat ratios
        st = llm.stats()["total"]
        est = st["estimated_speedup"]
        inp = st["estimated_speedup_inputs"]
        ar_step = inp["autoregressive_time_s"] / max(st["emitted_tokens"], 1)
        diff = "n/a" if est is None else f"{100 * (est / meas - 1):+.1f}%"
        print(f"{name:<10}{meas:>9.3f}x{(est or float('nan')):>9.3f}x{diff:>8}{st['tokens_per_target_forward']:>7.2f}"
              f"{st['draft_share_of_step']:>13.2f}{ar_step * 1e3:>13.2f} ms")
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in times.items()}
    print("run-to-run spread (max-min)/median: " + ", ".join(f"{k} {100 * s:.0f}%" for k, s in spread.items()))
    print("paired per-repeat speedups: " + "; ".join(f"{k} " + " ".join(f"{r:.2f}" for r in v)
                                                      for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
