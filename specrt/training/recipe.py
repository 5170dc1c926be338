"""The exact recipe that produced ``specrt/builtin`` — rerun it to retrain the pair.

    python -m specrt.training.recipe              # run every step (about 1.5 h on 1 CPU thread)
    python -m specrt.training.recipe --dry-run    # print the commands
    python -m specrt.training.recipe --only distill_layerinit evaluate

Steps write into ``ckpt/`` (gitignored) and ``export`` copies the results into
``specrt/builtin``. Every step is also a plain ``python -m specrt.training.<mod>``
command (printed by ``--dry-run``); ``pretrain`` resumes from ``ckpt/target/last.pt``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import shutil

from specrt.training.pretrain import add_classic_config_keys

CKPT = "ckpt"
BUILTIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "builtin")

# (step name, module, argv) — the settings used for the shipped pair. Pretraining and the
# layer-init distillation are wall-time budgeted (the cosine LR follows elapsed/budget), so
# on a faster machine they run more steps; the scratch draft then gets exactly as many
# steps (same tokens, same data) as the layer-init draft ran ("same compute").
STEPS: list[tuple[str, str, list[str]]] = [
    ("tokenizer", "tokenizer", ["--out", f"{CKPT}/tokenizer", "--vocab-size", "4096"]),
    ("pretrain", "pretrain", [
        "--out", f"{CKPT}/target", "--tokenizer", f"{CKPT}/tokenizer",
        "--hidden", "256", "--layers", "6", "--heads", "4", "--ffn", "768",
        "--seq-len", "512", "--batch", "8", "--steps", "2000", "--time-budget-min", "68",
        "--lr", "2e-3", "--warmup", "100", "--bf16", "--threads", "1",
        "--ckpt-minutes", "4", "--eval-every", "250", "--resume"]),
    ("distill_layerinit", "distill", [
        "--arch", "hf", "--target", f"{CKPT}/target/hf", "--out", f"{CKPT}/draft_layerinit", "--init", "layers",
        "--layers", "auto", "--num-layers", "2", "--steps", "2000", "--time-budget-min", "9",
        "--batch", "8", "--seq-len", "256", "--lr", "1e-3", "--warmup", "30",
        "--onpolicy", f"{CKPT}/onpolicy.pt", "--onpolicy-seqs", "384", "--threads", "1"]),
    ("distill_scratch", "distill", [
        "--arch", "hf", "--target", f"{CKPT}/target/hf", "--out", f"{CKPT}/draft_scratch", "--init", "scratch",
        "--num-layers", "2", "--steps", "{layerinit_steps}", "--batch", "8", "--seq-len", "256",
        "--lr", "2e-3", "--warmup", "30", "--onpolicy", f"{CKPT}/onpolicy.pt", "--threads", "1"]),
    ("accept_head", "accept_head", [
        "--target", f"{CKPT}/target/hf", "--draft", f"{CKPT}/draft_layerinit/hf",
        "--onpolicy", f"{CKPT}/onpolicy.pt", "--threads", "1"]),
    ("evaluate", "evaluate", [
        "--target", f"{CKPT}/target/hf", "--draft", f"{CKPT}/draft_layerinit/hf",
        "--draft", f"{CKPT}/draft_scratch/hf", "--int8", "--threads", "1",
        "--json", f"{CKPT}/eval.json"]),
]


def _fill(argv: list[str]) -> list[str]:
    if "{layerinit_steps}" not in argv:
        return argv
    path = f"{CKPT}/draft_layerinit/summary.json"
    steps = json.load(open(path))["steps"] if os.path.exists(path) else "<steps from " + path + ">"
    return [a.replace("{layerinit_steps}", str(steps)) for a in argv]


def export(ckpt: str = CKPT, builtin: str = BUILTIN) -> None:
    """Copy target, layer-init draft and its head into specrt/builtin (bf16 safetensors)."""
    for src, dst in ((f"{ckpt}/target/hf", "target"), (f"{ckpt}/draft_layerinit/hf", "draft")):
        d = os.path.join(builtin, dst)
        if os.path.isdir(d):
            shutil.rmtree(d)
        shutil.copytree(src, d)
        add_classic_config_keys(d)
    for r, _, fs in os.walk(builtin):  # save_pretrained writes 0600 files; ship them readable
        for f in fs:
            os.chmod(os.path.join(r, f), 0o644)
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(builtin) for f in fs)
    print(f"exported to {builtin}: {total / 1e6:.1f} MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.recipe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", nargs="*", default=None,
                    help=f"steps to run: {[s[0] for s in STEPS] + ['export']}")
    args = ap.parse_args(argv)
    names = [s[0] for s in STEPS] + ["export"]
    todo = args.only or names
    for name, mod, argv_ in STEPS:
        if name not in todo:
            continue
        argv_ = _fill(argv_)
        print(f"$ python -m specrt.training.{mod} {shlex.join(argv_)}", flush=True)
        if not args.dry_run:
            rc = importlib.import_module(f"specrt.training.{mod}").main(argv_)
            if rc:
                return rc
    if "export" in todo:
        print("$ python -m specrt.training.recipe --only export", flush=True)
        if not args.dry_run:
            export()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
