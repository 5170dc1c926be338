"""The benchmark's written results: results.json, report.md (a headline table, then one
part per section) and the few terminal lines. Everything here reads the JSON form of the
results (string keys, NaN as null)."""
from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path

from bench import batching, long_context, penalties, speedup_estimate
from bench.machine import machine_info, machine_tag
from bench.plots import write_plots
from bench.text import fmt, md_table, yes
from bench.workloads import CATEGORIES

# the sections whose module renders its own part: name -> module (report_md, headline_rows)
RENDERED_BY_SECTION = {"penalties": penalties, "batching": batching, "long_context": long_context,
                       "speedup_estimate": speedup_estimate}


def headline_table(res: dict) -> str:
    """The few numbers that matter, as a markdown table: report.md's Headline section."""
    L = ["| measurement | result |", "|---|---|"]
    cats = res.get("categories")
    if cats:
        for cat in CATEGORIES:
            L.append(f"| speedup, {cat} (greedy, batch 1, K={res['meta']['settings']['draft_length']}) | " + ", ".join(
                f"{d} {fmt(v['speedup'])}x (tau {fmt(v['tau'])})" for d, v in cats[cat].items() if d != "ar") + " |")
    ks = res.get("k_sweep")
    if ks:
        L.append(f"| best fixed K ({ks['drafter']}) | K={ks['best_fixed_k']}: {fmt(ks['best_fixed_speedup'])}x |")
        for p, v in ks["policies"].items():
            L.append(f"| {p} policy vs best fixed K | {fmt(v['speedup'])}x ({v['gain_over_best_fixed'] * 100:+.1f}%, "
                     f"mean K {fmt(v['mean_draft_length'])}) |")
        for p in ks["skipped"]:
            L.append(f"| {p} policy | not run (see below) |")
    bt = res.get("batch")
    if bt:
        L.append("| batch size: speedup fixed / budget | " + ", ".join(
            f"B={b}: {fmt(r['fixed']['speedup'])} / {fmt(r['budget']['speedup'])}"
            for b, r in bt["by_batch_size"].items()) + " |")
        if all("speedup_interval" in r["budget"] for r in bt["by_batch_size"].values()):
            L.append("| budget policy (model): ~95% interval of the paired median | " + ", ".join(
                f"B={b}: {fmt(r['budget']['speedup_interval'][0])}-{fmt(r['budget']['speedup_interval'][1])}"
                for b, r in bt["by_batch_size"].items()) + " |")
        if "ngram_budget_never_below_ar" in bt:
            L.append("| batch size, n-gram drafter: speedup fixed / budget | " + ", ".join(
                f"B={b}: {fmt(r['ngram_fixed']['speedup'])} / {fmt(r['ngram_budget']['speedup'])}"
                for b, r in bt["by_batch_size"].items()) + " |")
        for m, label in (("budget", f"budget policy ({bt['drafter']})"), ("ngram_budget", "budget policy (n-gram)")):
            if f"{m}_never_below_ar" not in bt:
                continue
            ok, ok_noise = bt[f"{m}_never_below_ar"], bt[f"{m}_never_below_ar_beyond_noise"]
            L.append(f"| {label} >= AR at every batch size | {'yes' if ok else 'NO'}"
                     + ("" if ok else f" (within this run's AR-vs-AR noise: {'yes' if ok_noise else 'NO'})") + " |")
    pr = res.get("peer")
    if pr and "skipped" not in pr:
        i = pr["identity"]["spec_vs_hf_assisted"]
        L.append(f"| vs transformers assisted generation (tokens/s ratio) | {fmt(pr['ratio_spec_vs_hf_assisted'])}x; "
                 f"identical outputs {i['identical_sequences']}/{i['of']} |")
        L.append(f"| specrt AR vs transformers greedy | {fmt(pr['ratio_ar_vs_hf_greedy'])}x |")
    return "\n".join(L + _section_headlines(res))


def _section_headlines(res: dict) -> list[str]:
    """Headline rows of the sections that render their own part."""
    return [row for key, mod in RENDERED_BY_SECTION.items() if res.get(key) for row in mod.headline_rows(res[key])]


def _costs_md(c: dict) -> list[str]:
    """Measured costs (single forwards)."""
    L = ["## Measured costs (single forwards, this run)", "",
         f"Context {c['context_tokens']} tokens. Target step for T verified tokens:", "",
         "| T | " + " | ".join(str(t) for t in c["target_step_s"]) + " |",
         "|---|" + "---|" * len(c["target_step_s"]),
         "| ms | " + " | ".join(fmt(v * 1e3) for v in c["target_step_s"].values()) + " |", "",
         "v(K) = t(K+1)/t(1) - 1: " + ", ".join(f"K={k}: {fmt(v)}" for k, v in c["v"].items()), "",
         "Draft step cost c relative to one target step: " +
         ", ".join(f"{k}: {fmt(v, 3)} ({fmt(c['draft_step_s'][k] * 1e3, 3)} ms)" for k, v in c["c"].items()), ""]
    return L


def _categories_md(cats: dict) -> list[str]:
    """Speedup per prompt category."""
    rows = [[cat, d, fmt(v["tokens_per_s"], 1), fmt(v["speedup"]), fmt(v["tau"]), fmt(v["mean_accepted_length"]),
             " ".join(fmt(a) for a in v["acceptance_rate_per_position"]), fmt(v.get("theoretical_speedup")),
             fmt(v.get("fraction_of_theoretical")), fmt(v.get("engine_c")), fmt(v.get("engine_v")),
             yes(v["identical_to_ar"])]
            for cat in CATEGORIES for d, v in cats[cat].items()]
    return (["## Speedup per prompt category", "",
             "theory = tau / (1 + c*K + v) with c, v measured above and K the mean draft length; "
             "frac = measured speedup / theory. engine c/v: the same quantities as the engine timed "
             "them inside the runs (including host overhead).", ""]
            + md_table(["category", "drafter", "tokens/s", "speedup", "tau", "mean acc. len",
                        "acc. per position (cumulative)", "theory", "frac", "engine c", "engine v", "= AR"], rows)
            + [""])


def _k_sweep_md(ks: dict) -> list[str]:
    """Fixed K vs the dynamic policies; expected accepted drafts."""
    L = [f"## Fixed K vs dynamic policies ({ks['drafter']} drafter)", ""]
    L += md_table(["mode", "tokens/s", "speedup", "mean K", "tau", "= AR"],
                  [[name, fmt(v["tokens_per_s"], 1), fmt(v["speedup"]), fmt(v["drafted_tokens_per_step"]),
                    fmt(v["tau"]), yes(v.get("identical_to_ar"))] for name, v in ks["modes"].items()])
    L += ["", f"Best fixed K = {ks['best_fixed_k']} ({fmt(ks['best_fixed_speedup'])}x). Gain of each dynamic "
              f"policy over it (published state of the art for learned adaptive length: +7 to +11%):", ""]
    L += [f"- {p}: {fmt(v['speedup'])}x, {v['gain_over_best_fixed'] * 100:+.1f}% (mean K {fmt(v['mean_draft_length'])})"
          for p, v in ks["policies"].items()]
    L += [f"- {p}: not run ({why})" for p, why in ks["skipped"].items()]
    cond = ks.get("conditional_acceptance_at_kmax") or []
    L += ["", f"Expected accepted drafts per step: E = sum_(i=1..K) r^i with r = {fmt(ks['r'])} (first-position "
              "acceptance at the smallest K), and the sum of the first K survival rates measured at the largest "
              "K (the engine's per-position acceptance with a fixed K is P(drafts 0..i all accepted)). Conditional "
              "acceptance per position at the largest K, P(i accepted | 0..i-1 accepted), as the engine counts "
              "it (accepted at i / steps that drafted i and accepted every draft before it): "
              + " ".join(fmt(c) for c in cond) + ".", ""]
    L += md_table(["K", "measured", "sum r^i", "sum of measured survival rates"],
                  [[str(k), fmt(v["measured"]), fmt(v["formula_iid"]), fmt(v["formula_per_position"])]
                   for k, v in ks["expected_accepted"].items()])
    return L + [""]


def _temperature_md(tp: dict) -> list[str]:
    """Temperature: rejection sampling and coupled acceptance."""
    rows = [[t, acc, fmt(r["ar"]["tokens_per_s"], 1), fmt(r[acc]["speedup"]), fmt(r[acc]["tau"]),
             " ".join(fmt(a) for a in r[acc]["acceptance_rate_per_position"]), yes(r[acc]["identical_to_ar"], "no")]
            for t, r in tp["by_temperature"].items() for acc in ("rejection", "coupled")]
    return ([f"## Temperature ({tp['drafter']} drafter, K={tp['draft_length']})", ""]
            + md_table(["T", "acceptance", "tokens/s AR", "speedup", "tau", "acc. per position", "= AR"], rows)
            + ["", "Token identity with AR is guaranteed for greedy and for coupled acceptance; rejection "
                   "sampling at T>0 is exact in distribution only.", ""])


def _batch_md(bt: dict) -> list[str]:
    """Batch size under continuous batching, with the budget policy's checks."""
    ng = all("ngram_budget" in r for r in bt["by_batch_size"].values())
    per = bt.get("requests_per_slot")
    how = (f"concurrency B under continuous batching: {per}B requests of {bt['max_tokens'] // 2}-"
           f"{bt['max_tokens'] * 3 // 2} new tokens, at most B in flight, each finished request replaced at "
           f"once" if per else f"{bt['max_tokens']} new tokens, closed batches")
    L = [f"## Batch size ({bt['drafter']} drafter{' and n-gram' if ng else ''}, K={bt['draft_length']})", "",
         f"Batch size B = {how}.", "",
         "| batch | AR tokens/s | AR again (noise) | fixed tokens/s | fixed speedup | budget tokens/s | "
         "budget speedup | budget mean K | budget planning share of wall time |"
         + (" n-gram fixed speedup | n-gram budget speedup | n-gram budget mean K |" if ng else ""),
         "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if ng else "")]
    for b, r in bt["by_batch_size"].items():
        again = fmt(r["ar_again"]["speedup"]) + "x" if "ar_again" in r else "-"
        row = (f"| {b} | {fmt(r['ar']['tokens_per_s'], 1)} | {again} | {fmt(r['fixed']['tokens_per_s'], 1)} | "
               f"{fmt(r['fixed']['speedup'])} | {fmt(r['budget']['tokens_per_s'], 1)} | "
               f"{fmt(r['budget']['speedup'])} | {fmt(r['budget']['drafted_tokens_per_step'])} | "
               f"{fmt(100 * r['budget'].get('policy_plan_fraction', 0.0), 1)}% |")
        if ng:
            row += (f" {fmt(r['ngram_fixed']['speedup'])} | {fmt(r['ngram_budget']['speedup'])} | "
                    f"{fmt(r['ngram_budget']['drafted_tokens_per_step'])} |")
        L.append(row)
    L.append("")
    for m, label in (("budget", f"the budget policy ({bt['drafter']} drafter)"),
                     ("ngram_budget", "the budget policy (n-gram drafter)")):
        if f"{m}_never_below_ar" not in bt:
            continue
        if bt[f"{m}_never_below_ar"]:
            verdict = f"{label} kept speculative throughput >= autoregressive at every batch size"
        else:
            verdict = (f"{label} fell below autoregressive at batch sizes {bt[f'{m}_below_ar_at']} (by more "
                       f"than 3% at {bt[f'{m}_below_ar_by_3pct_at'] or 'none'}; by more than this run's noise, "
                       f"max(2%, |1 - AR again/AR|), at {bt[f'{m}_below_ar_beyond_noise_at'] or 'none'})")
        sig = bt.get(f"{m}_below_ar_significant_at")
        if sig is not None:
            ivs = ", ".join(f"B={b}: {fmt(r[m]['speedup_interval'][0])}-{fmt(r[m]['speedup_interval'][1])}"
                            for b, r in bt["by_batch_size"].items())
            cov = min(r[m].get("speedup_interval_coverage", 0.0) for r in bt["by_batch_size"].values())
            verdict += (f". Interval of the paired median ({cov * 100:.0f}% coverage, order statistics): {ivs}; "
                        f"wholly below 1 at {sig or 'none'}")
        pooled, again = bt.get(f"{m}_pooled"), bt.get("ar_again_pooled")
        if pooled and again:
            verdict += (f". Pooled over every batch size ({pooled['n']} paired repeats): median "
                        f"{fmt(pooled['speedup'])}x, interval {fmt(pooled['interval'][0])}-"
                        f"{fmt(pooled['interval'][1])} ({pooled['coverage'] * 100:.0f}%); AR again pooled: "
                        f"{fmt(again['speedup'])}x, {fmt(again['interval'][0])}-{fmt(again['interval'][1])}")
        L.append(f"Check: {verdict}.")
    L += ["",
          "AR again runs the same autoregressive engine a second time in the same run (modes in a seeded random "
          "order per repeat): its ratio to AR is the timing noise of this machine at that batch size. Mean K is "
          "the mean number of drafted tokens per request-step; when it is ~0 the policy switched speculation "
          "off (its drafts do not pay here), and the remaining gap to AR is noise plus the policy's own cost "
          "per step (planning, exploration, plain-run measurements).", ""]
    return L


def _misaligned_md(mis: dict) -> list[str]:
    """Misaligned draft sampling."""
    rows = [[name, mode, fmt(r[mode]["speedup"]), fmt(r[mode]["tau"]),
             " ".join(fmt(a) for a in r[mode]["acceptance_rate_per_position"])]
            for name, r in mis["cases"].items() for mode in ("aligned", "misaligned")]
    return ([f"## Misaligned draft sampling ({mis['drafter']} drafter, K={mis['draft_length']})", "",
             "A benchmark-only drafter hook samples the DRAFT with other parameters than the target. The "
             "output stays exact (verification uses the q the draft really sampled from); what is lost is "
             "acceptance, which the engine's single shared transform protects.", ""]
            + md_table(["case", "mode", "speedup", "tau", "acc. per position"], rows) + [""])


def _peer_md(pr: dict) -> list[str]:
    """The transformers peer comparison."""
    L = ["## Peer: Hugging Face transformers (same weights, same prompts, greedy, batch 1)", ""]
    if "skipped" in pr:
        return L + [f"Skipped: {pr['skipped']}", ""]
    L += [f"transformers {pr['transformers_version']}, assisted generation with "
          f"num_assistant_tokens={pr['draft_length']} (constant schedule).", ""]
    L += md_table(["mode", "tokens/s", "speedup over specrt AR"],
                  [[name, fmt(v["tokens_per_s"], 1), fmt(v["speedup"])] for name, v in pr["modes"].items()])
    return L + ["", f"specrt speculative / HF assisted tokens/s: **{fmt(pr['ratio_spec_vs_hf_assisted'])}x**; "
                    f"specrt AR / HF greedy: {fmt(pr['ratio_ar_vs_hf_greedy'])}x; HF assisted over HF greedy: "
                    f"{fmt(pr['hf_assisted_speedup_over_hf_greedy'])}x.", "",
                "Token identity (identical sequences / mean common-prefix fraction): " + "; ".join(
                    f"{k}: {v['identical_sequences']}/{v['of']}, {fmt(v['mean_common_prefix_fraction'])}"
                    for k, v in pr["identity"].items()) + ".", ""]


def _header_md(res: dict) -> list[str]:
    """Title, machine, note, headline table and settings."""
    m = res["meta"]
    mi = m["machine"]
    L = [f"# specrt end-to-end benchmark — {m['date']}", ""]
    where = mi.get("gpu") or mi.get("cpu_model", mi["processor"])
    L.append(f"Machine: `{mi['hostname']}`, {where}, device `{mi['device']}`, {mi['cpu_count']} CPUs, "
             f"torch {mi['torch']} ({mi['torch_threads']} threads). Target `{m['target']}`, draft `{m['draft']}`. "
             f"Total {m.get('total_seconds', 0):.0f} s. Load average at start / end: "
             f"{fmt((m.get('load_average_start') or [float('nan')])[0])} / "
             f"{fmt((m.get('load_average_end') or [float('nan')])[0])} (shared machines make timings noisy; "
             f"every ratio compares modes run alternately in this same process).")
    if m.get("note"):
        L += ["", f"**Note:** {m['note']}"]
    L += ["", "## Headline", "", headline_table(res), ""]
    s = m["settings"]
    L += ["", f"Settings: {s['prompts_per_category']} prompts per category, {s['max_tokens']} new tokens, "
              f"prompts cut to the last {s['max_prompt_tokens']} tokens, {s['repeats']} alternating repeats "
              f"(medians), K={s['draft_length']} unless swept. Greedy and batch 1 unless stated.", ""]
    return L


def write_report(res: dict, out: Path, plots: list[str]) -> str:
    """report.md in ``out``; returns its text."""
    L = _header_md(res)
    parts = (("costs", _costs_md), ("categories", _categories_md), ("k_sweep", _k_sweep_md),
             ("temperature", _temperature_md), ("batch", _batch_md), ("misaligned", _misaligned_md),
             ("peer", _peer_md), *((k, mod.report_md) for k, mod in RENDERED_BY_SECTION.items()))
    for key, render in parts:
        if res.get(key):
            L += render(res[key])
    if plots:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    text = "\n".join(L)
    (out / "report.md").write_text(text)
    return text


def headline(res: dict) -> str:
    """A few lines for the terminal."""
    L = []
    main = res["meta"]["main_drafter"]
    if "categories" in res:
        L.append("speedup per category (" + ", ".join(
            f"{c}: " + "/".join(f"{d} {fmt(v['speedup'])}" for d, v in res["categories"][c].items() if d != "ar")
            for c in CATEGORIES) + ")")
    if "k_sweep" in res:
        ks = res["k_sweep"]
        L.append(f"best fixed K={ks['best_fixed_k']} {fmt(ks['best_fixed_speedup'])}x; " + ", ".join(
            f"{p} {fmt(v['speedup'])}x ({v['gain_over_best_fixed'] * 100:+.1f}%)" for p, v in ks["policies"].items()))
    if "batch" in res:
        L.append("batch speedup fixed/budget: " + ", ".join(
            f"B={b}: {fmt(r['fixed']['speedup'])}/{fmt(r['budget']['speedup'])}"
            for b, r in res["batch"]["by_batch_size"].items()))
    if "peer" in res and "skipped" not in res["peer"]:
        p = res["peer"]
        L.append(f"vs transformers: spec/assisted {fmt(p['ratio_spec_vs_hf_assisted'])}x, AR/greedy "
                 f"{fmt(p['ratio_ar_vs_hf_greedy'])}x, identical spec vs assisted "
                 f"{p['identity']['spec_vs_hf_assisted']['identical_sequences']}/{p['identity']['spec_vs_hf_assisted']['of']}")
    L += [row.strip("| ").replace(" | ", ": ", 1) for row in _section_headlines(res)]
    return f"[{main} drafter]\n" + "\n".join(L)


def jsonable(x):
    """Results as JSON: string keys, lists for tuples, None for NaN and infinities."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def write_results(res: dict, out: Path) -> Path:
    """results.json, report.md and the plots, in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    res = jsonable(res)
    plots = write_plots(res, out)
    res["meta"]["plots"] = plots
    (out / "results.json").write_text(json.dumps(res, indent=1))
    write_report(res, out, plots)
    return out


def default_out_dir(device) -> Path:
    """bench/results/<date>-<machine>/"""
    return Path("bench") / "results" / f"{_dt.date.today().isoformat()}-{machine_tag(machine_info(device))}"
