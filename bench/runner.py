"""Running the modes of a comparison: engines built through specrt's public hooks, timed
generation, paired comparisons with a distribution-free interval of the median speedup.

Every comparison runs autoregressive (AR) and speculative decoding of the SAME target in the
same process, in a seeded random order that changes from unit to unit and repeat to repeat,
and reports medians over repeats.
"""
from __future__ import annotations

import dataclasses
import json
import os
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
    from specrt.models.sources import default_loader

    def load(path, role, dtype, device):
        key = (str(Path(path).resolve()), str(dtype), str(device))
        if key not in store:
            store[key] = default_loader(path, role, dtype, device)
        return store[key]
    return load


# ------------------------------------------------------------------------------- timing

def generate_concurrent(llm, prompts: list[list[int]], params, concurrency: int, tags: list[str] | None = None):
    """Serve ``prompts`` with at most ``concurrency`` requests in flight: the first
    ``concurrency`` start together, and each one that finishes is replaced by the next prompt at
    once (continuous batching, as a server under steady load sees it). Outputs in prompt order."""
    eng = llm.engine
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    tags = tags or ["default"] * len(prompts)
    ids: list[str] = []
    live: set[str] = set()
    done: dict = {}
    while len(done) < len(prompts):
        while len(live) < concurrency and len(ids) < len(prompts):
            i = len(ids)
            ids.append(eng.add_request(prompts[i], params[i], tag=tags[i]))
            live.add(ids[-1])
        for out in eng.step():
            if out.finished and out.request_id in live:
                live.discard(out.request_id)
                done[out.request_id] = out
    return [done[i] for i in ids]


def generate_timed(llm, prompts: list[list[int]], params, batched: bool,
                   concurrency: int | None = None, tags: list[str] | None = None) -> tuple[float, list[list[int]]]:
    """(seconds, token ids per prompt): batch 1 one prompt at a time, a whole batch, or
    continuous batching at a given concurrency. ``tags``: one request tag per prompt."""
    sync(llm.engine.device)
    t0 = now()
    if concurrency:
        outs = generate_concurrent(llm, prompts, params, concurrency, tags)
    elif tags is None:          # (a transformers mode takes no tags)
        outs = llm.generate(prompts, params) if batched else [llm.generate([p], params)[0] for p in prompts]
    elif batched:
        outs = llm.generate(prompts, params, tags=tags)
    else:
        outs = [llm.generate([p], params, tags=[t])[0] for p, t in zip(prompts, tags)]
    sync(llm.engine.device)
    return now() - t0, [o.token_ids for o in outs]


# ------------------------------------------------------------------------------- comparisons

@dataclasses.dataclass
class Runs:
    """What the repeats of one comparison measured, per mode."""

    seconds: dict          # mode -> [units][repeats] seconds
    token_ids: dict        # mode -> [units] -> [prompts of the unit] token ids (last repeat)
    stats: dict            # mode -> [repeats] the engine's statistics of each repeat (its total, or
                           # the mode's tag where modes share an engine)
    plan_s: dict           # mode -> policy planning seconds of the last repeat


def _shared_engines(modes: dict) -> set[str]:
    """The modes whose engine serves another mode too: their requests are tagged with the mode's
    name and their statistics read from that tag (an engine's total would mix the modes)."""
    users: dict[int, list[str]] = {}
    for m, (llm, _) in modes.items():
        users.setdefault(id(llm.engine), []).append(m)
    return {m for ms in users.values() if len(ms) > 1 for m in ms}


def _run_repeats(modes: dict, units: list, unit_tags: list, repeats: int, batched: bool,
                 concurrency: int | None, before_repeat) -> Runs:
    names = list(modes)
    shared = _shared_engines(modes)
    if shared and any(t is not None for t in unit_tags):
        raise ValueError(f"tags: modes {sorted(shared)} share an engine, which needs the tags to tell them apart")
    runs = Runs({m: [[0.0] * repeats for _ in units] for m in names}, {m: [None] * len(units) for m in names},
                {m: [] for m in names}, {m: 0.0 for m in names})
    for rep in range(repeats):
        if before_repeat is not None:
            before_repeat(rep)
        for m in names:      # no repeat drafts from an earlier repeat's answer to the same prompt
            modes[m][0].engine.reset_metrics()
            modes[m][0].engine.forget_outputs()
        for u, unit in enumerate(units):
            order = list(names)
            random.Random(1000 * rep + u).shuffle(order)
            for m in order:
                llm, params = modes[m]
                tags = [m] * len(unit) if m in shared else unit_tags[u]
                runs.seconds[m][u][rep], runs.token_ids[m][u] = generate_timed(llm, unit, params, batched,
                                                                               concurrency, tags)
        for m in names:
            snap = modes[m][0].stats()
            runs.stats[m].append(snap.get("by_tag", {}).get(m, {}) if m in shared else snap["total"])
            runs.plan_s[m] = snap.get("plan_time_s", 0.0)
    return runs


# the engine's statistics each mode reports (its "total" of the last repeat), with their defaults
# for a mode that keeps none (autoregressive, transformers)
_STATS = {"mean_accepted_length": 0.0, "acceptance_rate_per_position": [], "conditional_acceptance_per_position": [],
          "first_token_acceptance_rate": 0.0, "draft_hit_rate": 0.0, "drafted_tokens_per_step": 0.0, "steps": 0,
          "drafted_steps": 0, "draft_time_s": 0.0, "verify_time_s": 0.0, "step_time_s": 0.0,
          "draft_share_of_step": 0.0, "estimated_speedup": None}


def _mode_result(runs: Runs, m: str, repeats: int) -> dict:
    secs, n_units = runs.seconds[m], len(runs.seconds[m])
    sec = sum(median(per_unit) for per_unit in secs)
    tokens = sum(len(t) for out in runs.token_ids[m] for t in out)
    st = runs.stats[m][-1]
    last_repeat_s = sum(secs[u][-1] for u in range(n_units)) or 1.0
    return {"seconds_median": sec, "seconds_all": [sum(secs[u][r] for u in range(n_units)) for r in range(repeats)],
            "tokens": tokens, "tokens_per_s": tokens / sec if sec > 0 else float("nan"),
            "tau": st.get("tokens_per_target_forward", 1.0), **{k: st.get(k, d) for k, d in _STATS.items()},
            "estimated_speedup_all": [s.get("estimated_speedup") for s in runs.stats[m]],
            "policy_plan_fraction": runs.plan_s[m] / last_repeat_s,
            "token_ids": [t for out in runs.token_ids[m] for t in out]}


def paired_speedup(base: dict, v: dict) -> dict:
    """Mode result ``v`` against ``base`` (both from one comparison), paired: each repeat's time
    ratio (the modes of one repeat ran back to back, so slow drifts of a shared machine cancel),
    scaled by their token counts; the median over repeats and its interval (median_interval)."""
    scale = v["tokens"] / base["tokens"] if base["tokens"] else 1.0
    ratios = [b / x * scale for b, x in zip(base["seconds_all"], v["seconds_all"]) if x > 0]
    lo, hi, cov = median_interval(ratios)
    return {"speedup": median(ratios or [float("nan")]), "speedup_ratios": ratios, "speedup_interval": [lo, hi],
            "speedup_interval_coverage": cov}


def _add_speedup(v: dict, base: dict) -> None:
    v.update(paired_speedup(base, v))
    v["speedup_of_medians"] = v["tokens_per_s"] / base["tokens_per_s"]
    v["identical_to_ar"] = v["token_ids"] == base["token_ids"]


def compare(modes: dict, prompts: list[list[int]], repeats: int, batched: bool = False,
            baseline: str = "ar", concurrency: int | None = None, tags: list[str] | None = None,
            whole_pass: bool = False, before_repeat=None) -> dict:
    """modes: {name: (llm, params)}. Batch 1 (batched=False): for every prompt all modes run
    back to back, in a (seeded) random order that changes from prompt to prompt and from repeat
    to repeat, so machine noise and position effects (a mode that runs right after itself finds
    its weights in the CPU caches) hit every mode alike; batched: the whole batch is one unit.
    Time of a mode = sum over units of the median over repeats; its speedup is the median over
    repeats of that repeat's time ratio to the baseline (paired). Stats (acceptance, tau, ...)
    are one repeat's, over all prompts (seeded: every repeat decodes the same tokens). Modes may
    share an engine (e.g. with other sampling parameters): their requests are then tagged with
    the mode's name and each mode's stats are its tag's.
    concurrency: all prompts are one unit served with at most that many in flight
    (``generate_concurrent``). tags: a request tag per prompt. whole_pass: batch 1, but the modes
    alternate whole passes over the prompts (one unit), not prompt by prompt. before_repeat(rep):
    called before each repeat (untimed), e.g. to recalibrate. Each repeat starts with drafting's
    history of earlier outputs emptied (``forget_outputs``): suffix drafting would otherwise draft
    a repeated prompt from its own earlier answer."""
    batched = batched or bool(concurrency)
    if tags is not None and len(tags) != len(prompts):
        raise ValueError(f"tags: one per prompt ({len(prompts)}), got {len(tags)}")
    one_unit = batched or whole_pass
    units = [prompts] if one_unit else [[p] for p in prompts]
    unit_tags = [tags] if one_unit else [None if tags is None else [tags[i]] for i in range(len(prompts))]
    runs = _run_repeats(modes, units, unit_tags, repeats, batched, concurrency, before_repeat)
    res = {m: _mode_result(runs, m, repeats) for m in modes}
    base = res.get(baseline)
    if base:
        for v in res.values():
            _add_speedup(v, base)
    return res


def strip_ids(d: dict) -> dict:
    """A comparison's results without the token ids (for the JSON)."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in d.items()}


def write_json(report: dict, out: str) -> str:
    """Write a benchmark's report (anything json can't encode as its str) to ``out``; returns the path."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {out}")
    return out
