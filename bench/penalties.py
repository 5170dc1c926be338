"""What penalties cost speculation: acceptance and tokens/s with and without them (issue 20).

A penalty changes the target's distribution at every position from the history before it; the
draft follows it (the same controls run on the draft's rows), so acceptance should stay near the
unpenalised one, and the controls' own work (the apply_penalties op, the masks, the per-request
tables) is the overhead. For the built-in pair, K = 4, the model and n-gram drafters (and plain
autoregressive decoding as the baseline), greedy and sampled, each setting is run on the same
prompts; the table shows acceptance (accepted / drafted), accepted drafts per step, tokens/s,
tokens/s relative to the same drafter without penalties, and the speedup over autoregressive
decoding with the same penalties.

Timing: one process, settings interleaved round by round, the median of --repeats rounds; torch
pinned to --threads threads. On a shared CPU the ratios are what to read, not the rates.

    python bench/penalties.py                          # CPU, a few minutes
    python bench/penalties.py --device cuda --prompts 16 --max-tokens 128 --json out.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402

PENALTIES = {
    "none": {},
    "presence+frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "repetition 1.2": dict(repetition_penalty=1.2),
    "all (+min_p, bias)": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3, min_p=0.05,
                               logit_bias={0: -5.0}),
}
DRAFTERS = {"autoregressive": None, "model": "builtin", "ngram": "ngram"}


def prompts(tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """Prefixes of Python standard-library modules (the built-in pair's domain), cut at a line."""
    import collections
    import json as json_module
    import textwrap

    sources = [inspect.getsource(m) for m in (collections, json_module.decoder, textwrap, argparse, inspect)]
    out = []
    for i in range(n):
        text = sources[i % len(sources)]
        lines = text.split("\n")
        cut = 40 + (i * 37) % max(len(lines) - 60, 1)
        out.append(tokenizer.encode("\n".join(lines[:cut]) + "\n")[-max_prompt_tokens:])
    return out


def run(llm, ids: list[list[int]], params: SamplingParams) -> tuple[float, dict]:
    """(seconds, summed metrics) of one batched generate."""
    llm.engine.reset_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(ids, params)
    seconds = time.perf_counter() - t0
    total = {k: sum(o.metrics[k] for o in outs) for k in ("steps", "drafted_tokens", "accepted_tokens",
                                                           "emitted_tokens")}
    return seconds, total


def measure(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    llms = {name: specrt.LLM(target="builtin", draft=d, device=args.device, seed=0,
                             spec=SpecConfig(max_draft_length=args.k, max_batch_size=max(args.prompts, 1)))
            for name, d in DRAFTERS.items()}
    ids = prompts(llms["autoregressive"].tokenizer, args.prompts, args.max_prompt_tokens)
    cells = [(t, d, p) for t in args.temperatures for d in DRAFTERS for p in PENALTIES]
    times: dict = {c: [] for c in cells}
    stats: dict = {}
    for llm in llms.values():   # warm up every engine once
        llm.generate(ids[:1], SamplingParams(max_tokens=4))
    for _ in range(args.repeats):
        for t, d, p in cells:
            params = SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True, seed=1,
                                    **PENALTIES[p])
            seconds, total = run(llms[d], ids, params)
            times[(t, d, p)].append(seconds)
            stats[(t, d, p)] = total
    rows = []
    for t, d, p in cells:
        s = stats[(t, d, p)]
        tps = s["emitted_tokens"] / statistics.median(times[(t, d, p)])
        rows.append({"temperature": t, "drafter": d, "penalties": p, "tokens_per_s": tps,
                     "acceptance": s["accepted_tokens"] / s["drafted_tokens"] if s["drafted_tokens"] else None,
                     "accepted_per_step": s["accepted_tokens"] / max(s["steps"], 1),
                     "seconds": times[(t, d, p)]})
    by = {(r["temperature"], r["drafter"], r["penalties"]): r for r in rows}
    for r in rows:
        r["vs_no_penalties"] = r["tokens_per_s"] / by[(r["temperature"], r["drafter"], "none")]["tokens_per_s"]
        r["speedup_vs_ar"] = r["tokens_per_s"] / by[(r["temperature"], "autoregressive", r["penalties"])][
            "tokens_per_s"]
    return rows


def kernel_costs(device: str, repeats: int = 20) -> list[dict]:
    """The controls' own work per verify, against the sampling transform it precedes: B = 32
    requests x K+1 = 5 rows, each request with 512 penalised tokens, a 16-token logit_bias and
    the draft tokens before each row (milliseconds, median)."""
    from specrt import ops

    B, K, E = 32, 4, 512
    out = []
    for V in (32000, 128256):
        g = torch.Generator().manual_seed(V)
        R = B * (K + 1)
        logits = (torch.randn(R, V, generator=g) * 3).to(device)
        tokens = torch.cat([torch.randperm(V, generator=g)[:E].sort().values for _ in range(B)]).int()
        args = (torch.arange(B).repeat_interleave(K + 1), torch.arange(K + 1).repeat(B),
                torch.randint(0, V, (B, K), generator=g, dtype=torch.int32), torch.arange(B + 1) * E, tokens,
                torch.randint(0, 4, (B * E,), generator=g, dtype=torch.int32), torch.rand(B * E, generator=g) < 0.5,
                torch.where(torch.rand(B * E, generator=g) < 16 / E, 2.0, 0.0), torch.full((B,), 1.1),
                torch.full((B,), 0.3), torch.full((B,), 0.3))
        args = tuple(a.to(device) for a in args)
        params = (torch.full((R,), 0.8), torch.zeros(R, dtype=torch.int32), torch.full((R,), 0.95))
        params = tuple(a.to(device) for a in params)

        def timed(fn) -> float:
            samples = []
            for _ in range(repeats):
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if device != "cpu":
                    torch.cuda.synchronize()
                samples.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(samples)

        work = logits.clone()
        pen = timed(lambda: ops.apply_penalties(work, *args, check_values=False))
        probs = timed(lambda: ops.probs_from_logits(logits, *params, check_values=False))
        minp = timed(lambda: ops.probs_from_logits(logits, *params, min_p=torch.full((R,), 0.05, device=device),
                                                   check_values=False))
        out.append({"V": V, "rows": R, "apply_penalties_ms": pen, "probs_from_logits_ms": probs,
                    "probs_from_logits_min_p_ms": minp})
    return out


def table(rows: list[dict]) -> str:
    head = ("| T | drafter | penalties | acceptance | accepted/step | tokens/s | vs no penalties | speedup vs AR |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        lines.append(f"| {r['temperature']:g} | {r['drafter']} | {r['penalties']} | {acc} | "
                     f"{r['accepted_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_no_penalties']:.2f}x | "
                     f"{r['speedup_vs_ar']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=4, help="draft length")
    ap.add_argument("--prompts", type=int, default=4, help="prompts, decoded as one batch")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--kernels-only", action="store_true", help="only the per-verify cost of the ops")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = kernel_costs(args.device)
    print("per verify (32 requests x 5 rows, 512 penalised tokens each), ms:")
    for k in kernels:
        print(f"  V={k['V']}: apply_penalties {k['apply_penalties_ms']:.3f} | probs_from_logits "
              f"{k['probs_from_logits_ms']:.3f} | with min_p {k['probs_from_logits_min_p_ms']:.3f}")
    rows = [] if args.kernels_only else measure(args)
    if rows:
        print(f"built-in pair, K={args.k}, {args.prompts} prompts x {args.max_tokens} tokens, device {args.device}, "
              f"{args.threads} thread(s), median of {args.repeats}")
        print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kernels": kernels, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
