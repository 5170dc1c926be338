"""A/B of draft recipes on the same teacher data and budget: held-out tau every 50 steps.

    PYTHONPATH=. python -m bench.distill_ab --mode fused --minutes 10 \
        --data WORK/train --heldout WORK/heldout-2-15-30 --out bench/results/DATE-MACHINE/ab-fused.json

Modes, all warm-started from the shipped SmolLM2 draft (specrt/builtin/smollm2-draft):
  single  the single-feature draft trained further (it reads the final-normed block of the data)
  fused   an EAGLE-3 draft over target layers 2, 15 and the final-normed state
  fused2  the same with a second layer that starts as the identity
``--top1-weight W`` adds W x cross-entropy on the teacher's argmax to the sparse KL (any mode).
The data must hold features of layers 2,15,30 (``specrt.training.teacher --feature-layers 2,15,30``).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

H = 576  # SmolLM2-135M's hidden size
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specrt", "builtin",
                       "smollm2-draft")


class LastBlock:
    """A fused store seen as a single-feature one: the final-normed block of every feature row."""

    def __init__(self, store):
        self.s, self.offsets, self.prompt_lens, self.token_ids = store, store.offsets, store.prompt_lens, \
            store.token_ids
        self.feature_width = H

    @property
    def num_sequences(self) -> int:
        return self.s.num_sequences

    def sequence_rows(self, i: int):
        ids, top, lp, f = self.s.sequence_rows(i)
        return ids, top, lp, f[:, 2 * H:]


def make_draft(mode: str, target, vocab):
    from specrt.training.draft_distill import warm_start
    from specrt.training.draft_train import init_draft

    layers = [29, 29] if mode == "fused2" else [29]
    d = init_draft(target, "feature", layers, vocab, "embed", None if mode == "single" else (2, 15, 30))
    warm_start(d, SHIPPED)
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["single", "fused", "fused2"], required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top1-weight", type=float, default=0.0, help="weight of the teacher-argmax cross-entropy")
    args = ap.parse_args(argv)
    from specrt.models import load_model
    from specrt.models.draft_model import DraftModel
    from specrt.models.registry import resolve_model
    from specrt.training.draft_eval import chain_acceptance
    from specrt.training.draft_train import TrainConfig, train_draft
    from specrt.training.teacher import load_teacher
    from specrt.training.teacher_store import open_teacher_store
    from specrt.training.vocab import ReducedVocab

    torch.set_num_threads(args.threads)
    store, held = open_teacher_store(args.data), load_teacher(args.heldout)
    if args.mode == "single":
        store = LastBlock(store)
        held.features = held.features[:, 2 * H:].contiguous()
    target = load_model(resolve_model("smollm2-135m", "target"), dtype="float32")
    vocab = ReducedVocab.from_map(DraftModel.from_pretrained(SHIPPED, None).draft_to_target, 49152)
    draft = make_draft(args.mode, target, vocab)
    cfg = TrainConfig(steps=100000, budget_s=args.minutes * 60, lr=3e-4, warmup=10, batch_tokens=2048,
                      chain_steps=3, eval_every=50, top1_weight=args.top1_weight)
    res = train_draft(draft, store, vocab, cfg, None, evaluate=lambda m: chain_acceptance(m, held, k=4))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"mode": args.mode, "top1_weight": args.top1_weight,
                   "history": [h for h in res["history"] if "heldout" in h]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
