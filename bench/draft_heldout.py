"""Held-out greedy chain acceptance of SmolLM2 drafts on fused-feature teacher stores.

    PYTHONPATH=. python -m bench.draft_heldout --store builtin=WORK/heldout-2-15-30 \
        --store sources=WORK/heldout-sources-2-15-30 specrt/builtin/smollm2-draft OTHER_DRAFT

The stores hold features of target layers 2, 15 and the final state (``specrt distill`` /
``specrt.training.teacher --feature-layers 2,15,30``); a single-feature draft reads their final
block. Prints tau and per-position acceptance at K=4, the T=0.7 expected tau and the share of the
target's greedy tokens in the draft's vocabulary, per draft and store.
"""
from __future__ import annotations

import argparse

import torch

H = 576  # SmolLM2-135M's hidden size


def load_stores(specs: list[str]) -> dict:
    """NAME=FOLDER specs -> {name: TeacherShard}."""
    from specrt.training.teacher import load_teacher

    return {name: load_teacher(path) for name, path in (s.split("=", 1) for s in specs)}


def heldout_acceptance(folder: str, target, stores: dict, k: int = 4) -> dict:
    """{store name: draft_eval.chain_acceptance} of the draft in ``folder``, and "all": both
    stores' chains pooled (acceptance weighted by each store's chain count)."""
    from specrt.models.draft_model import DraftModel
    from specrt.training.draft_eval import chain_acceptance

    d = DraftModel.from_pretrained(folder, target)
    out = {}
    for name, st in stores.items():
        if d.config.kind == "feature" and d.config.feature_layers is None:
            st = _final_block(st)
        out[name] = chain_acceptance(d, st, k=k)
    n = sum(r["chains"] for r in out.values())
    per = [sum(r["acceptance_per_position"][j] * r["chains"] for r in out.values()) / n for j in range(k)]
    out["all"] = {"chains": n, "acceptance_per_position": [round(x, 4) for x in per], "tau": round(1 + sum(per), 4),
                  "sampled_tau": round(sum(r["sampled_tau"] * r["chains"] for r in out.values()) / n, 4)}
    return out


def _final_block(store):
    """The store with its features cut to the final-normed state (a single-feature draft's input)."""
    from dataclasses import replace

    return replace(store, features=store.features[:, 2 * H:].contiguous())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafts", nargs="+", help="draft folders")
    ap.add_argument("--store", action="append", required=True, help="NAME=FOLDER of a held-out teacher store")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from specrt.models import load_model
    from specrt.models.registry import resolve_model

    torch.set_num_threads(args.threads)
    target = load_model(resolve_model("smollm2-135m", "target"), dtype="float32")
    stores = load_stores(args.store)
    for folder in args.drafts:
        for name, r in heldout_acceptance(folder, target, stores).items():
            if name == "all":
                continue
            print(folder, name, r["tau"], r["acceptance_per_position"], "decoding", r["decoding_tau"],
                  r["decoding_acceptance_per_position"], "vocab", r["target_top1_in_draft_vocab"],
                  "T0.7", r["sampled_tau"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
