"""The ``penalties`` section: what the sampling controls cost speculation (issue 20).

A penalty changes the target's distribution at every position from the history before it; the
draft follows it (the same controls run on the draft's rows), so acceptance should stay near the
unpenalised one, and the controls' own work (the apply_penalties op, the masks, the per-request
tables) is the overhead. Per temperature, autoregressive decoding and every drafter of the run
(K = draft_length) decode the sweep prompts under each penalty setting, all modes alternating in
one comparison; per drafter and setting: acceptance (accepted / drafted), tau, tokens/s, tokens/s
against the same drafter without penalties and against autoregressive decoding with the same
penalties (paired medians), and, greedy, token identity with that autoregressive run. Then the
controls' ops alone, per verify of 32 requests x 5 rows.

    python -m bench --sections penalties [--target T --draft D] [--set penalty_temperatures=0,0.8]
"""
from __future__ import annotations

import torch

from bench.costs import timed_interleaved
from bench.runner import compare, paired_speedup
from bench.text import fmt, md_table, yes

PENALTIES = {          # setting -> SamplingParams controls
    "none": {},
    "presence+frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "repetition 1.2": dict(repetition_penalty=1.2),
    "all (+min_p, bias)": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3, min_p=0.05,
                               logit_bias={0: -5.0}),
}


def _row(res: dict, d: str, p: str, greedy: bool) -> dict:
    v = res[f"{d}|{p}"]
    vs_none = paired_speedup(res[f"{d}|none"], v)
    vs_ar = paired_speedup(res[f"ar|{p}"], v)
    return {"drafter": d, "penalties": p, "tokens_per_s": v["tokens_per_s"], "tau": v["tau"],
            "acceptance": v["draft_hit_rate"] if d != "ar" else None,   # accepted / drafted
            "mean_accepted_length": v["mean_accepted_length"],
            "vs_no_penalties": vs_none["speedup"], "vs_no_penalties_interval": vs_none["speedup_interval"],
            "speedup_vs_ar": vs_ar["speedup"], "speedup_vs_ar_interval": vs_ar["speedup_interval"],
            "identical_to_ar": (v["token_ids"] == res[f"ar|{p}"]["token_ids"]) if greedy else None}


def section_penalties(ctx) -> dict:
    K = ctx.s.draft_length
    engines = {"ar": ctx.llm(None), **{d: ctx.llm(a, max_draft_length=K) for d, a in ctx.drafters.items()}}
    by_t = {}
    for t in ctx.s.penalty_temperatures:
        modes = {f"{d}|{p}": (llm, ctx.params(t, **kw)) for d, llm in engines.items() for p, kw in PENALTIES.items()}
        res = compare(modes, ctx.sweep_prompts(), ctx.s.repeats, baseline="ar|none")
        by_t[str(t)] = [_row(res, d, p, t == 0.0) for d in engines for p in PENALTIES]
    return {"draft_length": K, "penalties": PENALTIES, "by_temperature": by_t,
            "op_costs": op_costs(ctx.torch_device, (ctx.target_config.vocab_size, *ctx.s.penalty_vocab_sizes),
                                 ctx.s.cost_reps)}


def _penalty_inputs(V: int, device, B: int = 32, K: int = 4, E: int = 512) -> tuple:
    """apply_penalties' arguments for B requests x K+1 rows, each request with E penalised
    tokens (~16 of them biased) and the draft tokens before each row; and the transform's rows."""
    g = torch.Generator().manual_seed(V)
    R = B * (K + 1)
    E = min(E, V)
    logits = torch.randn(R, V, generator=g) * 3
    tokens = torch.cat([torch.randperm(V, generator=g)[:E].sort().values for _ in range(B)]).int()
    args = (torch.arange(B).repeat_interleave(K + 1), torch.arange(K + 1).repeat(B),
            torch.randint(0, V, (B, K), generator=g, dtype=torch.int32), torch.arange(B + 1) * E, tokens,
            torch.randint(0, 4, (B * E,), generator=g, dtype=torch.int32), torch.rand(B * E, generator=g) < 0.5,
            torch.where(torch.rand(B * E, generator=g) < 16 / E, 2.0, 0.0), torch.full((B,), 1.1),
            torch.full((B,), 0.3), torch.full((B,), 0.3))
    params = (torch.full((R,), 0.8), torch.zeros(R, dtype=torch.int32), torch.full((R,), 0.95))
    return logits.to(device), tuple(a.to(device) for a in args), tuple(a.to(device) for a in params)


def op_costs(device, vocab_sizes, reps: int) -> list[dict]:
    """The controls' own work per verify against the sampling transform it precedes: B = 32
    requests x K+1 = 5 rows, 512 penalised tokens each (median milliseconds, interleaved)."""
    from specrt import ops

    out = []
    for V in dict.fromkeys(vocab_sizes):      # in order, once each
        logits, args, params = _penalty_inputs(V, device)
        work = logits.clone()
        min_p = torch.full((logits.shape[0],), 0.05, device=device)
        ms = timed_interleaved({
            "apply_penalties": lambda: ops.apply_penalties(work, *args, check_values=False),
            "probs_from_logits": lambda: ops.probs_from_logits(logits, *params, check_values=False),
            "probs_from_logits_min_p": lambda: ops.probs_from_logits(logits, *params, min_p=min_p,
                                                                     check_values=False)}, reps, device)
        out.append({"V": V, "rows": logits.shape[0], **{f"{k}_ms": v * 1e3 for k, v in ms.items()}})
    return out


def report_md(sec: dict) -> list[str]:
    """The report's part: per temperature, a row per drafter and penalty setting; the op costs."""
    L = [f"## Penalties: acceptance and speed (K={sec['draft_length']}, batch 1)", "",
         "Each drafter with and without penalties, against itself without them and against autoregressive "
         "decoding with the same penalties (paired medians over repeats, all modes alternating). The draft "
         "runs the same controls as the target, so acceptance should hold; = AR: greedy output identical to "
         "autoregressive decoding with the same penalties (it must be).", "",
         "Settings: " + "; ".join(f"{p}: {kw or 'off'}" for p, kw in sec["penalties"].items()), ""]
    for t, rows in sec["by_temperature"].items():
        L += md_table(["T", "drafter", "penalties", "acceptance", "tau", "tokens/s", "vs no penalties",
                       "speedup vs AR (same penalties)", "= AR"],
                      [[t, r["drafter"], r["penalties"], fmt(r["acceptance"], 3), fmt(r["tau"]),
                        fmt(r["tokens_per_s"], 1), fmt(r["vs_no_penalties"]) + "x",
                        *(["-", "-"] if r["drafter"] == "ar" else
                          [fmt(r["speedup_vs_ar"]) + "x", yes(r["identical_to_ar"])])] for r in rows]) + [""]
    if sec.get("op_costs"):
        L += ["The controls' ops per verify (32 requests x 5 rows, 512 penalised tokens each; median ms):", ""]
        L += md_table(["V", "apply_penalties", "probs_from_logits", "with min_p"],
                      [[str(c["V"]), fmt(c["apply_penalties_ms"], 3), fmt(c["probs_from_logits_ms"], 3),
                        fmt(c["probs_from_logits_min_p_ms"], 3)] for c in sec["op_costs"]]) + [""]
    return L


def headline_rows(sec: dict) -> list[str]:
    """Headline: the heaviest setting against none, per drafter, at the first temperature."""
    t, rows = next(iter(sec["by_temperature"].items()))
    heavy = list(sec["penalties"])[-1]
    by = {(r["drafter"], r["penalties"]): r for r in rows}
    cells = [f"{d}: acceptance {fmt(by[(d, 'none')]['acceptance'])} -> {fmt(r['acceptance'])}, "
             f"tokens/s {fmt(r['vs_no_penalties'])}x" for (d, p), r in by.items() if p == heavy and d != "ar"]
    return [f"| penalties '{heavy}' vs none (T={t}, K={sec['draft_length']}) | " + "; ".join(cells) + " |"]

