"""The ``batching`` section: admission by predicted acceptance vs first come first served
(issue 16, item 6).

A mixed workload queued all at once, more requests than the batch holds: n-gram-friendly
repetitive prompts (a block of code repeated, then its start again) interleaved with free text,
tagged by kind. SpecConfig(admission="acceptance") admits the waiting requests whose predicted
acceptance (their tag's recent average) is closest to the running batch's, so a step verifies
requests that draft alike; "fifo" admits in arrival order. Per setup (drafter and policy) both
engines first serve the workload twice untimed (so each tag's acceptance is known; the second
pass counts the steps whose batch mixed both kinds), then the two alternate as whole batches: throughput
(emitted tokens over wall time), the paired median ratio acceptance / FIFO with its interval,
and (greedy) whether the outputs are identical.

    python -m bench --sections batching [--target T --draft D] [--set batching_batch_size=4]
"""
from __future__ import annotations

from bench.runner import compare, strip_ids
from bench.text import fmt, md_table, yes
from bench.workloads import mixed_workload

ADMISSIONS = ("fifo", "acceptance")


def mixed_steps(llm, prompts: list[list[int]], tags: list[str], params) -> int:
    """Serve the workload once (untimed); the number of steps whose running batch held both tags."""
    eng = llm.engine
    eng.add_requests(prompts, [params] * len(prompts), tags)
    mixed = 0
    while eng.has_unfinished():
        eng.step()
        mixed += len({r.tag for r in eng.scheduler.running}) > 1
    return mixed


def _setups(ctx) -> dict:
    """name -> (draft argument, policy): the n-gram drafter, whose acceptance differs most
    between the two kinds, fixed and under the budget policy; the run's main drafter, budget."""
    out = {"ngram/fixed": ("ngram", "fixed"), "ngram/budget": ("ngram", "budget")}
    if ctx.main_drafter != "ngram":
        out[f"{ctx.main_drafter}/budget"] = (ctx.drafters[ctx.main_drafter], "budget")
    return out


def section_batching(ctx) -> dict:
    s = ctx.s
    prompts, tags = mixed_workload(ctx.tokenizer, s.batching_requests_per_kind, s.max_prompt_tokens)
    params = ctx.params()
    out = {}
    for name, (draft, policy) in _setups(ctx).items():
        modes = {a: (ctx.llm(draft, policy=policy, max_draft_length=s.draft_length,
                             max_batch_size=s.batching_batch_size, admission=a), params) for a in ADMISSIONS}
        # two untimed passes: the first teaches each tag's acceptance, the second counts mixed steps
        mixed = {a: [mixed_steps(llm, prompts, tags, params) for _ in range(2)][-1] for a, (llm, _) in modes.items()}
        res = compare(modes, prompts, max(s.repeats, s.batch_repeats), batched=True, baseline="fifo", tags=tags)
        out[name] = {"modes": strip_ids(res), "mixed_tag_steps": mixed,
                     "throughput_ratio": res["acceptance"]["speedup"],
                     "throughput_ratio_interval": res["acceptance"]["speedup_interval"],
                     "identical": res["acceptance"]["identical_to_ar"]}
    return {"requests": len(prompts), "repetitive": tags.count("repetitive"), "free_text": tags.count("free_text"),
            "batch_size": s.batching_batch_size, "draft_length": s.draft_length, "max_tokens": s.max_tokens,
            "setups": out}


def report_md(sec: dict) -> list[str]:
    """The report's part: a row per setup and admission."""
    rows = [[name, a, fmt(r["modes"][a]["tokens_per_s"], 1), fmt(r["modes"][a]["tau"]),
             str(r["mixed_tag_steps"][a]),
             "1.00x" if a == "fifo" else f"{fmt(r['throughput_ratio'])}x ({fmt(r['throughput_ratio_interval'][0])}-"
                                         f"{fmt(r['throughput_ratio_interval'][1])})",
             "-" if a == "fifo" else yes(r["identical"])]
            for name, r in sec["setups"].items() for a in ADMISSIONS]
    return ([f"## Admission by acceptance vs FIFO (mixed workload, batch {sec['batch_size']})", "",
             f"{sec['requests']} requests queued at once ({sec['repetitive']} repetitive, {sec['free_text']} free "
             f"text, interleaved), {sec['max_tokens']} new tokens each, greedy, K={sec['draft_length']}, at most "
             f"{sec['batch_size']} running. Mixed steps: steps whose batch held both kinds (an untimed pass "
             "after one that taught each tag's acceptance). vs FIFO: the paired median over repeats of FIFO "
             "time / acceptance time, with its interval.", ""]
            + md_table(["drafter/policy", "admission", "tokens/s", "tau", "mixed steps", "vs FIFO",
                        "same output"], rows) + [""])


def headline_rows(sec: dict) -> list[str]:
    return ["| admission by acceptance vs FIFO, mixed workload (throughput) | " + ", ".join(
        f"{name}: {fmt(r['throughput_ratio'])}x" for name, r in sec["setups"].items()) + " |"]

