"""The benchmark's sections, one function each, and the run that strings them together.

- ``costs``       single target forwards for 1..K+1 tokens and single draft steps (bench.costs).
- ``categories``  code, docstring, repetition, free text; model, n-gram and self:N drafters;
                  speedup, tau, acceptance per position, fraction of the theoretical speedup.
- ``k_sweep``     fixed K vs the dynamic policies (confidence, head, budget); sum r^i vs measured.
- ``temperature`` 0, 0.7, 1.0 with rejection sampling and coupled acceptance.
- ``batch``       concurrency 1..32 under continuous batching: AR, fixed K, the budget policy.
- ``misaligned``  the draft sampled with another top-p / temperature than the target (a
                  ``wrap_drafter`` hook; the engine itself always aligns them).
- ``peer``        Hugging Face transformers greedy and assisted generation (bench.peer).
- ``penalties``   acceptance and tokens/s with and without penalties, per drafter (bench.penalties).
- ``batching``    admission by predicted acceptance vs FIFO on a mixed workload (bench.batching).
- ``long_context`` the draft's KV window vs the full-cache draft at long contexts (bench.long_context).
- ``speedup_estimate`` the runtime's speedup estimate vs the measured speedup (bench.speedup_estimate).
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import asdict

from bench.batching import section_batching
from bench.context import BenchContext
from bench.costs import expected_accepted, measure_costs, theoretical_speedup, v_at
from bench.machine import loadavg, machine_info
from bench.models import resolve_pair
from bench.long_context import section_long_context
from bench.peer import section_peer
from bench.penalties import section_penalties
from bench.runner import compare, median, median_interval, now, strip_ids
from bench.speedup_estimate import section_speedup_estimate
from bench.workloads import CATEGORIES, Settings

SECTIONS = ("costs", "categories", "k_sweep", "temperature", "batch", "misaligned", "peer", "penalties", "batching",
            "long_context", "speedup_estimate")
# what --quick runs unless --sections says otherwise (< ~10 min on a 2-core CPU); the rest run by name
QUICK_SECTIONS = ("costs", "categories", "k_sweep", "temperature", "batch", "misaligned", "peer", "penalties",
                  "speedup_estimate")


def section_costs(ctx: BenchContext) -> dict:
    llms = {name: ctx.llm(d, max_draft_length=ctx.s.draft_length) for name, d in ctx.drafters.items()}
    context = int(median([len(p) for p in ctx.pool()])) + ctx.s.max_tokens // 2
    return measure_costs(llms, max(ctx.s.ks), context, ctx.s.cost_reps)


def _add_theory(v: dict, ar: dict, c: float, costs: dict) -> None:
    """The cost model's speedup for a speculative mode, with costs from the ``costs`` section
    and with the engine's own draft/verify timers (incl. host overhead)."""
    k = v["drafted_tokens_per_step"]
    th = theoretical_speedup(v["tau"], c, k, v_at(costs, k))
    v["theoretical_speedup"] = th
    v["fraction_of_theoretical"] = v["speedup"] / th if th > 0 else float("nan")
    t1 = ar["verify_time_s"] / max(ar["steps"], 1)
    if t1 > 0 and v["steps"]:
        v["engine_c"] = (v["draft_time_s"] / v["steps"]) / max(k, 1e-9) / t1 if k else 0.0
        v["engine_v"] = (v["verify_time_s"] / v["steps"]) / t1 - 1.0


def section_categories(ctx: BenchContext, costs: dict) -> dict:
    K = ctx.s.draft_length
    modes = {"ar": (ctx.llm(None), ctx.params())}
    for name, d in ctx.drafters.items():
        modes[name] = (ctx.llm(d, max_draft_length=K), ctx.params())
    out = {}
    for cat in CATEGORIES:
        res = compare(modes, [p.token_ids for p in ctx.prompts[cat]], ctx.s.repeats)
        for m, v in res.items():
            if m != "ar":
                _add_theory(v, res["ar"], costs["c"][m], costs)
        out[cat] = strip_ids(res)
    return out


def section_k_sweep(ctx: BenchContext) -> dict:
    d = ctx.drafters[ctx.main_drafter]
    modes = {"ar": (ctx.llm(None), ctx.params())}
    for k in ctx.s.ks:   # chains of K tokens: the default's planner-sized trees are section_categories'
        modes[f"fixed_K{k}"] = (ctx.llm(d, max_draft_length=k, tree="chain"), ctx.params())
    skipped = {}
    for pol in ("confidence", "head", "budget"):
        try:
            modes[pol] = (ctx.llm(d, policy=pol, max_draft_length=max(ctx.s.ks)), ctx.params())
        except ValueError as e:
            skipped[pol] = str(e)
            ctx.log(f"  k_sweep: policy {pol} skipped: {e}")
    res = compare(modes, ctx.sweep_prompts(), ctx.s.repeats)
    fixed = {k: res[f"fixed_K{k}"] for k in ctx.s.ks}
    best_k = max(fixed, key=lambda k: fixed[k]["speedup"])
    best = fixed[best_k]["speedup"]
    policies = {p: {"speedup": res[p]["speedup"], "gain_over_best_fixed": res[p]["speedup"] / best - 1.0,
                    "mean_draft_length": res[p]["drafted_tokens_per_step"], "tau": res[p]["tau"],
                    "identical_to_ar": res[p]["identical_to_ar"]}
                for p in ("confidence", "head", "budget") if p in res}
    r, expected = expected_accepted(fixed)
    # the engine's own count of P(i accepted | 0..i-1 accepted): never above 1
    conditional = fixed[max(ctx.s.ks)]["conditional_acceptance_per_position"]
    return {"drafter": ctx.main_drafter, "r": r, "modes": strip_ids(res), "best_fixed_k": best_k,
            "best_fixed_speedup": best, "policies": policies, "skipped": skipped,
            "expected_accepted": expected, "conditional_acceptance_at_kmax": conditional}


def section_temperature(ctx: BenchContext) -> dict:
    d = ctx.drafters[ctx.main_drafter]
    K = ctx.s.draft_length
    out = {}
    for t in ctx.s.temperatures:
        modes = {"ar": (ctx.llm(None), ctx.params(t)),
                 "rejection": (ctx.llm(d, max_draft_length=K), ctx.params(t)),
                 "coupled": (ctx.llm(d, max_draft_length=K, acceptance="coupled"), ctx.params(t))}
        out[str(t)] = strip_ids(compare(modes, ctx.sweep_prompts(), ctx.s.repeats))
    return {"drafter": ctx.main_drafter, "draft_length": K, "by_temperature": out}


def _batch_modes(ctx: BenchContext, params: list) -> dict:
    d = ctx.drafters[ctx.main_drafter]
    K = ctx.s.draft_length
    ar = ctx.llm(None)
    # "ar_again" runs the same AR engine a second time: its ratio to "ar" is this machine's
    # noise at this batch size, measured in the same alternating run
    modes = {"ar": (ar, params), "ar_again": (ar, params),
             "fixed": (ctx.llm(d, max_draft_length=K), params),
             "budget": (ctx.llm(d, policy="budget", max_draft_length=K), params)}
    if ctx.main_drafter != "ngram":
        # the free n-gram drafter too: where drafting pays, the budget policy must draft
        modes["ngram_fixed"] = (ctx.llm("ngram", max_draft_length=K), params)
        modes["ngram_budget"] = (ctx.llm("ngram", policy="budget", max_draft_length=K), params)
    return modes


def _batch_checks(out: dict) -> dict:
    """Where each budget policy fell below AR (strictly, by 3%, beyond the AR-vs-AR noise,
    significantly), and every mode's paired ratios pooled over the batch sizes."""
    noise = {B: abs(1.0 - r["ar_again"]["speedup"]) for B, r in out.items()}
    tol = {B: max(0.02, n) for B, n in noise.items()}
    res = {"ar_vs_ar_noise": noise}
    for m in ("budget", "ngram_budget"):
        if not all(m in r for r in out.values()):
            continue
        viol = [B for B, r in out.items() if r[m]["speedup"] < 1.0]
        res[f"{m}_below_ar_at"] = viol
        res[f"{m}_below_ar_by_3pct_at"] = [B for B, r in out.items() if r[m]["speedup"] < 0.97]
        res[f"{m}_below_ar_beyond_noise_at"] = [B for B, r in out.items() if r[m]["speedup"] < 1.0 - tol[B]]
        res[f"{m}_never_below_ar"] = not viol
        res[f"{m}_never_below_ar_beyond_noise"] = not res[f"{m}_below_ar_beyond_noise_at"]
        # the statistical reading: the ~95% interval of the paired median lies wholly under 1
        res[f"{m}_below_ar_significant_at"] = [B for B, r in out.items() if r[m]["speedup_interval"][1] < 1.0]
    # pooled over the batch sizes the median's interval is about half as wide as one size's;
    # "ar_again" pooled is what "equal to AR" looks like on this machine
    for m in ("ar_again", "budget", "ngram_budget", "fixed", "ngram_fixed"):
        pooled = [x for r in out.values() if m in r for x in r[m].get("speedup_ratios", [])]
        if pooled:
            lo, hi, cov = median_interval(pooled)
            res[f"{m}_pooled"] = {"speedup": median(pooled), "interval": [lo, hi], "coverage": cov,
                                  "n": len(pooled)}
    return res


def section_batch(ctx: BenchContext) -> dict:
    pool = ctx.pool()
    mt = ctx.s.batch_max_tokens
    out = {}
    for B in ctx.s.batch_sizes:
        # concurrency B under continuous batching: batch_requests_per_slot * B requests of varied
        # length (batch_max_tokens/2 .. 3/2 of it), at most B in flight, a finished one replaced
        # at once; so every mode runs at batch B most of the time, not a tail of stragglers
        n = B * ctx.s.batch_requests_per_slot
        prompts = [pool[i % len(pool)] for i in range(n)]
        params = [ctx.params(max_tokens=max(1, mt // 2 + (i * 7) % (mt + 1))) for i in range(n)]
        out[str(B)] = strip_ids(compare(_batch_modes(ctx, params), prompts,
                                        max(ctx.s.repeats, ctx.s.batch_repeats), concurrency=B))
    checks = _batch_checks(out)
    return {"drafter": ctx.main_drafter, "draft_length": ctx.s.draft_length, "max_tokens": mt,
            "requests_per_slot": ctx.s.batch_requests_per_slot, "mode": "continuous batching",
            "by_batch_size": out, "ar_vs_ar_noise": checks.pop("ar_vs_ar_noise"), **checks}


MISALIGNED_CASES = {   # name -> (target temperature, the draft's sampling parameters)
    "greedy_target__draft_top_p_0.9_T1": (0.0, {"temperature": 1.0, "top_p": 0.9}),
    "target_T0.7__draft_T1.0": (0.7, {"temperature": 1.0}),
    "target_T0.7__draft_T0.3": (0.7, {"temperature": 0.3}),
}


def section_misaligned(ctx: BenchContext) -> dict:
    d = ctx.drafters[ctx.main_drafter]
    K = ctx.s.draft_length
    out = {}
    for name, (t, mis) in list(MISALIGNED_CASES.items())[:ctx.s.misaligned_cases]:
        modes = {"ar": (ctx.llm(None), ctx.params(t)),
                 "aligned": (ctx.llm(d, max_draft_length=K), ctx.params(t)),
                 "misaligned": (ctx.llm(d, misalign=mis, max_draft_length=K), ctx.params(t))}
        out[name] = strip_ids(compare(modes, ctx.sweep_prompts(), ctx.s.repeats))
        out[name]["draft_params"] = mis
        out[name]["target_temperature"] = t
    return {"drafter": ctx.main_drafter, "draft_length": K, "cases": out}


def _meta(ctx: BenchContext, settings: Settings) -> dict:
    return {"date": _dt.date.today().isoformat(), "machine": machine_info(ctx.device), "target": ctx.target,
            "load_average_start": loadavg(), "draft": ctx.draft, "note": ctx.note, "settings": asdict(settings),
            "prompts": {c: [p.name for p in v] for c, v in ctx.prompts.items()},
            "prompt_tokens": {c: [len(p.token_ids) for p in v] for c, v in ctx.prompts.items()},
            "main_drafter": ctx.main_drafter, "drafters": ctx.drafters}


def run_all(target="builtin", draft="builtin", device=None, settings: Settings | None = None,
            sections=SECTIONS, log=print, on_section=None) -> dict:
    """Run the sections in the order given (costs first whenever categories runs);
    on_section(res) after each one (e.g. to write partial results)."""
    settings = settings or Settings()
    target, draft, note = resolve_pair(target, draft, log)
    t_start = now()
    ctx = BenchContext(target, draft, device, settings, log, note)
    res = {"meta": _meta(ctx, settings)}
    order = [x for x in sections if x in SECTIONS and x != "costs"]
    if "costs" in sections or "categories" in sections:
        order.insert(0, "costs")
    run = {"costs": section_costs, "categories": lambda c: section_categories(c, res["costs"]),
           "k_sweep": section_k_sweep, "temperature": section_temperature, "batch": section_batch,
           "misaligned": section_misaligned, "peer": section_peer, "penalties": section_penalties,
           "batching": section_batching, "long_context": section_long_context,
           "speedup_estimate": section_speedup_estimate}
    for sec in order:
        t0 = now()
        log(f"specrt bench: {sec} ...")
        res[sec] = run[sec](ctx)
        res["meta"].setdefault("section_seconds", {})[sec] = now() - t0
        log(f"specrt bench: {sec} done in {now() - t0:.1f}s")
        if on_section is not None:
            res["meta"]["total_seconds"] = now() - t_start
            on_section(res)
    res["meta"]["total_seconds"] = now() - t_start
    res["meta"]["load_average_end"] = loadavg()
    return res
