"""`specrt demo | serve | bench | distill | train | convert` — the command line.

    specrt demo                       # built-in pair: autoregressive vs speculative, same run
    specrt serve --target-model builtin --draft-model builtin --speculative-decoding
    specrt bench --quick [--out DIR]  # end-to-end benchmark report (a source checkout: bench/)
    specrt distill ...                # draft-model tools (layer-init, distillation, acceptance head)
    specrt convert model.gguf OUT_DIR # a GGUF file (or smollm2-135m) as a Hugging Face folder
"""
from __future__ import annotations

import argparse
import sys
import time


def _demo_prompts(n: int, context_lines: int = 12) -> list[tuple[str, str]]:
    """Code-completion prompts from the built-in pair's held-out stdlib modules (never trained
    on): the lines up to and including a ``def`` line and its docstring opening, spread evenly
    over the modules. Deterministic for a given Python version."""
    import re

    from specrt.training.corpus import split_files, read_text

    _, heldout = split_files()
    candidates: list[tuple[str, str]] = []
    for f in heldout:
        lines = read_text(f).splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*def \w+\(.*\):\s*$", line) and i + 1 < len(lines) and '"""' in lines[i + 1]:
                start = max(0, i - context_lines)
                candidates.append((f"{f.relpath}:{i + 1}", "\n".join(lines[start:i + 2]) + "\n"))
    if not candidates:
        raise RuntimeError("no held-out stdlib modules found to build demo prompts from")
    step = max(1, len(candidates) // n)
    return candidates[::step][:n]


def demo(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specrt demo", description="Autoregressive vs speculative decoding on the "
                                "built-in model pair, in one run.")
    p.add_argument("--target", default="builtin")
    p.add_argument("--draft", action="append", default=None,
                   help="drafter(s) to compare: a model folder, 'builtin', 'ngram' or 'self:N' "
                        "(repeatable; default: builtin and ngram)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--acceptance", default="rejection", choices=["rejection", "coupled"])
    p.add_argument("--policy", default="fixed", choices=["fixed", "confidence", "head", "budget"])
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-quantize", default=None, choices=["int8", "q8_0", "q4_0", "q4_1"],
                   help="weight-only quantized target (every mode, autoregressive included)")
    p.add_argument("--draft-quantize", default=None, choices=["int8", "q8_0", "q4_0", "q4_1"],
                   help="weight-only quantized draft model (model drafters only)")
    p.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft model's dtype (default: the target's)")
    args = p.parse_args(argv)

    import torch

    import specrt

    if args.device in (None, "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(1)   # the built-in pair is tiny: one thread beats two fighting over a core
    drafts = args.draft or ["builtin", "ngram"]
    prompts = _demo_prompts(args.prompts)
    texts = [t for _, t in prompts]
    params = specrt.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                   seed=1234)
    print(f"specrt demo: target={args.target} drafts={','.join(drafts)} K={args.draft_length} "
          f"T={args.temperature} acceptance={args.acceptance} policy={args.policy}; "
          f"{len(texts)} held-out code prompts, {args.max_tokens} tokens each, batch 1, "
          f"median of {args.repeats} alternating runs", flush=True)
    engines = {"autoregressive": specrt.LLM(target=args.target, draft=None, device=args.device,
                                            spec=specrt.SpecConfig(max_batch_size=1),
                                            target_quantize=args.target_quantize)}
    for d in drafts:
        model_draft = not d.startswith(("ngram", "self:"))
        engines[f"speculative ({d})"] = specrt.LLM(
            target=args.target, draft=d, device=args.device,
            spec=specrt.SpecConfig(max_draft_length=args.draft_length, acceptance=args.acceptance,
                                   policy=args.policy, max_batch_size=1),
            target_quantize=args.target_quantize,
            draft_quantize=args.draft_quantize if model_draft else None,
            draft_dtype=args.draft_dtype if model_draft else None)
    for llm in engines.values():
        llm.warmup(2, 8)
    times: dict[str, list[float]] = {k: [] for k in engines}
    outs: dict[str, list] = {}
    for _ in range(args.repeats):          # alternate so every mode sees the same machine state
        for name, llm in engines.items():
            t0 = time.perf_counter()
            res = [llm.generate([t], params)[0] for t in texts]   # batch 1, one request at a time
            times[name].append(time.perf_counter() - t0)
            outs[name] = res
    ar = "autoregressive"
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ntok = {k: sum(len(o.token_ids) for o in v) for k, v in outs.items()}
    tps = {k: ntok[k] / med[k] for k in med}
    exact = args.temperature == 0 or args.acceptance == "coupled"
    print()
    print(f"{'mode':<28}{'tok/s':>8}{'speedup':>9}{'tok/fwd':>9}{'accepted':>10}  acceptance per draft position")
    ok = True
    for k in engines:
        stats = engines[k].stats()["total"]
        same = all(a.token_ids == b.token_ids for a, b in zip(outs[ar], outs[k]))
        ok &= same or not exact
        per_pos = " ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"]) if k != ar else "-"
        tpf = stats["tokens_per_target_forward"] if k != ar else 1.0
        acc = f"{stats['mean_accepted_length']:.2f}" if k != ar else "-"
        print(f"{k:<28}{tps[k]:>8.1f}{tps[k] / tps[ar]:>8.2f}x{tpf:>9.2f}{acc:>10}  {per_pos}"
              + ("" if same or not exact else "   (NOT token-identical!)"))
    if exact:
        print(f"\ntoken-identical to autoregressive decoding: {'yes, every mode' if ok else 'NO'}")
    print("(acceptance per position i: the share of steps whose drafts 0..i were all accepted)")
    name, text = prompts[0]
    first = next(k for k in engines if k != ar) if len(engines) > 1 else ar
    print(f"\nexample ({name}), {first}:\n---\n{text}\u2502{outs[first][0].text}\n---")
    return 0 if ok else 1


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
        "demo": demo,
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
