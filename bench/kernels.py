"""Microbenchmark of specrt's kernel ops against torch baselines (DESIGN.md section 2).

For every op and shape it times
  ours      the specrt op (value checks off: the kernel itself),
  torch     a fair VECTORISED torch implementation of the same op, written below the
            way production torch samplers do it (batched argmax, torch.rand coins +
            exponential-race residual sampling, topk/sort for top-k/top-p,
            index_copy for the KV cache). This is the headline ratio.
  oracle    specrt/reference.py, the Python-loop specification (only where it is
            cheap enough; it is a correctness oracle, not a competitor).
The ratio is torch_ms / ours_ms (> 1: specrt is faster).

Timing: CUDA events on a GPU (median of `reps` after warm-up), repeated
time.perf_counter medians on the CPU. On a GPU it also reports the achieved GB/s
against the memory-bound floor: bytes the op must read + write, divided by the
device-to-device copy bandwidth measured in the same run.

Usage:
  python bench/kernels.py                 # full grid on the default device (cuda if available)
  python bench/kernels.py --quick         # small grid; a couple of minutes on a laptop CPU
  python bench/kernels.py --device cpu --out bench/results/kernels-cpu.json
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
def time_ms(fn: Callable[[], object], device: str, reps: int, warmup: int = 2, budget_s: float = 2.0) -> float:
    """Median milliseconds of fn(); CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    start_all = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
            if time.perf_counter() - start_all > budget_s and len(times) >= 3:
                break
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if time.perf_counter() - start_all > budget_s and len(times) >= 3:
                break
    return statistics.median(times)


def copy_bandwidth_gbs(device: str) -> float | None:
    """Device-to-device copy bandwidth (read + write bytes / s) in GB/s."""
    if device != "cuda":
        return None
    n = 256 << 20   # 1 GiB of float32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=20, warmup=3)
    del src, dst
    return 2 * n * 4 / (ms * 1e-3) / 1e9


@dataclass
class Row:
    op: str
    B: int
    K: int
    V: int
    ours_ms: float
    torch_ms: float
    ratio: float
    oracle_ms: float | None = None
    bytes_floor: int | None = None
    gbs: float | None = None
    pct_of_copy_bw: float | None = None
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


def bench_all(device: str, quick: bool, reps: int, oracle: bool) -> tuple[list[Row], dict]:
    g = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    copy_bw = copy_bandwidth_gbs(device)
    if quick:
        grid = [(1, 4, 32000), (8, 4, 32000), (8, 8, 32000), (1, 4, 128256), (8, 4, 128256)]
    else:
        grid = [(b, k, v) for v in (32000, 128256) for k in (4, 8) for b in (1, 8, 64)]
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)

    budget = 2.0 if device == "cpu" else 0.5

    def add(op, b, k, v, ours, base, floor=None, oracle_fn=None, **extra):
        o = time_ms(ours, device, reps, budget_s=budget)
        t = time_ms(base, device, reps, budget_s=budget)
        orc = None
        if oracle_fn is not None:
            t0 = time.perf_counter()
            oracle_fn()
            sync()
            orc = (time.perf_counter() - t0) * 1e3
        gbs = pct = None
        if floor is not None and device == "cuda":
            gbs = floor / (o * 1e-3) / 1e9
            pct = 100.0 * gbs / copy_bw if copy_bw else None
        r = Row(op, b, k, v, o, t, t / o, orc, floor, gbs, pct, extra)
        rows.append(r)
        print(fmt_row(r), flush=True)

    print(header(), flush=True)
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
            floor=2 * nrows * v * 4)
        add("verify_greedy", b, k, v,
            lambda: ops.verify_greedy(logits, ids, nd, check_values=False),
            lambda: torch_verify_greedy(logits, ids, nd),
            floor=nrows * v * 4,
            oracle_fn=(lambda: reference.verify_greedy(*on_cpu(logits, ids, nd))) if cheap_oracle else None)
        out, acc = ops.rejection_sample(target, draft, ids, nd, seeds, pos, check_values=False)
        add("rejection_sample", b, k, v,
            lambda: ops.rejection_sample(target, draft, ids, nd, seeds, pos, check_values=False),
            lambda: torch_rejection_sample(target, draft, ids, nd),
            floor=b * v * 8,   # one target row + one draft row per request
            oracle_fn=(lambda: reference.rejection_sample(*on_cpu(target, draft, ids, nd, seeds, pos)))
            if cheap_oracle else None,
            mean_accepted=float(acc.float().mean()))
        if device == "cpu":   # the default (validating) CPU call, for reference
            rows[-1].extra["ours_checked_ms"] = time_ms(
                lambda: ops.rejection_sample(target, draft, ids, nd, seeds, pos), device, reps)
        add("rejection_sample[one-hot q]", b, k, v,
            lambda: ops.rejection_sample(target, None, ids, nd, seeds, pos, check_values=False),
            lambda: torch_rejection_sample(target, None, ids, nd),
            floor=b * v * 4)
        out, acc = ops.rejection_sample(target, None, ids, nd, seeds, pos, method="coupled", check_values=False)
        add("rejection_sample[coupled]", b, k, v,
            lambda: ops.rejection_sample(target, None, ids, nd, seeds, pos, method="coupled", check_values=False),
            lambda: torch_coupled(target, ids, nd),
            floor=int((acc.long() + 1).sum()) * v * 4)
        probs0 = target[:, 0].contiguous()
        add("sample_tokens", b, 0, v,
            lambda: ops.sample_tokens(probs0, seeds, pos, check_values=False),
            lambda: torch_sample_tokens(probs0),
            floor=b * v * 4,
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
            floor=2 * pairs * block_bytes)
        del tgt, drf
    cache = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    for tokens in ((64,) if quick else (8, 64, 512)):
        kk = torch.randn(tokens, kv_heads, head_dim, device=device).to(torch.bfloat16)
        vv = torch.randn_like(kk)
        slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:tokens]
        add("write_kv", tokens, 0, 0,
            lambda: ops.write_kv(cache, 1, kk, vv, slots, check_values=False),
            lambda: torch_write_kv(cache, 1, kk, vv, slots),
            floor=2 * 2 * kk.numel() * kk.element_size())
    meta = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda_built": ops.cuda_built(),
        "copy_bandwidth_gbs": copy_bw,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "quick": quick,
        "ratio": "torch_ms / ours_ms (> 1 means specrt is faster)",
    }
    return rows, meta


def header() -> str:
    return (f"{'op':30s} {'B':>4s} {'K':>2s} {'V':>7s} {'ours ms':>9s} {'torch ms':>9s} {'ratio':>7s} "
            f"{'oracle ms':>10s} {'GB/s':>8s} {'%copy':>6s}")


def fmt_row(r: Row) -> str:
    orc = f"{r.oracle_ms:10.1f}" if r.oracle_ms is not None else f"{'-':>10s}"
    gbs = f"{r.gbs:8.1f}" if r.gbs is not None else f"{'-':>8s}"
    pct = f"{r.pct_of_copy_bw:6.1f}" if r.pct_of_copy_bw is not None else f"{'-':>6s}"
    return (f"{r.op:30s} {r.B:4d} {r.K:2d} {r.V:7d} {r.ours_ms:9.3f} {r.torch_ms:9.3f} {r.ratio:7.2f} "
            f"{orc} {gbs} {pct}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda when available and specrt has CUDA kernels, else cpu")
    ap.add_argument("--quick", action="store_true", help="small grid (a couple of minutes on a CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--no-oracle", action="store_true", help="skip timing specrt/reference.py")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and ops.cuda_built() else "cpu")
    if device == "cuda" and not ops.cuda_built():
        ap.error("this specrt build has no CUDA kernels (rebuild with SPECRT_CUDA=1)")
    reps = args.reps or (5 if device == "cpu" else 30)
    rows, meta = bench_all(device, args.quick, reps, oracle=not args.no_oracle)
    if meta["copy_bandwidth_gbs"]:
        print(f"device-to-device copy bandwidth: {meta['copy_bandwidth_gbs']:.0f} GB/s")
    headline = [r for r in rows if r.op == "rejection_sample" and (r.B, r.K, r.V) == (8, 4, 32000)]
    if headline:
        print(f"headline: rejection_sample B=8 K=4 V=32000 on {device}: {headline[0].ratio:.2f}x vs vectorised torch")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
