"""Microbenchmark of specrt's kernel ops against torch baselines (DESIGN.md section 2).

For every op and shape it times, interleaved round by round (medians),
  ours      the specrt op (value checks off: the kernel itself),
  torch     a fair VECTORISED torch implementation of the same op, written below the
            way production torch samplers do it (batched argmax, torch.rand coins +
            exponential-race residual sampling, topk/sort for top-k/top-p,
            index_copy for the KV cache),
  baseline  the straightforward torch version where it differs (issue 18):
            rejection_sample gathers p and q at the drafted ids, draws one uniform per
            position for the accept test and calls torch.multinomial on the normalised
            residual (or p_n); sample_tokens calls torch.multinomial,
  oracle    specrt/reference.py, the Python-loop specification (only where it is
            cheap enough; it is a correctness oracle, not a competitor).
Ratios are torch_ms / ours_ms and baseline_ms / ours_ms (> 1: specrt is faster).

Memory floor: the bytes the op must read + write, moved at the copy bandwidth measured in
the same run (on a CPU a copy of the same number of bytes, so the cache conditions
match; on a GPU a 1 GiB device-to-device copy); "x floor" is ours_ms / floor_ms.
The goals of issue 18 are printed at the end with their figures, per CPU thread count.

Timing: CUDA events on a GPU, time.perf_counter on the CPU.

Usage:
  python bench/kernels.py                 # full grid on the default device (cuda if available)
  python bench/kernels.py --quick         # small grid, 1 and 2 threads: a couple of minutes on a CPU
  python bench/kernels.py --device cpu --threads 1,2 --out bench/results/kernels-cpu.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specrt import ops, reference  # noqa: E402


# --------------------------------------------------------------------------- #
# Fair vectorised torch baselines (same contracts, torch-native randomness)
# --------------------------------------------------------------------------- #
def torch_probs_from_logits(logits, temperature, top_k, top_p):
    """[N, V] -> [N, V]: temperature, top-k (kth value, ties kept), softmax, top-p (sort + cumsum)."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"))
    greedy = temperature == 0
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    v = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < v), top_k, torch.full_like(top_k, v)).long()
    kmax = int(k.max()) if x.device.type == "cpu" else v   # on a GPU: no sync, full sort instead
    if kmax < v:
        top_vals = torch.topk(x, kmax, dim=-1).values
    else:
        top_vals = torch.sort(x, dim=-1, descending=True).values
    kth = top_vals.gather(-1, (k - 1).clamp(max=top_vals.shape[-1] - 1)[:, None])
    x = torch.where(x >= kth, x, torch.full_like(x, float("-inf")))
    p = torch.softmax(x, dim=-1)
    sorted_p, _ = torch.sort(p, dim=-1, descending=True)
    csum = torch.cumsum(sorted_p, dim=-1)
    cut_idx = torch.searchsorted(csum, top_p[:, None].contiguous()).clamp(max=v - 1)
    cut = sorted_p.gather(-1, cut_idx)
    p = torch.where((p >= cut) | (top_p[:, None] >= 1.0), p, torch.zeros_like(p))
    p = p / p.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(x.argmax(-1), v).float()
    return torch.where(greedy[:, None], one_hot, p)


def _accept_prefix(match: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> num_accepted [B]: length of the all-True prefix within num_draft_tokens."""
    k = match.shape[1]
    valid = torch.arange(k, device=match.device)[None, :] < num_draft_tokens[:, None]
    return torch.cumprod((match & valid).int(), dim=1).sum(1)


def _emit(draft_token_ids, num_accepted, final_tokens):
    """out[b, :n] = drafts, out[b, n] = final_tokens[b], -1 after."""
    b, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    drafts = torch.cat([draft_token_ids, torch.full_like(draft_token_ids[:, :1], -1)], dim=1)
    out = torch.where(pos < num_accepted[:, None], drafts, torch.full_like(drafts, -1))
    return torch.where(pos == num_accepted[:, None], final_tokens[:, None].int(), out), num_accepted.int()


def torch_verify_greedy(target_logits, draft_token_ids, num_draft_tokens):
    best = torch.nan_to_num(target_logits, nan=float("-inf")).argmax(-1)   # [B, K+1]
    k = draft_token_ids.shape[1]
    n = _accept_prefix(draft_token_ids.long() == best[:, :k], num_draft_tokens)
    return _emit(draft_token_ids, n, best.gather(1, n[:, None].long())[:, 0])


def torch_rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens):
    """vLLM-style: torch.rand coins, residual race with exponential noise at every position."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    ids = draft_token_ids.long().clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, ids[..., None])[..., 0]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        q = torch.zeros_like(target_probs[:, :k]).scatter_(-1, ids[..., None], 1.0)
    else:
        q_x = draft_probs.gather(-1, ids[..., None])[..., 0]
        q = draft_probs
    u = torch.rand_like(p_x)
    n = _accept_prefix(u * q_x < p_x, num_draft_tokens)
    residual = torch.cat([(target_probs[:, :k] - q).clamp_(min=0), target_probs[:, k:]], dim=1)
    rows = residual.gather(1, n.long()[:, None, None].expand(b, 1, v))[:, 0]          # [B, V]
    p_rows = target_probs.gather(1, n.long()[:, None, None].expand(b, 1, v))[:, 0]
    rejected = n < num_draft_tokens
    empty = rows.sum(-1) == 0
    rows = torch.where((rejected & ~empty)[:, None], rows, p_rows)
    noise = torch.empty_like(rows).exponential_()
    return _emit(draft_token_ids, n, (rows / noise).argmax(-1))


def torch_coupled(target_probs, draft_token_ids, num_draft_tokens):
    noise = torch.empty_like(target_probs).exponential_()
    winners = (target_probs / noise).argmax(-1)                                        # [B, K+1]
    k = draft_token_ids.shape[1]
    n = _accept_prefix(draft_token_ids.long() == winners[:, :k], num_draft_tokens)
    return _emit(draft_token_ids, n, winners.gather(1, n[:, None].long())[:, 0])


def torch_sample_tokens(probs):
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1).int()


def baseline_rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens):
    """The straightforward torch version: gather p and q at the drafted ids, one uniform per
    position for the accept test, torch.multinomial on the normalised residual (p_n after
    accepting everything; p when the residual is all zero)."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    ids = draft_token_ids.long().clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, ids[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, ids[..., None])[..., 0]
    n = _accept_prefix(torch.rand_like(p_x) * q_x < p_x, num_draft_tokens).long()   # [B]
    rows = torch.arange(b, device=target_probs.device)
    p_row = target_probs[rows, n]                                                        # [B, V]
    at = n.clamp(max=max(k - 1, 0))
    if draft_probs is None:
        q_row = torch.zeros_like(p_row).scatter_(-1, ids[rows, at][:, None], 1.0)
    else:
        q_row = draft_probs[rows, at]
    residual = torch.where((n < num_draft_tokens)[:, None], (p_row - q_row).clamp_(min=0), p_row)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total, p_row)
    return _emit(draft_token_ids, n, torch.multinomial(residual, 1)[:, 0])


def baseline_sample_tokens(probs):
    return torch.multinomial(probs, 1)[:, 0].int()


def torch_copy_blocks(caches, src, dst):
    for cache in caches:
        cache.index_copy_(2, dst, cache.index_select(2, src))


def torch_write_kv(cache, layer, k, v, slots):
    bs = cache.shape[3]
    flat_k = cache[layer, 0].view(-1, *cache.shape[4:])
    flat_v = cache[layer, 1].view(-1, *cache.shape[4:])
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)
    del bs


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #
def _time_once(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_paired(fns: dict[str, Callable[[], object]], device: str, reps: int, warmup: int = 2,
                budget_s: float = 2.0) -> dict[str, float]:
    """Median milliseconds of each fn, timed in alternation (one round = each fn once), so
    that a slow spell on a shared machine hits every contestant alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_time_once(fn, device))
        if time.perf_counter() - start > budget_s and len(times[next(iter(fns))]) >= 3:
            break
    return {name: statistics.median(t) for name, t in times.items()}


def time_ms(fn: Callable[[], object], device: str, reps: int, warmup: int = 2, budget_s: float = 2.0) -> float:
    """Median milliseconds of fn(); CUDA events on a GPU, perf_counter on the CPU."""
    return time_paired({"fn": fn}, device, reps, warmup, budget_s)["fn"]


def copy_bandwidth_gbs(device: str) -> float | None:
    """Device-to-device copy bandwidth (read + write bytes / s) in GB/s: 1 GiB on a GPU,
    64 MiB (beyond the caches) on a CPU."""
    n = (256 << 20) if device == "cuda" else (16 << 20)
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=20, warmup=3)
    del src, dst
    return 2 * n * 4 / (ms * 1e-3) / 1e9


class MemoryFloor:
    """Milliseconds to move `nbytes` (read + write) at the copy bandwidth of this run. On a
    CPU the copy has the same size as the op's traffic (same cache conditions, timed once
    per size); on a GPU the 1 GiB bandwidth is used."""

    def __init__(self, device: str, reps: int):
        self.device, self.reps = device, reps
        self.big_gbs = copy_bandwidth_gbs(device)
        self._ms: dict[int, float] = {}

    def ms(self, nbytes: int) -> float:
        if self.device == "cuda":
            return nbytes / (self.big_gbs * 1e9) * 1e3
        if nbytes not in self._ms:
            src = torch.empty(max(nbytes // 8, 1))          # copying n floats moves 8n bytes
            dst = torch.empty_like(src)
            self._ms[nbytes] = time_ms(lambda: dst.copy_(src), self.device, reps=max(self.reps, 20), budget_s=0.3)
        return self._ms[nbytes]


@dataclass
class Row:
    op: str
    B: int
    K: int
    V: int
    ours_ms: float
    torch_ms: float
    ratio: float                          # torch_ms / ours_ms
    oracle_ms: float | None = None
    bytes_floor: int | None = None        # bytes the op must read + write
    gbs: float | None = None              # bytes_floor / ours time
    pct_of_copy_bw: float | None = None
    baseline_ms: float | None = None      # the straightforward torch version (issue 18)
    baseline_ratio: float | None = None   # baseline_ms / ours_ms
    floor_ms: float | None = None         # bytes_floor at this run's copy bandwidth
    x_floor: float | None = None          # ours_ms / floor_ms
    threads: int | None = None            # torch CPU threads (None on a GPU)
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
def make_spec_inputs(b, k, v, device, g):
    """Generated on `device` (g is a generator there): realistic softmax rows, a
    perturbed draft, drafts sampled from it, mixed draft lengths."""
    logits = torch.randn(b, k + 1, v, generator=g, device=device) * 2.0
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits[:, :k] + torch.randn(b, k, v, generator=g, device=device), -1)
    ids = torch.multinomial(draft.reshape(-1, v), 1, generator=g).view(b, k).int() if k else \
        torch.zeros(b, 0, dtype=torch.int32, device=device)
    nd = torch.full((b,), k, dtype=torch.int32, device=device)
    nd[::4] = max(k - 2, 0)   # mixed draft lengths
    seeds = torch.randint(0, 2**62, (b,), generator=g, device=device)
    pos = torch.randint(0, 2**20, (b,), generator=g, device=device)
    return logits, target, draft, ids.contiguous(), nd, seeds, pos


def bench_all(device: str, quick: bool, reps: int, oracle: bool, floor: MemoryFloor,
              threads: int | None = None) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    if quick:
        grid = [(1, 4, 32000), (8, 4, 32000), (8, 4, 128256)]
    else:
        grid = [(b, k, v) for v in (32000, 128256) for k in (4, 8) for b in (1, 8, 64)]
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    budget = (0.4 if quick else 1.5) if device == "cpu" else 0.5

    def add(op, b, k, v, ours, base, floor_bytes, baseline=None, oracle_fn=None, **extra):
        fns = {"ours": ours, "torch": base}
        if baseline is not None:
            fns["baseline"] = baseline
        ms = time_paired(fns, device, reps, budget_s=budget)
        o, t = ms["ours"], ms["torch"]
        bl = ms.get("baseline", t if op == "probs_from_logits" else None)
        orc = None
        if oracle_fn is not None:
            t0 = time.perf_counter()
            oracle_fn()
            sync()
            orc = (time.perf_counter() - t0) * 1e3
        gbs = floor_bytes / (o * 1e-3) / 1e9
        pct = 100.0 * gbs / floor.big_gbs if device == "cuda" else None
        fl = floor.ms(floor_bytes)
        r = Row(op, b, k, v, o, t, t / o, orc, floor_bytes, gbs, pct, bl, None if bl is None else bl / o,
                fl, o / fl, threads, extra)
        rows.append(r)
        print(fmt_row(r), flush=True)

    print(header(threads), flush=True)
    for b, k, v in grid:
        logits, target, draft, ids, nd, seeds, pos = make_spec_inputs(b, k, v, device, g)
        cheap_oracle = oracle and b * v <= 8 * 32000 and device == "cpu"
        on_cpu = lambda *ts: [None if x is None else x.cpu() for x in ts]   # noqa: E731
        nrows = b * (k + 1)
        flat_logits = logits.reshape(nrows, v)
        temp = torch.full((nrows,), 0.8, device=device)
        temp[::5] = 0.0
        topk = torch.full((nrows,), 50, dtype=torch.int32, device=device)
        topk[1::3] = 0
        topp = torch.full((nrows,), 0.9, device=device)
        topp[2::3] = 1.0
        add("probs_from_logits", b, k, v,
            lambda: ops.probs_from_logits(flat_logits, temp, topk, topp, check_values=False),
            lambda: torch_probs_from_logits(flat_logits, temp, topk, topp),
            floor_bytes=2 * nrows * v * 4)
        add("verify_greedy", b, k, v,
            lambda: ops.verify_greedy(logits, ids, nd, check_values=False),
            lambda: torch_verify_greedy(logits, ids, nd),
            floor_bytes=nrows * v * 4,
            oracle_fn=(lambda: reference.verify_greedy(*on_cpu(logits, ids, nd))) if cheap_oracle else None)
        out, acc = ops.rejection_sample(target, draft, ids, nd, seeds, pos, check_values=False)
        add("rejection_sample", b, k, v,
            lambda: ops.rejection_sample(target, draft, ids, nd, seeds, pos, check_values=False),
            lambda: torch_rejection_sample(target, draft, ids, nd),
            baseline=lambda: baseline_rejection_sample(target, draft, ids, nd),
            floor_bytes=b * v * 8,   # the one sampled row of p and of q per request
            oracle_fn=(lambda: reference.rejection_sample(*on_cpu(target, draft, ids, nd, seeds, pos)))
            if cheap_oracle else None,
            mean_accepted=float(acc.float().mean()))
        if device == "cpu":   # the default (validating) CPU call, for reference
            rows[-1].extra["ours_checked_ms"] = time_ms(
                lambda: ops.rejection_sample(target, draft, ids, nd, seeds, pos), device, reps, budget_s=budget)
        add("rejection_sample[one-hot q]", b, k, v,
            lambda: ops.rejection_sample(target, None, ids, nd, seeds, pos, check_values=False),
            lambda: torch_rejection_sample(target, None, ids, nd),
            baseline=lambda: baseline_rejection_sample(target, None, ids, nd),
            floor_bytes=b * v * 4)
        out, acc = ops.rejection_sample(target, None, ids, nd, seeds, pos, method="coupled", check_values=False)
        add("rejection_sample[coupled]", b, k, v,
            lambda: ops.rejection_sample(target, None, ids, nd, seeds, pos, method="coupled", check_values=False),
            lambda: torch_coupled(target, ids, nd),
            floor_bytes=int((acc.long() + 1).sum()) * v * 4)
        probs0 = target[:, 0].contiguous()
        add("sample_tokens", b, 0, v,
            lambda: ops.sample_tokens(probs0, seeds, pos, check_values=False),
            lambda: torch_sample_tokens(probs0),
            baseline=lambda: baseline_sample_tokens(probs0),
            floor_bytes=b * v * 4,
            oracle_fn=(lambda: reference.sample_tokens(*on_cpu(probs0, seeds, pos))) if cheap_oracle else None)
        del logits, target, draft, flat_logits

    # KV cache ops: a Llama-3-8B-like target cache (bf16) plus a small draft cache.
    layers, kv_heads, head_dim, block_size = (4, 8, 128, 16) if (quick or device == "cpu") else (32, 8, 128, 16)
    num_blocks = 256
    for pairs in ((4,) if quick else (1, 16, 64)):
        tgt = torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, device=device).to(torch.bfloat16)
        drf = torch.randn(2, 2, num_blocks, block_size, 4, 64, device=device).to(torch.bfloat16)
        perm = torch.randperm(num_blocks, generator=g, device=device)[: 2 * pairs]
        mapping = torch.stack([perm[:pairs], perm[pairs:]], 1).contiguous()
        src, dst = mapping[:, 0].contiguous(), mapping[:, 1].contiguous()
        block_bytes = sum(c[:, :, 0].numel() * c.element_size() for c in (tgt, drf))
        add("copy_blocks", pairs, 0, 0,
            lambda: ops.copy_blocks([tgt, drf], mapping, check_values=False),
            lambda: torch_copy_blocks([tgt, drf], src, dst),
            floor_bytes=2 * pairs * block_bytes)
        del tgt, drf
    cache = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    for tokens in ((64,) if quick else (8, 64, 512)):
        kk = torch.randn(tokens, kv_heads, head_dim, device=device).to(torch.bfloat16)
        vv = torch.randn_like(kk)
        slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:tokens]
        add("write_kv", tokens, 0, 0,
            lambda: ops.write_kv(cache, 1, kk, vv, slots, check_values=False),
            lambda: torch_write_kv(cache, 1, kk, vv, slots),
            floor_bytes=2 * 2 * kk.numel() * kk.element_size())
    return rows


# issue 18's goals: (op, B, K, V, minimum baseline_ms / ours_ms, the goal in words)
GOALS = [
    ("rejection_sample", 8, 4, 32000, 5.0, "rejection_sample B=8 K=4 V=32000 >= 5x torch baseline"),
    ("sample_tokens", 8, 0, 32000, 3.0, "sample_tokens B=8 V=32000 >= 3x torch.multinomial"),
    ("probs_from_logits", 8, 4, 32000, 3.0, "probs_from_logits 40x32000 >= 3x torch"),
]


def goal_lines(rows: list[Row]) -> list[str]:
    """One line per goal and thread count: the figure (baseline_ms / ours_ms) and the floor."""
    lines = [f"{'goal':56s} {'threads':>7s} {'figure':>8s} {'ours ms':>9s} {'floor ms':>9s} {'x floor':>8s}"]
    for op, b, k, v, want, goal in GOALS:
        for r in rows:
            if (r.op, r.B, r.K, r.V) != (op, b, k, v) or r.baseline_ratio is None:
                continue
            verdict = "met" if r.baseline_ratio >= want else "MISSED"
            threads = "-" if r.threads is None else str(r.threads)
            lines.append(f"{goal:56s} {threads:>7s} {r.baseline_ratio:7.1f}x {r.ours_ms:9.3f} {r.floor_ms:9.3f} "
                         f"{r.x_floor:8.1f}  {verdict}")
    return lines


def header(threads: int | None = None) -> str:
    title = f"-- {threads} CPU thread{'s' if threads != 1 else ''}" if threads else ""
    cols = (f"{'op':30s} {'B':>4s} {'K':>2s} {'V':>7s} {'ours ms':>9s} {'torch ms':>9s} {'ratio':>7s} "
            f"{'base ms':>9s} {'ratio':>7s} {'oracle ms':>10s} {'floor ms':>9s} {'x floor':>8s} {'GB/s':>7s}")
    return f"{title}\n{cols}" if title else cols


def fmt_row(r: Row) -> str:
    orc = f"{r.oracle_ms:10.1f}" if r.oracle_ms is not None else f"{'-':>10s}"
    base = (f"{r.baseline_ms:9.3f} {r.baseline_ratio:7.2f}" if r.baseline_ms is not None and r.op != "probs_from_logits"
            else f"{'-':>9s} {'-':>7s}")
    return (f"{r.op:30s} {r.B:4d} {r.K:2d} {r.V:7d} {r.ours_ms:9.3f} {r.torch_ms:9.3f} {r.ratio:7.2f} "
            f"{base} {orc} {r.floor_ms:9.3f} {r.x_floor:8.1f} {r.gbs:7.1f}")


def _cpu_isa() -> str | None:
    """The instruction set specrt's CPU kernels use (None for builds without the hook)."""
    try:
        return torch.ops.specrt.cpu_isa()
    except (AttributeError, RuntimeError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda when available and specrt has CUDA kernels, else cpu")
    ap.add_argument("--quick", action="store_true", help="small grid (a couple of minutes on a CPU)")
    ap.add_argument("--threads", default="1,2",
                    help="CPU only: comma-separated torch thread counts, one grid each (default 1,2)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--no-oracle", action="store_true", help="skip timing specrt/reference.py")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and ops.cuda_built() else "cpu")
    if device == "cuda" and not ops.cuda_built():
        ap.error("this specrt build has no CUDA kernels (rebuild with SPECRT_CUDA=1)")
    try:
        thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if not thread_counts or min(thread_counts) < 1:
        ap.error(f"--threads must list thread counts >= 1, got {args.threads!r}")
    reps = args.reps or (7 if device == "cpu" else 30)
    floor = MemoryFloor(device, reps)
    rows: list[Row] = []
    before = torch.get_num_threads()
    try:
        for threads in (thread_counts if device == "cpu" else [None]):
            if threads is not None:
                torch.set_num_threads(threads)
            rows += bench_all(device, args.quick, reps, not args.no_oracle, floor, threads)
    finally:
        torch.set_num_threads(before)
    meta = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "cpu_threads": thread_counts if device == "cpu" else torch.get_num_threads(),
        "cpu_isa": _cpu_isa() if device == "cpu" else None,
        "torch": torch.__version__,
        "cuda_built": ops.cuda_built(),
        "copy_bandwidth_gbs": floor.big_gbs,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "ratio": "torch_ms / ours_ms and baseline_ms / ours_ms (> 1 means specrt is faster)",
    }
    print(f"copy bandwidth ({'1 GiB' if device == 'cuda' else '64 MiB'} device-to-device): "
          f"{floor.big_gbs:.1f} GB/s" + (f"; CPU path: {meta['cpu_isa']}" if device == "cpu" else ""))
    headline = [r for r in rows if r.op == "rejection_sample" and (r.B, r.K, r.V) == (8, 4, 32000)]
    for r in headline:
        on = f"{device}, {r.threads} thread(s)" if r.threads else device
        print(f"headline: rejection_sample B=8 K=4 V=32000 on {on}: {r.ratio:.2f}x vs vectorised torch, "
              f"{r.baseline_ratio:.2f}x vs the straightforward torch version")
    print("\n".join(goal_lines(rows)))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
