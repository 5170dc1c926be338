"""`python -m bench cost-curve`: the verification cost curve on random-weight Llama-shaped
models built on the device (no files): target step time vs verified tokens per request, one
draft step, the overlap of K draft steps on a side stream with the verification (CUDA), and the
speedup tau / (1 + c*K + v) they predict for acceptance rates 0.6..0.9 with the best K."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.costs import forward_timer, scratch_cache, theoretical_speedup, timed, timed_interleaved
from bench.machine import machine_info
from bench.models import param_count, random_model
from bench.plots import plot_cost_curve
from bench.report import jsonable
from bench.runner import now
from bench.text import fmt


def measure_overlap(target, draft, ctx: int, B: int, K: int, reps: int, caches, t_verify: float,
                    t_draft: float) -> dict:
    """CUDA: K draft steps on a side stream while the target verifies K+1 tokens; how much of the
    drafting the concurrency hid."""
    dev = target.device
    t_cache, d_cache = caches
    f_t = forward_timer(target, ctx, K + 1, batch=B, cache=t_cache)
    f_d = forward_timer(draft, ctx, 1, batch=B, cache=d_cache)
    side = torch.cuda.Stream(dev)

    def both():
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(K):
                f_d()
        f_t()
        torch.cuda.current_stream(dev).wait_stream(side)
    t_both = timed(both, reps, dev)
    t_seq = t_verify + K * t_draft
    return {"K": K, "sequential_s": t_seq, "concurrent_s": t_both,
            "hidden_fraction_of_draft": max(0.0, min(1.0, (t_seq - t_both) / (K * t_draft)))}


def predict(entry: dict, alphas, hidden: float) -> dict:
    """Per acceptance rate a: tau = (1 - a^(K+1)) / (1 - a) and the predicted speedup per K
    (without and with the measured overlap), and the best K."""
    pred = {}
    for a in alphas:
        row = {}
        for K in entry["v"]:
            tau = (1 - a ** (K + 1)) / (1 - a)
            row[K] = {"tau": tau, "speedup": theoretical_speedup(tau, entry["c"], K, entry["v"][K]),
                      "speedup_with_overlap": tau / (1 + (1 - hidden) * entry["c"] * K + entry["v"][K])}
        best = max(row, key=lambda k: row[k]["speedup"])
        pred[str(a)] = {"by_k": row, "best_k": best, "best_speedup": row[best]["speedup"]}
    return pred


def _at_batch(target, draft, ctx: int, B: int, max_tokens: int, kmax: int, reps: int, alphas) -> dict:
    t_cache = scratch_cache(target, ctx, max_tokens, B)     # one cache per model for all T
    d_cache = scratch_cache(draft, ctx, max_tokens, B)
    fns = {T: forward_timer(target, ctx, T, batch=B, cache=t_cache) for T in range(1, max_tokens + 1)}
    fns["draft"] = forward_timer(draft, ctx, 1, batch=B, cache=d_cache)
    tt = timed_interleaved(fns, reps, target.device)
    td = tt.pop("draft")
    t1 = tt[1]
    entry = {"target_step_s": tt, "draft_step_s": td, "c": td / t1,
             "v": {K: tt[K + 1] / t1 - 1 for K in range(1, min(kmax, max_tokens - 1) + 1)}, "overlap": None}
    if target.device.type == "cuda":
        K = min(4, kmax)
        entry["overlap"] = measure_overlap(target, draft, ctx, B, K, reps, (t_cache, d_cache), tt[K + 1], td)
    hidden = entry["overlap"]["hidden_fraction_of_draft"] if entry["overlap"] else 0.0
    entry["predicted"] = predict(entry, alphas, hidden)
    return entry


def cost_curve(target_shape="8b", draft_shape="1b", draft_layers: int | None = None, device=None,
               dtype="bfloat16", ctx: int = 1024, max_tokens: int = 16, batch_sizes=(1, 8, 32), kmax: int = 8,
               reps: int = 10, alphas=(0.6, 0.7, 0.8, 0.9), log=print) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = now()
    target = random_model(target_shape, dev, getattr(torch, dtype))
    draft = random_model(draft_shape, dev, getattr(torch, dtype), layers=draft_layers)
    log(f"cost-curve: target {target_shape} {param_count(target) / 1e9:.2f}B, draft {draft_shape} "
        f"{param_count(draft) / 1e9:.2f}B params ({dtype}, {dev}); built in {now() - t0:.1f}s")
    res = {"machine": machine_info(dev), "target_shape": target_shape, "draft_shape": draft_shape,
           "target_params": param_count(target), "draft_params": param_count(draft), "dtype": dtype,
           "context_tokens": ctx, "by_batch": {}}
    for B in batch_sizes:
        e = res["by_batch"][str(B)] = _at_batch(target, draft, ctx, B, max_tokens, kmax, reps, alphas)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        tt, o = e["target_step_s"], e["overlap"]
        log(f"cost-curve: B={B}: target 1 tok {tt[1] * 1e3:.2f} ms, {max_tokens} tok {tt[max_tokens] * 1e3:.2f} ms, "
            f"draft {e['draft_step_s'] * 1e3:.2f} ms (c={e['c']:.3f})"
            + (f", overlap hides {o['hidden_fraction_of_draft']:.0%} of drafting" if o else "")
            + "; predicted best speedup " + ", ".join(f"a={a}: {p['best_speedup']:.2f}x@K={p['best_k']}"
                                                      for a, p in e["predicted"].items()))
    res["seconds"] = now() - t0
    return res


def cost_curve_md(res: dict) -> str:
    """cost_curve.md from the JSON form of the results."""
    L = [f"# Cost curve: random-weight {res['target_shape']} target ({res['target_params'] / 1e9:.2f}B) / "
         f"{res['draft_shape']} draft ({res['draft_params'] / 1e9:.2f}B), {res['dtype']}",
         "", f"Machine: {res['machine'].get('gpu') or res['machine'].get('cpu_model')}; context "
             f"{res['context_tokens']} tokens.", ""]
    for B, e in res["by_batch"].items():
        tt = e["target_step_s"]
        L += [f"## batch {B}", "", "| verified tokens | " + " | ".join(tt) + " |", "|---|" + "---|" * len(tt),
              "| target ms | " + " | ".join(fmt(v * 1e3, 2) for v in tt.values()) + " |", "",
              f"Draft step {fmt(e['draft_step_s'] * 1e3, 3)} ms, c = {fmt(e['c'], 3)}."]
        if e.get("overlap"):
            o = e["overlap"]
            L.append(f"Overlap (K={o['K']}): sequential {fmt(o['sequential_s'] * 1e3)} ms, concurrent "
                     f"{fmt(o['concurrent_s'] * 1e3)} ms: {o['hidden_fraction_of_draft']:.0%} of drafting hidden.")
        L += ["", "| acceptance rate | best K | predicted speedup |", "|---|---|---|"]
        for a, p in e["predicted"].items():
            L.append(f"| {a} | {p['best_k']} | {fmt(p['best_speedup'])} |")
        L.append("")
    return "\n".join(L)


def write_cost_curve(res: dict, out: Path) -> None:
    """cost_curve.json, cost_curve.md and cost_curve.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    res = jsonable(res)
    (out / "cost_curve.json").write_text(json.dumps(res, indent=1))
    (out / "cost_curve.md").write_text(cost_curve_md(res))
    plot_cost_curve(res, out)
