"""`specrt demo | serve | bench | distill | train` — the command line.

    specrt demo                       # built-in pair: autoregressive vs speculative, same run
    specrt serve --target-model builtin --draft-model builtin --speculative-decoding
    specrt bench --quick [--out DIR]  # end-to-end benchmark report
    specrt distill ...                # draft-model tools (layer-init, distillation, acceptance head)
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
    p.add_argument("--draft", default="builtin", help="draft model folder, 'builtin', 'ngram' or 'self:N'")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--acceptance", default="rejection", choices=["rejection", "coupled"])
    p.add_argument("--policy", default="fixed", choices=["fixed", "confidence", "head", "budget"])
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    import specrt

    if args.device in (None, "cpu"):
        torch.set_num_threads(max(1, torch.get_num_threads()))
    prompts = _demo_prompts(args.prompts)
    texts = [t for _, t in prompts]
    params = specrt.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                   seed=1234)
    print(f"specrt demo: target={args.target} draft={args.draft} K={args.draft_length} "
          f"T={args.temperature} acceptance={args.acceptance} policy={args.policy}", flush=True)
    ar = specrt.LLM(target=args.target, draft=None, device=args.device,
                    spec=specrt.SpecConfig(max_batch_size=1))
    sp = specrt.LLM(target=args.target, draft=args.draft, device=args.device,
                    spec=specrt.SpecConfig(max_draft_length=args.draft_length, acceptance=args.acceptance,
                                           policy=args.policy, max_batch_size=1))
    ar.warmup(2, 8)
    sp.warmup(2, 8)
    times = {"autoregressive": [], "speculative": []}
    outs = {}
    for _ in range(args.repeats):          # alternate so both see the same machine state
        for name, llm in (("autoregressive", ar), ("speculative", sp)):
            t0 = time.perf_counter()
            res = [llm.generate([t], params)[0] for t in texts]   # batch 1, one request at a time
            times[name].append(time.perf_counter() - t0)
            outs[name] = res
    ntok = {k: sum(len(o.token_ids) for o in v) for k, v in outs.items()}
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    tps = {k: ntok[k] / med[k] for k in med}
    same = all(a.token_ids == b.token_ids for a, b in zip(outs["autoregressive"], outs["speculative"]))
    stats = sp.stats()["total"]
    print()
    print(f"{'mode':<16}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}")
    for k in ("autoregressive", "speculative"):
        print(f"{k:<16}{ntok[k]:>8}{med[k]:>10.2f}{tps[k]:>11.1f}")
    print(f"\nspeedup: {tps['speculative'] / tps['autoregressive']:.2f}x   "
          f"mean accepted length: {stats['mean_accepted_length']:.2f}   "
          f"tokens per target forward: {stats['tokens_per_target_forward']:.2f}")
    if args.temperature == 0 or args.acceptance == "coupled":
        print(f"token-identical to autoregressive: {'yes' if same else 'NO'}")
    print("\nacceptance per draft position:")
    print("  " + "  ".join(f"{i}:{r:.2f}" for i, r in enumerate(stats["acceptance_rate_per_position"])))
    name, text = prompts[0]
    print(f"\nexample ({name}):\n---\n{text}\u2502{outs['speculative'][0].text}\n---")
    return 0 if (same or (args.temperature > 0 and args.acceptance == "rejection")) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": demo,
        "serve": lambda a: __import__("specrt.server", fromlist=["main"]).main(a),
        "bench": lambda a: __import__("specrt.benchmarks", fromlist=["main"]).main(a),
        "distill": lambda a: __import__("specrt.training.distill", fromlist=["main"]).main(a),
        "train": lambda a: __import__("specrt.training.pretrain", fromlist=["main"]).main(a),
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
