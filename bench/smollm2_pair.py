"""SmolLM2-135M-Instruct with its distilled reduced-vocabulary draft (issue 15), end to end.

    python -m bench.smollm2_pair --dtype bfloat16 --temperatures 0,0.7 --ks 1,2,3 --threads 1
    python -m bench.smollm2_pair --drafts layers=smollm2-135m-draft,feature=DRAFT_FOLDER --ks 1,2 ...

Batch 1, chat and code prompts of the held-out split of specrt's built-in prompt set (fillers
the draft never saw in training), ``--max-tokens`` new tokens each. For every temperature the
modes (autoregressive, the draft at each K, n-gram) run alternately in one process
(bench.runner.compare: per prompt, in a seeded random order; medians over repeats; the speedup
is the median of each repeat's paired time ratio); ``--drafts`` runs several drafts (a layer and a
feature draft, say) side by side in the same run, modes LABEL_kK. Also reported: tokens per target forward,
acceptance per position, the draft's step cost c (one draft token / one target decode step)
and the verify overhead v, measured interleaved on this machine (bench.costs), and whether each
greedy mode's tokens equal autoregressive decoding (always in float32; bf16 rounds 1-token
and K+1-token forwards alike only with the small-M kernel). Writes a JSON with everything.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.costs import measure_costs, theoretical_speedup
from bench.runner import compare, make_llm, shared_loader, strip_ids, write_json


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from specrt.training.prompts import build_prompts, render

    return [render(p, tokenizer) for p in build_prompts("heldout", n, seed)]


def parse_drafts(args) -> dict[str, str]:
    """label -> draft (name or folder): ``--drafts a=X,b=Y``, else {"draft": --draft}."""
    if not args.drafts:
        return {"draft": args.draft}
    out = {}
    for item in args.drafts.split(","):
        label, sep, draft = item.partition("=")
        if not sep or not label.isidentifier() or not draft or label in ("ar", "ngram"):
            raise SystemExit(f"--drafts: expected LABEL=DRAFT items (LABEL a name other than ar/ngram), got {item!r}")
        out[label] = draft
    return out


def draft_mode(mode: str, labels) -> tuple[str, int] | None:
    """(draft label, K) of a mode named LABEL_kK, or None (ar, n-gram)."""
    label, _, k = mode.rpartition("_k")
    return (label, int(k)) if label in labels and k.isdigit() else None


def modes_for(args, loader, temperature: float) -> dict:
    from specrt import SamplingParams, SpecConfig

    params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    spec = lambda k: SpecConfig(max_draft_length=k, policy=args.policy)  # noqa: E731
    llm = lambda draft, k=1: make_llm(args.target, draft, spec(k), "cpu", args.dtype, model_loader=loader)  # noqa: E731
    modes = {"ar": (llm(None), params)}
    for label, draft in parse_drafts(args).items():
        for k in args.ks:
            modes[f"{label}_k{k}"] = (llm(draft, k), params)
    if args.ngram:
        modes["ngram_k4"] = (llm("ngram", 4), params)
    return modes


def summarize(res: dict, costs: dict, labels) -> dict:
    out = {}
    for m, r in res.items():
        row = {"tokens_per_s": round(r["tokens_per_s"], 2), "speedup": round(r.get("speedup", 1.0), 3),
               "speedup_interval": [round(x, 3) for x in r.get("speedup_interval", [1.0, 1.0])],
               "drafted_tokens_per_step": round(r["drafted_tokens_per_step"], 3),
               "tau": round(r["tau"], 3), "identical_to_ar": r.get("identical_to_ar"),
               "acceptance_per_position": [round(a, 3) for a in r["acceptance_rate_per_position"]]}
        dm = draft_mode(m, labels)
        if dm is not None:
            label, k = dm
            k_run = r["drafted_tokens_per_step"] or k   # what an adaptive policy actually drafted
            c, v = costs["c"][label], costs["v"][k]
            row["theoretical_speedup"] = round(theoretical_speedup(r["tau"], c, k_run, v), 3)
        out[m] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.smollm2_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="SmolLM2-135M-Instruct: the name, a GGUF or a folder")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--drafts", default=None,
                    help="several drafts side by side: LABEL=DRAFT,... (a name or a draft folder, e.g. "
                         "layers=smollm2-135m-draft,feature=path/to/feature-draft); replaces --draft")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--ks", default="1,2,3", help="draft lengths to run the draft at")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "confidence", "budget", "auto"],
                    help="draft-length policy of the speculative modes (K is its maximum)")
    ap.add_argument("--no-ngram", dest="ngram", action="store_false")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1, help="which held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/smollm2_pair-DTYPE.json)")
    args = ap.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    torch.set_num_threads(args.threads)
    labels = list(parse_drafts(args))
    store: dict = {}
    loader = shared_loader(store)
    report = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "temperatures": {}}
    costs = None
    for t in [float(x) for x in args.temperatures.split(",")]:
        modes = modes_for(args, loader, t)
        if costs is None:
            ar = modes["ar"][0]
            ps = prompts(ar.engine.tokenizer, args.prompts, args.seed)
            for llm, _ in modes.values():   # kernels, caches and the cost model settle first
                llm.generate(ps[:1], modes["ar"][1])
            by = {label: modes[f"{label}_k{max(args.ks)}"][0] for label in labels}
            costs = measure_costs(by, max(args.ks), ctx=256, reps=30)
            report["costs"] = {"c": costs["c"], "v": costs["v"], "target_step_ms": costs["target_step_s"][1] * 1e3,
                               "draft_step_ms": {label: t * 1e3 for label, t in costs["draft_step_s"].items()}}
            cs = " ".join(f"c[{label}]={c:.3f}" for label, c in costs["c"].items())
            print(f"costs: {cs} v={ {k: round(x, 3) for k, x in costs['v'].items()} } "
                  f"target step {costs['target_step_s'][1] * 1e3:.1f} ms", flush=True)
        res = compare(modes, ps, args.repeats)
        summary = summarize(res, costs, labels)
        report["temperatures"][str(t)] = {"summary": summary, "full": strip_ids(res)}
        print(f"T={t}:", flush=True)
        for m, row in summary.items():
            print(f"  {m:12s} {row['tokens_per_s']:7.2f} tok/s  x{row['speedup']:.3f} {row['speedup_interval']}  "
                  f"tau {row['tau']:.2f}  acc {row['acceptance_per_position']}  "
                  f"theory {row.get('theoretical_speedup', '-')}  identical {row['identical_to_ar']}", flush=True)
    write_json(report, args.out or os.path.join("bench", "results", f"smollm2_pair-{args.dtype}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
