"""How held-out acceptance grew with training positions: every shipped SmolLM2 draft on one set.

    PYTHONPATH=. python -m bench.draft_lineage --store builtin=WORK/heldout-2-15-30 \
        --store sources=WORK/heldout-sources-2-15-30 [--candidate DIR NEW_POSITIONS] \
        --out bench/results/DATE-MACHINE/draft-lineage.json

Each run of ``specrt distill`` measures acceptance on its own held-out set, so the runs' curves do
not join. This one evaluates every draft that shipped (bench/draft_lineage.json: the commits and
the distinct positions each added), read from git history, plus an optional candidate folder, on
the same held-out teacher stores: greedy chain acceptance at K=4, teacher-forced
(specrt.training.draft_eval), against the lineage's cumulative training positions. Writes the
JSON and a PNG beside it (tau and 1 + acceptance at positions 1 and 2, with the issue's goals).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.draft_heldout import heldout_acceptance, load_stores

LINEAGE = Path(__file__).with_name("draft_lineage.json")
REPO = Path(__file__).resolve().parents[1]
GOAL_TAU, GOAL_FIRST = 2.6, 0.70  # issue 33's goals at K=4


def checkout_draft(commit: str, path: str, dest: str, repo: Path = REPO) -> str:
    """The draft folder ``path`` as of ``commit`` in the checkout ``repo``, written under ``dest``."""
    out = os.path.join(dest, commit)
    os.makedirs(out, exist_ok=True)
    names = _git(repo, "ls-tree", "--name-only", f"{commit}:{path}").decode().split()
    for name in names:
        blob = _git(repo, "show", f"{commit}:{path}/{name}")
        Path(out, name).write_bytes(blob)
    return out


def _git(repo: Path, *args: str) -> bytes:
    r = subprocess.run(["git", *args], cwd=repo, capture_output=True)
    if r.returncode:
        raise SystemExit(f"bench.draft_lineage reads the shipped drafts from git history and needs a source "
                         f"checkout: git {' '.join(args)} failed: {r.stderr.decode().strip()}")
    return r.stdout


def plot(points: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["lineage_positions"] / 1e6 for p in points]
    acc = [p["heldout"]["all"]["acceptance_per_position"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [p["heldout"]["all"]["tau"] for p in points], "o-", label="tau at K=4 (both sets)")
    for name, style in (("builtin", "s:"), ("sources", "^:")):
        ax.plot(x, [p["heldout"][name]["tau"] for p in points], style, alpha=0.6, label=f"tau, {name} prompts")
    ax.plot(x, [1 + a[0] for a in acc], ".--", label="1 + acceptance, position 1")
    ax.plot(x, [1 + a[1] for a in acc], ".--", label="1 + acceptance, position 2")
    ax.axhline(GOAL_TAU, color="gray", ls=":", lw=0.8, label=f"goal tau {GOAL_TAU}")
    ax.axhline(1 + GOAL_FIRST, color="gray", ls="-.", lw=0.8, label=f"goal position 1: {GOAL_FIRST}")
    for xi, p in zip(x, points):
        ax.annotate(p["label"], (xi, p["heldout"]["all"]["tau"]), textcoords="offset points", xytext=(0, 6),
                    fontsize=7, ha="center")
    ax.set_xlabel("distinct training positions in the draft's lineage (millions)")
    ax.set_ylabel("held-out, teacher-forced")
    ax.set_title("SmolLM2-135M drafts: held-out acceptance vs training positions")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", action="append", required=True, help="NAME=FOLDER of a held-out teacher store")
    ap.add_argument("--candidate", nargs=2, metavar=("DIR", "NEW_POSITIONS"),
                    help="a draft folder not shipped yet, and the distinct positions its run added")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON to write (the PNG goes beside it)")
    args = ap.parse_args(argv)
    from specrt.models import load_model
    from specrt.models.registry import resolve_model

    torch.set_num_threads(args.threads)
    lineage = json.loads(LINEAGE.read_text())
    target = load_model(resolve_model("smollm2-135m", "target"), dtype="float32")
    stores = load_stores(args.store)
    points, total = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        todo = [(d["commit"], checkout_draft(d["commit"], lineage["path"], tmp), d["new_positions"], d["what"])
                for d in lineage["drafts"]]
        if args.candidate:
            todo.append(("candidate", args.candidate[0], int(args.candidate[1]), args.candidate[0]))
        for label, folder, new, what in todo:
            total += new
            r = heldout_acceptance(folder, target, stores)
            points.append({"label": label, "what": what, "new_positions": new, "lineage_positions": total,
                           "heldout": r})
            print(f"{label}: {total / 1e6:.2f}M positions, tau {r['all']['tau']} "
                  f"{r['all']['acceptance_per_position']}", flush=True)
    report = {"stores": dict(s.split("=", 1) for s in args.store), "k": 4, "points": points}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    plot(points, str(Path(args.out).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
