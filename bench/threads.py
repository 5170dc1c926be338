"""One thread against two, on an idle machine and beside a busy process (issue 38's goal: two
threads never more than 10% slower than one, in any setting).

    python -m bench.threads                       # SmolLM2-135M bf16 + its draft, greedy, batch 1
    python -m bench.threads --busy 0,1 --prompts 4 --max-tokens 64 --repeats 3

Modes, alternating in one process through bench.runner.compare: plain decoding and the default
speculative engine (the draft named, nothing else set), each pinned at 1 thread and at 2
(``SpecConfig(threads=N, adaptive_threads=False)``) and at 2 with the thread governor on (the
default: ``SpecConfig(threads=2)``). ``--busy 1`` runs the same comparison beside a process
that spins one core (a pure-Python loop, its own process). Reported per setting: tokens/s of each
mode and the ratios 2 threads / 1 thread. Writes a JSON.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from bench.runner import compare, make_llm, shared_loader, strip_ids, write_json
from bench.smollm2_pair import prompts as heldout_prompts

GOAL = 0.90     # 2 threads / 1 thread, at least


def modes_for(args, loader) -> dict:
    from specrt import SamplingParams, SpecConfig

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    modes = {}
    for kind, draft in (("ar", None), ("spec", args.draft)):
        for name, threads, adaptive in (("t1", 1, False), ("t2", 2, False), ("t2_governed", 2, True)):
            spec = SpecConfig(max_batch_size=1, threads=threads, adaptive_threads=adaptive)
            modes[f"{kind}_{name}"] = (make_llm(args.target, draft, spec, "cpu", args.dtype, model_loader=loader),
                                       params)
    return modes


def busy_process() -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def ratios(res: dict) -> dict:
    """2-thread modes' tokens/s over their 1-thread mode's."""
    out = {}
    for kind in ("ar", "spec"):
        base = res[f"{kind}_t1"]["tokens_per_s"]
        for name in ("t2", "t2_governed"):
            out[f"{kind}_{name}_vs_t1"] = round(res[f"{kind}_{name}"]["tokens_per_s"] / base, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--busy", default="0,1", help="settings to run: 0 idle, 1 beside a busy process")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/threads.json")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench.threads needs at least 2 CPUs in this process's affinity mask")
    loader = shared_loader({})
    modes = modes_for(args, loader)
    ps = heldout_prompts(modes["ar_t1"][0].engine.tokenizer, args.prompts, 1)
    for llm, params in modes.values():          # kernels, caches and the cost model settle first
        llm.generate(ps[:1], params)
    report = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": {}}
    for busy in (int(b) for b in args.busy.split(",") if b):
        proc = busy_process() if busy else None
        try:
            res = compare(modes, ps, args.repeats, baseline="ar_t1")
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        setting = "busy" if busy else "idle"
        r = ratios(res)
        report["settings"][setting] = {"ratios": r, "goal_met": all(v >= GOAL for v in r.values()),
                                       "full": strip_ids(res)}
        print(f"{setting}:")
        for m, v in res.items():
            print(f"  {m:16s} {v['tokens_per_s']:8.2f} tok/s  tau {v['tau']:.2f}  identical {v.get('identical_to_ar')}")
        print("  " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()))
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
