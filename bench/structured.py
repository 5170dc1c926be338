"""Structured output on SmolLM2-135M (issue 36): what the token masks cost, whether the outputs
validate, and what speculation gains with a JSON schema.

    PYTHONPATH=. python -m bench.structured                       # both sections, 2 repeats
    PYTHONPATH=. python -m bench.structured --sections masks      # the mask libraries only

Schemas and prompts: bench/structured_schemas.json (50 schemas written for this benchmark: nested
objects, enums, arrays, numbers with ranges, strings with patterns; each with a valid example).

masks: time per token on the target's tokenizer (49,152 tokens) of a mask and the matcher's
advance over the token: each schema's example, tokenized, walked token by token; the first walk
after compiling ("cold") and later walks ("warm"); compile time per schema (llguidance's
includes the first mask, as specrt.structured.GrammarCompiler computes it). llguidance always (what specrt
uses); xgrammar too when it is importable (it is not a specrt dependency). Also: the compile time of
the largest schema a request may send and how long another thread waited meanwhile, and the fused
bitmask op against torch's unpack + masked_fill.

generate: greedy, batch 1, chat-templated prompts (the schema in the prompt text), up to
--max-tokens new tokens. Modes, alternated per prompt in a seeded random order within each
repeat: ar_schema (autoregressive with the schema), ar_free (no schema, exactly as many tokens as
ar_schema's output for that prompt: the same prefill and decode steps), ar_schema_open (--open:
with the schema, structured_close=False: the grammar's mask alone, no closing within the budget),
and for each K spec_schema_kK / spec_free_kK (the draft, a chain of K, fixed policy). Reported:
outputs that validate (jsonschema), speculative == AR token for token, tokens/s, the paired
per-repeat ratios ar_schema/ar_free, ar_schema/ar_schema_open, spec_schema/ar_schema and
spec_free/ar_free (median and its interval), acceptance per position with and without the
schema, and per schema mode the outputs the budget rule narrowed a row of (closed_by_budget;
specrt.structured.narrowed_positions) and, for ar_schema, how many differ from ar_schema_open.
Writes one JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from bench.runner import median, median_interval, shared_loader, write_json

SCHEMAS = Path(__file__).with_name("structured_schemas.json")


def load_cases() -> list[dict]:
    return json.loads(SCHEMAS.read_text())


def _valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:          # without jsonschema: parsed, and the required keys are there
        return isinstance(value, dict) and all(k in value for k in schema.get("required", []))
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


# ------------------------------------------------------------------------------- masks
def _walk(fill, consume, reset, tokens) -> list[float]:
    times = []
    reset()
    for t in tokens:
        t0 = time.perf_counter()
        fill()
        consume(t)
        times.append(time.perf_counter() - t0)
    return times


def _summary(cold: list[float], warm: list[float], compile_s: list[float], init_s: float) -> dict:
    us = lambda xs: sorted(x * 1e6 for x in xs)   # noqa: E731
    c, w = us(cold), us(warm)
    return {"tokenizer_init_s": round(init_s, 3), "compile_ms_median": round(median(compile_s) * 1e3, 2),
            "compile_ms_max": round(max(compile_s) * 1e3, 2),
            "cold_us_per_token_mean": round(statistics.mean(c), 1), "cold_us_per_token_p99": round(c[int(.99 * len(c))], 1),
            "warm_us_per_token_mean": round(statistics.mean(w), 1), "warm_us_per_token_median": round(median(w), 1),
            "warm_us_per_token_p99": round(w[int(.99 * len(w))], 1), "tokens": len(c)}


def masks(target: str, warm_walks: int) -> dict:
    import numpy as np

    from specrt.models import load_tokenizer
    from specrt.models.registry import resolve_model
    from specrt.structured import GrammarCompiler, JSON_OPTIONS, Structured

    tok = load_tokenizer(resolve_model(target, "target"))
    V, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    cases = load_cases()
    seps = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
    walks = [tok.encode(json.dumps(c["example"], separators=seps), add_special_tokens=False) + eos[:1] for c in cases]
    out = {}

    t0 = time.perf_counter()
    comp = GrammarCompiler(tok, V, eos)
    comp.ll_tokenizer()
    init = time.perf_counter() - t0
    cold, warm, compile_s = [], [], []
    bitmask = np.zeros((1, (V + 31) // 32), np.int32)
    for c, toks in zip(cases, walks):
        t0 = time.perf_counter()
        g = comp.compile(Structured("json_schema", c["schema"]))
        compile_s.append(time.perf_counter() - t0)
        m = g.matcher()
        fill = lambda: m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)   # noqa: E731
        consume = lambda t: m.consume_token(t)                                           # noqa: E731
        cold += _walk(fill, consume, m.reset, toks)
        assert not m.is_error(), m.get_error()
        for _ in range(warm_walks):
            warm += _walk(fill, consume, m.reset, toks)
    out["llguidance"] = _summary(cold, warm, compile_s, init)
    print("llguidance", out["llguidance"], flush=True)
    out["compile_bounds"] = compile_bounds(comp)
    out["bitmask_op"] = bitmask_op(V)
    print("compile bounds", out["compile_bounds"], "bitmask op", out["bitmask_op"], flush=True)

    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        out["xgrammar"] = "not installed"
        return out
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer), vocab_size=V,
                                              stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    init = time.perf_counter() - t0
    cold, warm, compile_s = [], [], []
    bm = xgr.allocate_token_bitmask(1, V)
    for c, toks in zip(cases, walks):
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(c["schema"]), any_whitespace=False, separators=seps)
        compile_s.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(cg)
        fill = lambda: m.fill_next_token_bitmask(bm, 0)   # noqa: E731
        consume = lambda t: m.accept_token(t)             # noqa: E731
        cold += _walk(fill, consume, m.reset, toks)
        assert m.is_terminated()
        for _ in range(warm_walks):
            warm += _walk(fill, consume, m.reset, toks)
    out["xgrammar"] = _summary(cold, warm, compile_s, init)
    print("xgrammar", out["xgrammar"], flush=True)
    return out


def compile_bounds(comp) -> dict:
    """What the largest schema a request may send costs to compile (a synthetic one just under
    specrt.structured.MAX_SPEC_CHARS), and the longest a 1 ms ticker thread (standing in for the
    step thread) waited meanwhile: the compile runs off the step thread and releases the GIL."""
    import threading

    from specrt.structured import MAX_SPEC_CHARS, Structured

    def schema(n: int) -> str:
        item = lambda i: {"type": "object", "required": ["a", "b", "c"], "properties": {   # noqa: E731
            "a": {"type": "string", "pattern": "[a-z]{3,9}-[0-9]{2,5}"},
            "b": {"enum": [f"v{i}_{j}" for j in range(50)]},
            "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}}}}
        return json.dumps({"type": "object", "required": [f"f{i}" for i in range(n)],
                           "properties": {f"f{i}": item(i) for i in range(n)}})

    n = 1
    while len(schema(2 * n)) < MAX_SPEC_CHARS:
        n *= 2
    while len(schema(n + 64)) < MAX_SPEC_CHARS:
        n += 64
    spec = schema(n)
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=tick)
    th.start()
    t0 = time.perf_counter()
    comp.compile(Structured("json_schema", spec))
    seconds = time.perf_counter() - t0
    stop.set()
    th.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])] or [0.0]
    return {"schema_chars": len(spec), "compile_s": round(seconds, 4), "longest_tick_gap_s": round(max(gaps), 4)}


def bitmask_op(V: int, rows: int = 40, repeats: int = 20) -> dict:
    """specrt's fused apply_token_bitmask against torch's unpack + masked_fill over the same rows
    (a grammar state: ~300 allowed tokens per row), medians in microseconds, in one run."""
    from specrt import ops

    g = torch.Generator().manual_seed(0)
    words = torch.zeros(rows, (V + 31) // 32, dtype=torch.int32)
    for i in range(rows):
        idx = torch.randperm(V, generator=g)[:300]
        for t in idx.tolist():
            words[i, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    logits = torch.randn(rows, V, generator=g)
    bit = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)

    def torch_mask(x):
        x.masked_fill_(((words[:, :, None] & bit) == 0).view(rows, -1)[:, :V], float("-inf"))

    def timed(fn) -> float:
        out = []
        for _ in range(repeats):
            x = logits.clone()
            t0 = time.perf_counter()
            fn(x)
            out.append(time.perf_counter() - t0)
        return median(out) * 1e6

    a, b = logits.clone(), logits.clone()
    ops.apply_token_bitmask(a, words)
    torch_mask(b)
    assert torch.equal(a, b)
    fused, ref = timed(lambda x: ops.apply_token_bitmask(x, words, check_values=False)), timed(torch_mask)
    return {"rows": rows, "vocab": V, "fused_us": round(fused, 1), "torch_us": round(ref, 1),
            "speedup": round(ref / fused, 2)}


# ------------------------------------------------------------------------------- generation
def _prompt(tokenizer, case: dict) -> list[int]:
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer with JSON only."},
            {"role": "user", "content": f"{case['prompt']} Use this JSON schema: {json.dumps(case['schema'])}"}]
    return tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)


def generate(args) -> dict:
    from specrt import LLM, SamplingParams, SpecConfig
    from specrt.structured import narrowed_positions
    from specrt.structured import Structured

    store: dict = {}
    loader = shared_loader(store)
    # the draft model's chains alone (no suffix lookup: the schema and free modes share an engine,
    # and one would draft from the other's answer to the same prompt)
    spec = lambda k: SpecConfig(max_draft_length=k, policy="fixed", tree="chain", lookup=None)   # noqa: E731
    ar = LLM(target=args.target, draft=None, spec=spec(1), device="cpu", dtype=args.dtype, model_loader=loader)
    engines = {"ar": ar}
    for k in args.ks:
        engines[f"k{k}"] = LLM(target=args.target, draft=args.draft, spec=spec(k), device="cpu", dtype=args.dtype,
                               model_loader=loader)
    if args.default:   # what a user who names the draft gets; one engine per mode (suffix lookup)
        for kind in ("free", "schema"):
            engines[f"default_{kind}"] = LLM(target=args.target, draft=args.draft, spec=SpecConfig(), device="cpu",
                                             dtype=args.dtype, model_loader=loader)
    cases = load_cases()[:args.schemas]
    prompts = [_prompt(ar.tokenizer, c) for c in cases]
    schema = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=Structured("json_schema",
                                                                                                c["schema"]))
              for c in cases]
    # free text of the same length as each schema's output (same prompt, same prefill, same decode
    # steps): tokens/s then compares the cost of a token with and without the mask
    lengths = [len(ar.generate([p], sp)[0].token_ids) for p, sp in zip(prompts, schema)]   # batch 1, as timed
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    open_ = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_close=False,
                            structured=sp.structured) for sp in schema]
    modes = {"ar_free": ("ar", None), "ar_schema": ("ar", "schema")}
    if args.open:
        modes["ar_schema_open"] = ("ar", "open")
    for k in args.ks:
        modes[f"spec_free_k{k}"] = (f"k{k}", None)
        modes[f"spec_schema_k{k}"] = (f"k{k}", "schema")
    if args.default:
        modes["spec_free_default"] = ("default_free", None)
        modes["spec_schema_default"] = ("default_schema", "schema")

    def run(m: str, i: int):
        eng, kind = modes[m]
        params = {"schema": schema[i], "open": open_[i], None: free[i]}[kind]
        return engines[eng].generate([prompts[i]], params, tags=[m])[0]

    for i in range(len(cases)):   # warm-up: kernels, grammars compiled, and every engine holding every
        for m in modes:           # prompt in its prefix cache (else an engine serving one mode prefills
            run(m, i)             # cold where one serving two finds its other mode's blocks)
    for llm in engines.values():
        llm.engine.reset_metrics()
    secs = {m: [0.0] * args.repeats for m in modes}
    toks = {m: [0] * args.repeats for m in modes}
    outs: dict = {m: [None] * len(cases) for m in modes}
    for rep in range(args.repeats):
        for llm in engines.values():
            llm.engine.forget_outputs()
        for i in range(len(cases)):
            order = list(modes)
            random.Random(1000 * rep + i).shuffle(order)
            for m in order:
                t0 = time.perf_counter()
                o = run(m, i)
                secs[m][rep] += time.perf_counter() - t0
                toks[m][rep] += len(o.token_ids)
                outs[m][i] = o
        print(f"repeat {rep}: " + "  ".join(f"{m} {toks[m][rep] / secs[m][rep]:.1f} tok/s" for m in modes), flush=True)

    def ratio(a: str, b: str) -> dict:
        rs = [(toks[a][r] / secs[a][r]) / (toks[b][r] / secs[b][r]) for r in range(args.repeats)]
        lo, hi, cov = median_interval(rs)
        return {"median": round(median(rs), 3), "interval": [round(lo, 3), round(hi, 3)],
                "coverage": round(cov, 3), "per_repeat": [round(x, 3) for x in rs]}

    res: dict = {"modes": {}, "ratios": {"ar_schema/ar_free": ratio("ar_schema", "ar_free")}}
    if args.open:
        res["ratios"]["ar_schema/ar_schema_open"] = ratio("ar_schema", "ar_schema_open")
    for k in args.ks:
        res["ratios"][f"spec_schema_k{k}/ar_schema"] = ratio(f"spec_schema_k{k}", "ar_schema")
        res["ratios"][f"spec_free_k{k}/ar_free"] = ratio(f"spec_free_k{k}", "ar_free")
    if args.default:
        res["ratios"]["spec_schema_default/ar_schema"] = ratio("spec_schema_default", "ar_schema")
        res["ratios"]["spec_free_default/ar_free"] = ratio("spec_free_default", "ar_free")
    for m, (eng, kind) in modes.items():
        st = engines[eng].stats().get("by_tag", {}).get(m, {})
        row = {"tokens_per_s": round(median([toks[m][r] / secs[m][r] for r in range(args.repeats)]), 2),
               "tokens_per_request": round(toks[m][-1] / len(cases), 1),
               "tau": round(st.get("tokens_per_target_forward", 1.0), 3),
               "acceptance_per_position": [round(a, 3) for a in st.get("acceptance_rate_per_position", [])],
               "finish_reasons": {r: sum(o.finish_reason == r for o in outs[m]) for r in ("stop", "length")}}
        if kind:
            row["valid"] = sum(_valid(o.text, c["schema"]) for o, c in zip(outs[m], cases))
            row["valid_rate"] = round(row["valid"] / len(cases), 3)
            row["identical_to_ar_schema"] = [o.token_ids for o in outs[m]] == [o.token_ids for o in outs["ar_schema"]]
        if kind == "schema":    # outputs whose rows the budget rule narrowed (a replay of each output)
            e = engines[eng].engine
            row["closed_by_budget"] = sum(bool(narrowed_positions(
                e.intake.compile_structured(sp.structured), o.token_ids,
                min(sp.max_tokens, e.max_model_len - len(p)))) for o, sp, p in zip(outs[m], schema, prompts))
            if m == "ar_schema" and args.open:
                row["changed_by_budget"] = sum(a.token_ids != b.token_ids
                                               for a, b in zip(outs[m], outs["ar_schema_open"]))
        if not kind:
            row["same_length_as_ar_schema"] = [len(o.token_ids) for o in outs[m]] == [len(o.token_ids)
                                                                                for o in outs["ar_schema"]]
            row["identical_to_ar_free"] = [o.token_ids for o in outs[m]] == [o.token_ids for o in outs["ar_free"]]
        res["modes"][m] = row
        print(m, row, flush=True)
    print("ratios", res["ratios"], flush=True)
    res["examples"] = {c["name"]: outs["ar_schema"][i].text for i, c in enumerate(cases[:3])}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ks", default="2,4", help="draft lengths of the speculative modes")
    ap.add_argument("--default", action=argparse.BooleanOptionalAction, default=True,
                    help="also the default engine (SpecConfig(): trees, suffix lookup, forced drafts)")
    ap.add_argument("--open", action=argparse.BooleanOptionalAction, default=True,
                    help="also ar_schema_open: the schema with structured_close=False (the grammar's mask alone)")
    ap.add_argument("--sections", default="masks,generate")
    ap.add_argument("--schemas", type=int, default=None, help="how many of the schemas (from the first; default: all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm-walks", type=int, default=3, help="masks: walks after the cold one")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--machine", default=None, help="a description of the machine for the report")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/structured.json)")
    args = ap.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",") if k]
    torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    report = {"date": args.date, "machine": args.machine, "args": {k: v for k, v in vars(args).items()},
              "torch_threads": args.threads}
    try:
        from importlib.metadata import version
        report["versions"] = {p: version(p) for p in ("llguidance", "torch")}
        try:
            report["versions"]["xgrammar"] = version("xgrammar")
        except Exception:  # noqa: BLE001 - not installed
            pass
    except Exception:  # noqa: BLE001
        pass
    if "masks" in sections:
        report["masks"] = masks(args.target, args.warm_walks)
    if "generate" in sections:
        report["generate"] = generate(args)
    write_json(report, args.out or os.path.join("bench", "results", "structured.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
