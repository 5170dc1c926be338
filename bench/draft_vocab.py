"""Does a bigger draft head pay? Coverage of the target's greedy tokens and a chain A/B per head size.

    PYTHONPATH=. python -m bench.draft_vocab --prompts 160 --ab-prompts 24 --grow 16384,24576 \
        --out bench/results/DATE-MACHINE/draft-vocab.json

The shipped SmolLM2 draft's head holds 16,384 target ids (chosen by the teacher's probability mass
over its training data); its rows are the target's own embeddings, so a head can grow without
training. Each variant adds the ids below X (BPE merge order: the tokenizer's most frequent first).
Reports, per variant: the share of the target's greedy tokens on held-out prompts (per prompt kind)
the head contains, and on other held-out prompts chain K=4 (no lookup) tokens per target forward,
acceptance per position and speed against plain decoding, alternating in one process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specrt", "builtin",
                       "smollm2-draft")


def grown(out: str, extra_below: int) -> torch.Tensor:
    """A copy of the shipped draft at ``out`` whose head also holds ids < extra_below; returns its id map."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(SHIPPED, "model.safetensors"))
    ids = tensors["draft_to_target"]
    keep = torch.zeros(max(int(ids.max()) + 1, extra_below), dtype=torch.bool)
    keep[ids] = True
    keep[:extra_below] = True
    shutil.copytree(SHIPPED, out, dirs_exist_ok=True)
    tensors["draft_to_target"] = keep.nonzero().flatten().to(torch.int64).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["specrt_draft"]["draft_vocab_size"] = int(tensors["draft_to_target"].numel())
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return tensors["draft_to_target"]


def main(argv=None) -> int:
    import specrt
    from specrt import SamplingParams, SpecConfig
    from specrt.training.prompts import build_prompts, render

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=160, help="held-out prompts for coverage (seed 0)")
    ap.add_argument("--ab-prompts", type=int, default=24, help="held-out prompts for the A/B (seed 1)")
    ap.add_argument("--grow", default="16384,24576", help="variants: the head plus every id below X")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = specrt.LLM(target="smollm2-135m", draft=None, dtype=torch.bfloat16)
    tok = plain.tokenizer

    cov_prompts = build_prompts("heldout", args.prompts, seed=0)
    answers = []
    for i in range(0, len(cov_prompts), 16):
        outs = plain.generate([render(p, tok) for p in cov_prompts[i:i + 16]], greedy)
        answers += [list(o.token_ids) for o in outs]
    kinds = sorted({p.kind for p in cov_prompts})

    tmp = tempfile.mkdtemp(prefix="draft-vocab-")
    variants = {"shipped": SHIPPED}
    maps = {"shipped": None}
    for x in [int(v) for v in args.grow.split(",") if v]:
        variants[f"below{x}"] = os.path.join(tmp, f"below{x}")
        maps[f"below{x}"] = grown(variants[f"below{x}"], x)
    from safetensors.torch import load_file
    maps["shipped"] = load_file(os.path.join(SHIPPED, "model.safetensors"))["draft_to_target"]

    result = {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "variants": {}}
    for name, ids in maps.items():
        inside = torch.zeros(max(int(ids.max()), max(max(a, default=0) for a in answers)) + 1, dtype=torch.bool)
        inside[ids] = True
        cov = {}
        for kind in [*kinds, "all"]:
            toks = [t for p, a in zip(cov_prompts, answers) if kind in ("all", p.kind) for t in a]
            cov[kind] = round(float(inside[torch.tensor(toks)].float().mean()), 4)
        result["variants"][name] = {"head_ids": int(ids.numel()), "coverage": cov}
        print(name, ids.numel(), "coverage", cov, flush=True)

    ab_prompts = [render(p, tok) for p in build_prompts("heldout", args.ab_prompts, seed=1)]
    engines = {n: specrt.LLM(target="smollm2-135m", draft=f, dtype=torch.bfloat16,
                             spec=SpecConfig(tree="chain", max_draft_length=4, lookup=None))
               for n, f in variants.items()}
    for e in [plain, *engines.values()]:
        e.warmup()
    names = ["plain", *engines]
    wall = dict.fromkeys(names, 0.0)
    outs = {n: [] for n in names}
    for i, ids in enumerate(ab_prompts):
        for n in (names if i % 2 == 0 else names[::-1]):
            llm = plain if n == "plain" else engines[n]
            t0 = time.perf_counter()
            o = llm.generate([ids], greedy)
            wall[n] += time.perf_counter() - t0
            outs[n].append(list(o[0].token_ids))
    for n, e in engines.items():
        t = e.stats()["total"]
        ab = {"tokens_per_target_forward": round(t["tokens_per_target_forward"], 3),
              "acceptance_per_position": [round(a, 3) for a in t["acceptance_rate_per_position"]],
              "speed_vs_plain": round(wall["plain"] / wall[n], 3), "identical_to_plain": outs[n] == outs["plain"]}
        result["variants"][n]["chain_k4"] = ab
        print(n, ab, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
