"""Token trees against chains and plain decoding, alternating in one process (issue 32's goals).

    python -m bench.trees --threads 1                        # SmolLM2-135M bf16 + its draft, greedy
    python -m bench.trees --temperature 0.7 --acceptance rejection
    python -m bench.trees --trees 8x4,12x4,16x5 --chains 1,2,3,4

Batch 1, held-out chat and code prompts (bench.smollm2_pair's), ``--max-tokens`` new tokens each
(``--concurrency N``: all prompts served at once, N in flight, throughput against plain decoding).
Modes: autoregressive; the draft as a chain at each K of ``--chains``; the draft as a tree at
each NODESxDEPTH of ``--trees`` (branching ``--branching``), dynamic (sized per step by measured
costs, off where it does not pay) and/or fixed (``--kinds``); and ``default``: the engine
a user gets by naming the draft and setting nothing else. Every mode runs through
bench.runner.compare (per prompt, in a seeded random order; speedups are medians of paired
per-repeat ratios). Reported per mode: tokens/s, speedup, tokens per target forward (tau),
nodes drafted per step, and whether its tokens equal autoregressive decoding. Writes a JSON.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.runner import compare, make_llm, shared_loader, strip_ids, write_json
from bench.smollm2_pair import prompts as heldout_prompts


def parse_trees(text: str) -> list[tuple[int, int]]:
    """"12x4,16x5" -> [(12, 4), (16, 5)] (nodes, depth)."""
    out = []
    for item in filter(None, text.split(",")):
        n, sep, d = item.partition("x")
        if not sep or not n.isdigit() or not d.isdigit():
            raise SystemExit(f"--trees: expected NODESxDEPTH items, got {item!r}")
        out.append((int(n), int(d)))
    return out


def modes_for(args, loader) -> dict:
    from specrt import SamplingParams, SpecConfig

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    batch = args.concurrency or 1
    common = dict(acceptance=args.acceptance, max_batch_size=batch)
    llm = lambda draft, spec: make_llm(args.target, draft, spec, "cpu", args.dtype, model_loader=loader)  # noqa: E731
    modes = {"ar": (llm(None, SpecConfig(max_batch_size=batch)), params)}
    for k in args.chains:
        modes[f"chain_k{k}"] = (llm(args.draft, SpecConfig(tree="chain", max_draft_length=k, **common)), params)
    for n, d in args.trees:
        for kind in args.kinds:
            spec = SpecConfig(tree=kind, max_tree_nodes=n, max_draft_length=d, tree_branching=args.branching,
                              **common)
            modes[f"{kind}_{n}x{d}"] = (llm(args.draft, spec), params)
    if args.default:
        modes["default"] = (llm(args.draft, SpecConfig(acceptance=args.acceptance, max_batch_size=batch)), params)
    for d in args.defaults:
        modes[f"default:{d}"] = (llm(d, SpecConfig(acceptance=args.acceptance, max_batch_size=batch)), params)
    for lk in args.lookups:
        spec = SpecConfig(acceptance=args.acceptance, max_batch_size=batch, lookup=None if lk == "none" else lk)
        modes[f"default_lookup:{lk}"] = (llm(args.draft, spec), params)
    return modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trees", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--acceptance", default="rejection", choices=["rejection", "coupled"])
    ap.add_argument("--chains", default="1,2,4", help="chain draft lengths K")
    ap.add_argument("--trees", default="8x4,12x5,16x6", help="dynamic trees NODESxDEPTH")
    ap.add_argument("--branching", type=int, default=4)
    ap.add_argument("--kinds", default="dynamic", help="tree kinds per NODESxDEPTH: dynamic (sized by the "
                    "planner, off where it does not pay) and/or fixed (always the whole budget)")
    ap.add_argument("--no-default", dest="default", action="store_false", help="skip the default engine")
    ap.add_argument("--defaults", default="", help="more default engines in the same run, one per draft= value "
                    "(comma-separated, e.g. 'suffix,smollm2-135m-draft+suffix'); mode 'default:DRAFT'")
    ap.add_argument("--lookups", default="", help="the default engine again with other SpecConfig.lookup values "
                    "(comma-separated: 'none', 'ngram', 'suffix:...'); mode 'default_lookup:VALUE'")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1, help="which held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=0,
                    help="serve all prompts at once with at most N in flight (throughput; 0: batch 1, prompt by prompt)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/trees-<temperature>.json)")
    args = ap.parse_args(argv)
    args.chains = [int(k) for k in args.chains.split(",") if k]
    args.trees = parse_trees(args.trees)
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.defaults = [d for d in args.defaults.split(",") if d]
    args.lookups = [x for x in args.lookups.split(",") if x]
    torch.set_num_threads(args.threads)
    loader = shared_loader({})
    modes = modes_for(args, loader)
    ar = modes["ar"][0]
    ps = heldout_prompts(ar.engine.tokenizer, args.prompts, args.seed)
    for llm, params in modes.values():          # kernels, caches and the cost model settle first
        llm.generate(ps[:1], params)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    res = compare(modes, ps, args.repeats, concurrency=args.concurrency or None)
    rows = {}
    for m, r in res.items():
        rows[m] = {"tokens_per_s": round(r["tokens_per_s"], 2), "speedup": round(r.get("speedup", 1.0), 3),
                   "speedup_interval": [round(x, 3) for x in r.get("speedup_interval", [1.0, 1.0])],
                   "tau": round(r["tau"], 3), "nodes_per_step": round(r["drafted_tokens_per_step"], 2),
                   "identical_to_ar": r.get("identical_to_ar")}
        print(f"  {m:12s} {rows[m]['tokens_per_s']:7.2f} tok/s  x{rows[m]['speedup']:.3f} "
              f"{rows[m]['speedup_interval']}  tau {rows[m]['tau']:.2f}  nodes/step {rows[m]['nodes_per_step']:.1f}  "
              f"identical {rows[m]['identical_to_ar']}", flush=True)
    write_json({"args": vars(args), "started": started, "summary": rows, "full": strip_ids(res)},
               args.out or os.path.join("bench", "results", f"trees-t{args.temperature:g}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
