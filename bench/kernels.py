"""Microbenchmark of specrt's kernel ops against torch baselines (docs/architecture.md section 2).

For every op and shape it times, interleaved round by round (medians),
  ours      the specrt op (value checks off: the kernel itself),
  torch     a fair VECTORISED torch implementation of the same op (bench/kernel_baselines.py),
            the way production torch samplers do it (batched argmax, torch.rand coins +
            exponential-race residual sampling, topk/sort for top-k/top-p,
            index_copy for the KV cache),
  baseline  the straightforward torch version where it differs (issue 18):
            rejection_sample gathers p and q at the drafted ids, draws one uniform per
            position for the accept test and calls torch.multinomial on the normalised
            residual (or p_n); sample_tokens calls torch.multinomial,
  oracle    specrt/ops/reference.py, the Python-loop specification (only where it is
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
  python -m bench.kernels --quick --no-attention   # the same, as a module of the bench package

The "attention" section (last; --no-attention skips it) runs bench/attention.py's verify-step
attention, the paged kernel vs the gather + SDPA path at SmolLM2's shapes, with its goal
(>= 2x), into the same output and JSON.
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

# the checkout, after site-packages: an installed specrt wins (and its spawned workers agree)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.kernel_baselines import (baseline_rejection_sample, baseline_sample_tokens,  # noqa: E402
                                    torch_copy_blocks, torch_coupled, torch_probs_from_logits,
                                    torch_rejection_sample, torch_sample_tokens, torch_verify_greedy,
                                    torch_write_kv)
from specrt import ops  # noqa: E402
from specrt.ops import reference  # noqa: E402


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


class Bencher:
    """Times contestants of one op and shape in alternation and records a Row per call."""

    def __init__(self, device: str, quick: bool, reps: int, floor: MemoryFloor, threads: int | None):
        self.device, self.reps, self.floor, self.threads = device, reps, floor, threads
        self.budget = (0.4 if quick else 1.5) if device == "cpu" else 0.5
        self.rows: list[Row] = []

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def add(self, op, b, k, v, ours, base, floor_bytes, baseline=None, oracle_fn=None, **extra) -> Row:
        fns = {"ours": ours, "torch": base}
        if baseline is not None:
            fns["baseline"] = baseline
        ms = time_paired(fns, self.device, self.reps, budget_s=self.budget)
        o, t = ms["ours"], ms["torch"]
        bl = ms.get("baseline", t if op == "probs_from_logits" else None)
        orc = None
        if oracle_fn is not None:
            t0 = time.perf_counter()
            oracle_fn()
            self.sync()
            orc = (time.perf_counter() - t0) * 1e3
        gbs = floor_bytes / (o * 1e-3) / 1e9
        pct = 100.0 * gbs / self.floor.big_gbs if self.device == "cuda" else None
        fl = self.floor.ms(floor_bytes)
        r = Row(op, b, k, v, o, t, t / o, orc, floor_bytes, gbs, pct, bl, None if bl is None else bl / o,
                fl, o / fl, self.threads, extra)
        self.rows.append(r)
        print(fmt_row(r), flush=True)
        return r


def bench_sampling(bn: Bencher, b: int, k: int, v: int, g, oracle: bool) -> None:
    """probs_from_logits, verify_greedy, rejection_sample (3 variants), sample_tokens at B, K, V."""
    device = bn.device
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
    bn.add("probs_from_logits", b, k, v,
           lambda: ops.probs_from_logits(flat_logits, temp, topk, topp, check_values=False),
           lambda: torch_probs_from_logits(flat_logits, temp, topk, topp),
           floor_bytes=2 * nrows * v * 4)
    bn.add("verify_greedy", b, k, v,
           lambda: ops.verify_greedy(logits, ids, nd, check_values=False),
           lambda: torch_verify_greedy(logits, ids, nd),
           floor_bytes=nrows * v * 4,
           oracle_fn=(lambda: reference.verify_greedy(*on_cpu(logits, ids, nd))) if cheap_oracle else None)
    out, acc = ops.rejection_sample(target, draft, ids, nd, seeds, pos, check_values=False)
    row = bn.add("rejection_sample", b, k, v,
                 lambda: ops.rejection_sample(target, draft, ids, nd, seeds, pos, check_values=False),
                 lambda: torch_rejection_sample(target, draft, ids, nd),
                 baseline=lambda: baseline_rejection_sample(target, draft, ids, nd),
                 floor_bytes=b * v * 8,   # the one sampled row of p and of q per request
                 oracle_fn=(lambda: reference.rejection_sample(*on_cpu(target, draft, ids, nd, seeds, pos)))
                 if cheap_oracle else None,
                 mean_accepted=float(acc.float().mean()))
    if device == "cpu":   # the default (validating) CPU call, for reference
        row.extra["ours_checked_ms"] = time_ms(
            lambda: ops.rejection_sample(target, draft, ids, nd, seeds, pos), device, bn.reps, budget_s=bn.budget)
    bn.add("rejection_sample[one-hot q]", b, k, v,
           lambda: ops.rejection_sample(target, None, ids, nd, seeds, pos, check_values=False),
           lambda: torch_rejection_sample(target, None, ids, nd),
           baseline=lambda: baseline_rejection_sample(target, None, ids, nd),
           floor_bytes=b * v * 4)
    out, acc = ops.rejection_sample(target, None, ids, nd, seeds, pos, method="coupled", check_values=False)
    bn.add("rejection_sample[coupled]", b, k, v,
           lambda: ops.rejection_sample(target, None, ids, nd, seeds, pos, method="coupled", check_values=False),
           lambda: torch_coupled(target, ids, nd),
           floor_bytes=int((acc.long() + 1).sum()) * v * 4)
    probs0 = target[:, 0].contiguous()
    bn.add("sample_tokens", b, 0, v,
           lambda: ops.sample_tokens(probs0, seeds, pos, check_values=False),
           lambda: torch_sample_tokens(probs0),
           baseline=lambda: baseline_sample_tokens(probs0),
           floor_bytes=b * v * 4,
           oracle_fn=(lambda: reference.sample_tokens(*on_cpu(probs0, seeds, pos))) if cheap_oracle else None)


def bench_kv(bn: Bencher, quick: bool, g) -> None:
    """copy_blocks and write_kv on a Llama-3-8B-like target cache (bf16) plus a small draft cache."""
    device = bn.device
    layers, kv_heads, head_dim, block_size = (4, 8, 128, 16) if (quick or device == "cpu") else (32, 8, 128, 16)
    num_blocks = 256
    for pairs in ((4,) if quick else (1, 16, 64)):
        tgt = torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, device=device).to(torch.bfloat16)
        drf = torch.randn(2, 2, num_blocks, block_size, 4, 64, device=device).to(torch.bfloat16)
        perm = torch.randperm(num_blocks, generator=g, device=device)[: 2 * pairs]
        mapping = torch.stack([perm[:pairs], perm[pairs:]], 1).contiguous()
        src, dst = mapping[:, 0].contiguous(), mapping[:, 1].contiguous()
        block_bytes = sum(c[:, :, 0].numel() * c.element_size() for c in (tgt, drf))
        bn.add("copy_blocks", pairs, 0, 0,
               lambda: ops.copy_blocks([tgt, drf], mapping, check_values=False),
               lambda: torch_copy_blocks([tgt, drf], src, dst),
               floor_bytes=2 * pairs * block_bytes)
        del tgt, drf
    cache = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    for tokens in ((64,) if quick else (8, 64, 512)):
        kk = torch.randn(tokens, kv_heads, head_dim, device=device).to(torch.bfloat16)
        vv = torch.randn_like(kk)
        slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:tokens]
        bn.add("write_kv", tokens, 0, 0,
               lambda: ops.write_kv(cache, 1, kk, vv, slots, check_values=False),
               lambda: torch_write_kv(cache, 1, kk, vv, slots),
               floor_bytes=2 * 2 * kk.numel() * kk.element_size())


def bench_all(device: str, quick: bool, reps: int, oracle: bool, floor: MemoryFloor,
              threads: int | None = None) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(0)
    if quick:
        grid = [(1, 4, 32000), (8, 4, 32000), (8, 4, 128256)]
    else:
        grid = [(b, k, v) for v in (32000, 128256) for k in (4, 8) for b in (1, 8, 64)]
    bn = Bencher(device, quick, reps, floor, threads)
    print(header(threads), flush=True)
    for b, k, v in grid:
        bench_sampling(bn, b, k, v, g, oracle)
    bench_kv(bn, quick, g)
    return bn.rows


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
    ap.add_argument("--no-oracle", action="store_true", help="skip timing specrt/ops/reference.py")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--no-attention", action="store_true",
                    help="skip the attention section (paged attention vs gather + SDPA, bench/attention.py)")
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
    result = {"meta": meta, "rows": [asdict(r) for r in rows]}
    write_json(result, args.out)        # before the attention section: a timeout there keeps these
    if args.no_attention:
        return 0
    result["attention"] = attention = attention_section(device, thread_counts, args.quick)
    write_json(result, args.out)
    return 1 if "error" in attention else 0


def attention_section(device: str, thread_counts: list[int], quick: bool) -> dict:
    """bench/attention.py's kernel-vs-SDPA step and its goals; a failure is recorded, not raised
    (the op results above stand on their own)."""
    from bench import attention

    print(f"\nattention (bench/attention.py): SmolLM2 shapes, K=4, {'quick' if quick else 'full'}", flush=True)
    try:
        att = attention.section(device, thread_counts, quick)
    except Exception as e:  # noqa: BLE001 - reported in the output and the JSON
        att = {"error": f"{type(e).__name__}: {e}"}
        print(f"attention section FAILED: {att['error']}", flush=True)
        return att
    print("\n".join(att["goals"]))
    return att


def write_json(result: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
