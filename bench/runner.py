"""Running the modes of a comparison: engines built through specrt's public hooks, timed
generation, paired comparisons with a distribution-free interval of the median speedup.

Every comparison runs autoregressive (AR) and speculative decoding of the SAME target in the
same process, in a seeded random order that changes from unit to unit and repeat to repeat,
and reports medians over repeats.
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from pathlib import Path

import torch


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


def sync(device) -> None:
    """Wait for the device (CUDA) so that a host timer covers the work it timed."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median: order statistics x(k) .. x(n+1-k)
    with the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is still >= level. Returns
    (low, high, coverage); with too few values for that level, the whole range and its coverage
    (1 - 2^(1-n))."""
    xs = sorted(x for x in xs if x == x)
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), 0.0
    # [x(k), x(n+1-k)] covers the median with probability 1 - 2 P(B <= k-1)
    cdf = 0.5 ** n
    k, cov = 1, 1.0 - 2.0 * cdf
    for j in range(1, (n + 1) // 2):
        cdf += math.comb(n, j) * 0.5 ** n          # P(B <= j)
        if 1.0 - 2.0 * cdf < level:
            break
        k, cov = j + 1, 1.0 - 2.0 * cdf
    return xs[k - 1], xs[n - k], cov


# ------------------------------------------------------------------------------- engines

def misaligned(misalign: dict):
    """A ``wrap_drafter`` hook for the misaligned-sampling study: the draft's rows get other
    sampling parameters (temperature / top-p) than the target's, through the model drafter's
    public ``draft_params`` hook. The output stays exact (rejection sampling uses the q actually
    sampled from); only the acceptance rate suffers -- which the aligned transform protects."""
    change = {k: misalign[k] for k in ("temperature", "top_p") if misalign.get(k) is not None}

    def wrap(drafter):
        drafter.draft_params = lambda p: dataclasses.replace(p, **change)
        return drafter
    return wrap


def make_llm(target, draft, spec, device, dtype=None, misalign: dict | None = None, model_loader=None):
    """A specrt.LLM built through the engine's public hooks only."""
    import specrt

    hooks = {} if model_loader is None else {"model_loader": model_loader}
    if misalign is not None:
        hooks["wrap_drafter"] = misaligned(misalign)
    return specrt.LLM(target=target, draft=draft, spec=spec, device=device, dtype=dtype, **hooks)


def shared_loader(store: dict):
    """A ``model_loader`` hook sharing loaded models (read-only weights) by (path, dtype, device):
    every mode of a comparison then runs literally the same target, and on a CPU no mode's
    weights are colder in the caches than another's because they are a different copy."""
    from specrt.loading import default_loader

    def load(path, role, dtype, device):
        key = (str(Path(path).resolve()), str(dtype), str(device))
        if key not in store:
            store[key] = default_loader(path, role, dtype, device)
        return store[key]
    return load


# ------------------------------------------------------------------------------- timing

def generate_concurrent(llm, prompts: list[list[int]], params, concurrency: int):
    """Serve ``prompts`` with at most ``concurrency`` requests in flight: the first
    ``concurrency`` start together, and each one that finishes is replaced by the next prompt at
    once (continuous batching, as a server under steady load sees it). Outputs in prompt order."""
    eng = llm.engine
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids: list[str] = []
    live: set[str] = set()
    done: dict = {}
    while len(done) < len(prompts):
        while len(live) < concurrency and len(ids) < len(prompts):
            i = len(ids)
            ids.append(eng.add_request(prompts[i], params[i]))
            live.add(ids[-1])
        for out in eng.step():
            if out.finished and out.request_id in live:
                live.discard(out.request_id)
                done[out.request_id] = out
    return [done[i] for i in ids]


def generate_timed(llm, prompts: list[list[int]], params, batched: bool,
                   concurrency: int | None = None) -> tuple[float, list[list[int]]]:
    """(seconds, token ids per prompt): batch 1 one prompt at a time, a whole batch, or
    continuous batching at a given concurrency."""
    sync(llm.engine.device)
    t0 = now()
    if concurrency:
        outs = generate_concurrent(llm, prompts, params, concurrency)
    elif batched:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate([p], params)[0] for p in prompts]
    sync(llm.engine.device)
    return now() - t0, [o.token_ids for o in outs]


# ------------------------------------------------------------------------------- comparisons

@dataclasses.dataclass
class Runs:
    """What the repeats of one comparison measured, per mode."""

    seconds: dict          # mode -> [units][repeats] seconds
    token_ids: dict        # mode -> [units] -> [prompts of the unit] token ids (last repeat)
    stats: dict            # mode -> the engine's "total" statistics of the last repeat
    plan_s: dict           # mode -> policy planning seconds of the last repeat


def _run_repeats(modes: dict, units: list, repeats: int, batched: bool, concurrency: int | None) -> Runs:
    names = list(modes)
    runs = Runs({m: [[0.0] * repeats for _ in units] for m in names}, {m: [None] * len(units) for m in names},
                {}, {m: 0.0 for m in names})
    for rep in range(repeats):
        for m in names:
            modes[m][0].engine.reset_metrics()
        for u, unit in enumerate(units):
            order = list(names)
            random.Random(1000 * rep + u).shuffle(order)
            for m in order:
                llm, params = modes[m]
                runs.seconds[m][u][rep], runs.token_ids[m][u] = generate_timed(llm, unit, params, batched,
                                                                               concurrency)
        for m in names:
            snap = modes[m][0].stats()
            runs.stats[m] = snap["total"]
            runs.plan_s[m] = snap.get("plan_time_s", 0.0)
    return runs


def _mode_result(runs: Runs, m: str, repeats: int) -> dict:
    secs, n_units = runs.seconds[m], len(runs.seconds[m])
    sec = sum(median(per_unit) for per_unit in secs)
    tokens = sum(len(t) for out in runs.token_ids[m] for t in out)
    st = runs.stats[m]
    last_repeat_s = sum(secs[u][-1] for u in range(n_units)) or 1.0
    return {"seconds_median": sec, "seconds_all": [sum(secs[u][r] for u in range(n_units)) for r in range(repeats)],
            "tokens": tokens, "tokens_per_s": tokens / sec if sec > 0 else float("nan"),
            "mean_accepted_length": st.get("mean_accepted_length", 0.0),
            "tau": st.get("tokens_per_target_forward", 1.0),
            "acceptance_rate_per_position": st.get("acceptance_rate_per_position", []),
            "draft_hit_rate": st.get("draft_hit_rate", 0.0),
            "drafted_tokens_per_step": st.get("drafted_tokens_per_step", 0.0),
            "policy_plan_fraction": runs.plan_s[m] / last_repeat_s,
            "steps": st.get("steps", 0), "draft_time_s": st.get("draft_time_s", 0.0),
            "verify_time_s": st.get("verify_time_s", 0.0),
            "token_ids": [t for out in runs.token_ids[m] for t in out]}


def _add_speedup(v: dict, base: dict) -> None:
    # paired: each repeat's ratio (the modes of one repeat ran back to back, so slow drifts of
    # a shared machine cancel), then the median over repeats
    scale = v["tokens"] / base["tokens"] if base["tokens"] else 1.0
    ratios = [b / x * scale for b, x in zip(base["seconds_all"], v["seconds_all"]) if x > 0]
    v["speedup"] = median(ratios or [float("nan")])
    v["speedup_ratios"] = ratios
    # how far the paired median can be trusted on this machine (see median_interval)
    lo, hi, cov = median_interval(ratios)
    v["speedup_interval"] = [lo, hi]
    v["speedup_interval_coverage"] = cov
    v["speedup_of_medians"] = v["tokens_per_s"] / base["tokens_per_s"]
    v["identical_to_ar"] = v["token_ids"] == base["token_ids"]


def compare(modes: dict, prompts: list[list[int]], repeats: int, batched: bool = False,
            baseline: str = "ar", concurrency: int | None = None) -> dict:
    """modes: {name: (llm, params)}, each with its own LLM. Batch 1 (batched=False): for every
    prompt all modes run back to back, in a (seeded) random order that changes from prompt to
    prompt and from repeat to repeat, so machine noise and position effects (a mode that runs
    right after itself finds its weights in the CPU caches) hit every mode alike; batched: the
    whole batch is one unit. Time of a mode = sum over units of the median over repeats; its
    speedup is the median over repeats of that repeat's time ratio to the baseline (paired).
    Stats (acceptance, tau, ...) are one repeat's, over all prompts (seeded: every repeat
    decodes the same tokens). concurrency: all prompts are one unit served with at most that
    many in flight (``generate_concurrent``)."""
    batched = batched or bool(concurrency)
    units = [prompts] if batched else [[p] for p in prompts]
    runs = _run_repeats(modes, units, repeats, batched, concurrency)
    res = {m: _mode_result(runs, m, repeats) for m in modes}
    base = res.get(baseline)
    if base:
        for v in res.values():
            _add_speedup(v, base)
    return res


def strip_ids(d: dict) -> dict:
    """A comparison's results without the token ids (for the JSON)."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in d.items()}
