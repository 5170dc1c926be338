"""Step costs and the speedup they predict.

c = one draft step / one single-token target step; v(K) = t_target(K+1) / t_target(1) - 1;
the cost model's speedup is tau / (1 + c*K + v). Single forwards are timed over a private
scratch KV cache (values do not matter), interleaved round-robin so machine noise hits every
size alike.
"""
from __future__ import annotations

import math

import torch

from bench.runner import median, now, sync


def timed(fn, reps: int, device) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = now()
        fn()
        sync(device)
        times.append(now() - t0)
    return median(times)


def timed_interleaved(fns: dict, reps: int, device) -> dict:
    """Median seconds of each callable, timed round-robin (one call of each per round)."""
    for fn in fns.values():
        fn()
    sync(device)
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = now()
            fn()
            sync(device)
            times[k].append(now() - t0)
    return {k: median(v) for k, v in times.items()}


def scratch_cache(model, ctx: int, tokens: int, batch: int = 1, block_size: int = 16) -> torch.Tensor:
    """A KV cache big enough for `batch` requests of ctx + tokens positions (shared by timers)."""
    cfg = model.config
    nb = -(-(ctx + tokens) // block_size)
    return torch.zeros(cfg.num_layers, 2, nb * batch + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                       dtype=model.dtype, device=model.device)


def forward_timer(model, ctx: int, tokens: int, batch: int = 1, num_layers: int | None = None,
                  block_size: int = 16, all_logits: bool = True, cache: torch.Tensor | None = None,
                  window=None):
    """A closure running one forward of `tokens` new tokens per request after `ctx` cached
    positions, for `batch` requests, over a private scratch KV cache (values do not matter),
    followed by the sampling transform of its logits. ``window``: a specrt.models.attention.KVWindow the
    new tokens attend through (a draft's long-context view), as the engine builds it."""
    from specrt import ops
    from specrt.models.attention import AttentionMetadata

    cfg = model.config
    dev = model.device
    seq = ctx + tokens
    nb = -(-seq // block_size)
    if cache is None:
        cache = scratch_cache(model, ctx, tokens, batch, block_size)
    if cache.shape[2] < nb * batch:
        raise ValueError(f"scratch cache has {cache.shape[2]} blocks, need {nb * batch}")
    tables = [list(range(b * nb, (b + 1) * nb)) for b in range(batch)]
    meta = AttentionMetadata.build([seq] * batch, [tokens] * batch, tables, block_size, dev, window=window)
    ids = torch.randint(3, cfg.vocab_size, (tokens * batch,), device=dev)
    pos = torch.arange(ctx, seq, device=dev).repeat(batch)
    rows = torch.arange(tokens * batch, device=dev) if all_logits else \
        torch.arange(tokens - 1, tokens * batch, tokens, device=dev)
    n = rows.numel()
    temps = torch.zeros(n, device=dev)
    topk = torch.zeros(n, dtype=torch.int32, device=dev)
    topp = torch.ones(n, device=dev)

    def fn():
        logits, _ = model(ids, pos, meta, cache, num_layers=num_layers, logits_indices=rows)
        return ops.probs_from_logits(logits, temps, topk, topp, check_values=False)
    return fn


def draft_step_timer(drafter, target, ctx: int, kmax: int, target_cache: torch.Tensor):
    """(closure, tokens it drafts) timing one draft step of `drafter` from its public cost hint:
    one forward of the network it runs (``drafter.step_model()``), or, for a drafter that runs
    none, one ``propose`` of kmax tokens for a request with `ctx` tokens of context (its state
    kept between calls, as the engine keeps it between steps)."""
    hint = drafter.step_model()
    if hint is not None:
        model, num_layers = hint
        # a drafter reading the target's own KV (self:N) times over the target's scratch cache
        cache = target_cache if model is target else None
        return forward_timer(model, ctx, 1, num_layers=num_layers, cache=cache), 1
    from specrt.config import SamplingParams
    from specrt.drafters import DraftAsk
    from specrt.step.scheduler import Request

    context = [int(x) for x in torch.randint(3, 50, (ctx,))]
    request = Request("cost-probe", context, SamplingParams(temperature=0.0, max_tokens=1), seed=0)
    return (lambda: drafter.propose([request], DraftAsk([kmax]))), kmax


def measure_costs(llm_by_drafter: dict, kmax: int, ctx: int, reps: int) -> dict:
    """Single-forward costs on this machine, this run: target step vs number of verified tokens,
    one draft step per drafter (per drafted token), c and v."""
    eng = next(iter(llm_by_drafter.values())).engine
    target = eng.target
    ctx = min(ctx, eng.max_model_len - kmax - 2)
    t_cache = scratch_cache(target, ctx, kmax + 1)
    fns = {("target", T): forward_timer(target, ctx, T, cache=t_cache) for T in range(1, kmax + 2)}
    per_call = {}
    for name, llm in llm_by_drafter.items():
        if llm.engine.drafter is not None:
            fns[("draft", name)], per_call[name] = draft_step_timer(llm.engine.drafter, target, ctx, kmax, t_cache)
    times = timed_interleaved(fns, reps, eng.device)
    t_target = {T: times[("target", T)] for T in range(1, kmax + 2)}
    t1 = t_target[1]
    out = {"context_tokens": ctx, "target_step_s": t_target,
           "v": {K: t_target[K + 1] / t1 - 1.0 for K in range(1, kmax + 1)}, "draft_step_s": {}, "c": {}}
    for name, tokens in per_call.items():
        t = times[("draft", name)] / tokens       # per drafted token
        out["draft_step_s"][name] = t
        out["c"][name] = t / t1
    return out


def theoretical_speedup(tau: float, c: float, k: float, v: float) -> float:
    return tau / (1.0 + c * k + v)


def v_at(costs: dict, k: float) -> float:
    """v for a (possibly fractional) mean draft length, linear between measured integers."""
    if k <= 0:
        return 0.0
    vs = costs["v"]
    lo = max(1, min(int(math.floor(k)), max(vs)))
    hi = min(lo + 1, max(vs))
    f = min(max(k - lo, 0.0), 1.0)
    v_lo = vs[lo] if k >= 1 else vs[1] * k
    return v_lo + f * (vs[hi] - vs[lo])


def expected_accepted(fixed: dict) -> tuple[float, dict]:
    """E[accepted drafts per step] = sum_{i=1..K} r^i against the measurement, per fixed K.

    The engine's acceptance_rate_per_position[i] is accepted-at-i / drafted-at-i; with a fixed K
    every position is drafted every step (but where a request's last tokens or the drafter cut
    the draft short), so it is P(the first i+1 drafts are all accepted) (a survival curve), and
    the mean accepted length is its sum. Hence:
    r = the rate at position 0 of the smallest K (P(first draft accepted));
    formula_iid = sum_{i=1..K} r^i (every position accepted independently with probability r);
    formula_per_position = sum of the first K survival rates measured at the largest K (exact if
    the first K drafts do not depend on K, e.g. greedy drafting).
    The conditional rate P(i accepted | 0..i-1 accepted) is NOT s_i / s_{i-1}: the two rates are
    taken over different sets of steps (cut-short drafts), so their ratio can exceed 1; the
    engine counts it directly (``conditional_acceptance_per_position``, see specrt.observability.metrics)."""
    ks = sorted(int(k) for k in fixed)
    r = (fixed[ks[0]]["acceptance_rate_per_position"] or [0.0])[0]
    surv = fixed[ks[-1]]["acceptance_rate_per_position"]
    expected = {k: {"measured": fixed[k]["mean_accepted_length"],
                    "formula_iid": sum(r ** i for i in range(1, k + 1)),
                    "formula_per_position": sum(surv[:k])} for k in ks}
    return r, expected
