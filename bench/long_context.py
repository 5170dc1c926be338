"""The ``long_context`` section: the draft's KV window at long contexts, draft cost and
acceptance against the full-cache draft (issue 16, item 9).

SpecConfig(draft_kv_window=W, draft_kv_sinks=S): the draft attends to the first S positions
plus the last W before each new token (whole blocks), the target to everything, so the output
is exact and only acceptance may change. For each context length the same long prompts
(windows over the held-out modules, the last N tokens) are decoded at batch 1, greedy, by the
full-cache draft and by each window, alternating; reported: one draft forward at that context
(timed alone, full view vs window view, interleaved), the engine's drafting time per drafted
step (a prompt's catch-up included), the step time, tau, acceptance (accepted / drafted), the
first-token acceptance, tokens/s against the full-cache draft (paired) and whether the output
equals the full-cache draft's. Needs a draft model (the window applies to its own KV cache).

    python -m bench --sections long_context --target T --draft D [--set long_contexts=512,1024,2048]
"""
from __future__ import annotations

from bench.costs import forward_timer, scratch_cache, timed_interleaved
from bench.runner import compare
from bench.text import fmt, md_table, yes
from bench.workloads import long_prompts


def _label(w: int, sinks: int) -> str:
    return "full" if w == 0 else f"window {sinks}+{w}"


def draft_forward_ms(llm, context: int, windows: tuple, sinks: int, reps: int) -> dict:
    """One draft forward (one new token after ``context`` positions) per KV view, interleaved:
    label -> median ms. The draft model is the drafter's public cost hint (``step_model()``)."""
    from specrt.models.attention import KVWindow

    model, num_layers = llm.engine.drafter.step_model()
    cache = scratch_cache(model, context, 1)
    fns = {_label(w, sinks): forward_timer(model, context, 1, num_layers=num_layers, cache=cache,
                                           window=KVWindow(sinks, w) if w else None) for w in windows}
    return {k: v * 1e3 for k, v in timed_interleaved(fns, reps, model.device).items()}


def _mode_row(v: dict, forward_ms: float) -> dict:
    return {"draft_forward_ms": forward_ms,
            "draft_ms_per_drafted_step": 1e3 * v["draft_time_s"] / max(v["drafted_steps"], 1),
            "step_ms": 1e3 * v["step_time_s"] / max(v["steps"], 1), "tau": v["tau"],
            "acceptance": v["draft_hit_rate"], "first_token_acceptance": v["first_token_acceptance_rate"],
            "tokens_per_s": v["tokens_per_s"], "vs_full": v["speedup"],
            "vs_full_interval": v["speedup_interval"], "identical_to_full": v["identical_to_ar"]}


def section_long_context(ctx) -> dict:
    s = ctx.s
    if not ctx.has_draft_model:
        return {"skipped": "needs a draft model (--draft): the KV window applies to a draft model's own cache"}
    windows = (0, *s.long_windows)
    longest = max(s.long_contexts) + s.long_max_tokens + s.draft_length + 2
    llms = {w: ctx.llm(ctx.draft, max_draft_length=s.draft_length, max_batch_size=1, draft_kv_window=w,
                       draft_kv_sinks=s.long_sinks, max_model_len=min(ctx.target_config.max_model_len, longest))
            for w in windows}
    limit = min(llm.engine.max_model_len for llm in llms.values())
    params = ctx.params(max_tokens=s.long_max_tokens)
    out = {}
    for c in s.long_contexts:
        length = min(c, limit - s.long_max_tokens - s.draft_length - 2)
        prompts = long_prompts(ctx.tokenizer, s.long_prompts, length)
        modes = {_label(w, s.long_sinks): (llms[w], params) for w in windows}
        res = compare(modes, prompts, s.repeats, baseline="full")
        fwd = draft_forward_ms(llms[0], length, windows, s.long_sinks, s.cost_reps)
        out[str(length)] = {m: _mode_row(v, fwd[m]) for m, v in res.items()}
    return {"draft_length": s.draft_length, "sinks": s.long_sinks, "windows": list(s.long_windows),
            "prompts": s.long_prompts, "max_tokens": s.long_max_tokens, "by_context": out}


def report_md(sec: dict) -> list[str]:
    """The report's part: a row per context length and draft KV view."""
    if "skipped" in sec:
        return ["## Long context: the draft's KV window", "", f"Skipped: {sec['skipped']}", ""]
    rows = [[c, m, fmt(r["draft_forward_ms"]), fmt(r["draft_ms_per_drafted_step"]), fmt(r["step_ms"]),
             fmt(r["tau"]), fmt(r["acceptance"], 3), fmt(r["first_token_acceptance"], 3), fmt(r["tokens_per_s"], 1),
             "-" if m == "full" else f"{fmt(r['vs_full'])}x", "-" if m == "full" else yes(r["identical_to_full"])]
            for c, by in sec["by_context"].items() for m, r in by.items()]
    return ([f"## Long context: the draft's KV window (K={sec['draft_length']}, batch 1, greedy)", "",
             f"{sec['prompts']} prompts x {sec['max_tokens']} new tokens per context length. Draft forward: one "
             "draft forward for one token at that context, timed alone (the window's cost stops growing with "
             "the context). Draft ms/step: the engine's drafting time per drafted step (a prompt's catch-up "
             "included). vs full: paired tokens/s ratio to the full-cache draft; same output: identical to it "
             "(it must be: the target verifies over the full context).", ""]
            + md_table(["context", "draft KV", "draft forward ms", "draft ms/step", "step ms", "tau", "acceptance",
                        "first-token acc.", "tokens/s", "vs full", "same output"], rows) + [""])


def headline_rows(sec: dict) -> list[str]:
    if "skipped" in sec:
        return []
    cells = []
    for c, by in sec["by_context"].items():
        full = by["full"]
        cells.append(f"{c}: full {fmt(full['draft_forward_ms'])} ms / {fmt(full['acceptance'])}, " + ", ".join(
            f"{m.removeprefix('window ')} {fmt(r['draft_forward_ms'])} ms / {fmt(r['acceptance'])}"
            for m, r in by.items() if m != "full"))
    return ["| long context: draft forward ms / acceptance, full vs window (sinks+W) | " + "; ".join(cells) + " |"]

