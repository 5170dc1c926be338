"""The ``speedup_estimate`` section: does the runtime's speedup estimate agree with the measured
speedup? (issue 16, item 3)

The runtime estimates its speedup without running autoregressive decoding: the cost model's fit
of the engine's own measured plain (K=0) steps prices the emitted tokens, over the measured step
time (``estimated_speedup`` in ``LLM.stats()``, specrt.observability.metrics). Here an autoregressive engine and
one speculative engine per drafter decode the same prompts at batch 1, greedy; the modes alternate
WHOLE passes over the prompts (prompt by prompt would also measure switching the CPU caches
between models, which a serving process never pays and the estimate cannot see), and every
speculative engine is recalibrated (untimed) before each repeat, so the plain steps the estimate
rests on span the same machine states as the measurement. Per drafter: the measured speedup
(paired median over repeats), the estimate (median over repeats of each repeat's own), their
difference in %, and the estimate's inputs.

    python -m bench --sections speedup_estimate [--target T --draft D] [--repeats 7]
"""
from __future__ import annotations

from bench.runner import compare, median
from bench.text import fmt, md_table, yes

AGREEMENT = 0.10        # the bar: the estimate within 10% of the measured speedup
CALIBRATION_PROMPTS = 4


def _row(v: dict) -> dict:
    estimates = [e for e in v["estimated_speedup_all"] if e is not None]
    est = median(estimates) if estimates else None
    meas = v["speedup"]
    diff = est / meas - 1.0 if est is not None and meas and meas == meas else None
    return {"measured": meas, "measured_interval": v["speedup_interval"], "estimate": est,
            "estimate_all": v["estimated_speedup_all"], "difference": diff,
            "within_10pct": None if diff is None else abs(diff) <= AGREEMENT, "tau": v["tau"],
            "draft_share_of_step": v["draft_share_of_step"], "identical_to_ar": v["identical_to_ar"]}


def section_speedup_estimate(ctx) -> dict:
    K = ctx.s.draft_length
    prompts = ctx.pool()
    params = ctx.params()
    modes = {"ar": (ctx.llm(None), params), **{d: (ctx.llm(a, max_draft_length=K), params)
                                                for d, a in ctx.drafters.items()}}

    def recalibrate(rep: int) -> None:       # untimed; leaves the metrics alone
        for name, (llm, _) in modes.items():
            if name != "ar":
                llm.engine.calibrate(prompts=prompts[:CALIBRATION_PROMPTS])

    res = compare(modes, prompts, ctx.s.repeats, whole_pass=True, before_repeat=recalibrate)
    return {"draft_length": K, "prompts": len(prompts), "max_tokens": ctx.s.max_tokens, "repeats": ctx.s.repeats,
            "drafters": {d: _row(res[d]) for d in ctx.drafters}}


def report_md(sec: dict) -> list[str]:
    """The report's part: estimate vs measured, per drafter."""
    rows = [[d, f"{fmt(r['measured'])}x ({fmt(r['measured_interval'][0])}-{fmt(r['measured_interval'][1])})",
             f"{fmt(r['estimate'])}x", "n/a" if r["difference"] is None else f"{100 * r['difference']:+.1f}%",
             yes(r["within_10pct"]), fmt(r["tau"]), fmt(r["draft_share_of_step"])]
            for d, r in sec["drafters"].items()]
    return ([f"## The runtime's speedup estimate vs the measured speedup (K={sec['draft_length']}, batch 1)", "",
             f"{sec['prompts']} prompts x {sec['max_tokens']} tokens, greedy, {sec['repeats']} repeats alternating "
             "whole passes, every speculative engine recalibrated before each repeat. Measured: paired median of "
             "AR time / speculative time (interval); estimate: the engine's `estimated_speedup` (cost-model fit "
             "of its measured plain steps over its measured step time), median over repeats.", ""]
            + md_table(["drafter", "measured", "estimate", "difference", "within 10%", "tau", "draft share of step"],
                       rows) + [""])


def headline_rows(sec: dict) -> list[str]:
    return ["| runtime speedup estimate vs measured (batch 1) | " + ", ".join(
        f"{d}: {fmt(r['estimate'])}x vs {fmt(r['measured'])}x"
        + ("" if r["difference"] is None else f" ({100 * r['difference']:+.1f}%)")
        for d, r in sec["drafters"].items()) + " |"]

