"""Paged multi-position attention: the kernel vs the gather + SDPA path (issue 18, section 2).

At SmolLM2-135M's attention shapes (9 query heads, 3 kv heads, head_dim 64, 30 layers, bf16
KV cache, float32 attention as the model runs it), K = 4 (5 query positions per request),
batch 1 and 8, contexts 4k and 8k, with 1 and 2 threads, it prints:

  attention   one verify step's attention (one call per layer, each layer its own cache, so
              every call reads cold memory as in a real forward): the kernel
              (``ops.paged_attention``) vs the gather + SDPA path
              (``llama.paged_attention_sdpa``), timed alternately in this process; the ratio
              is the median over repeats of sdpa / kernel. Goal: ratio >= 2.
  floor       the memory floor of that step: KV bytes it must read / read bandwidth, where the
              read bandwidth is bytes per second of an int32 max over 256 MB (a pure read
              stream, bench/machine.py's read_bandwidth), the best of 9 measured in the same run
              with the same thread count (so the floor is the lowest the machine showed); a copy's
              read rate (about half of it, the floor older results were measured against) is
              printed beside it. "kernel cpu" is the process CPU time of the kernel's step (all
              threads): unlike wall time it does not grow while other processes hold the cores.
  forward     a SmolLM2-shaped random-weight model's verify forward at 4k and at 8k; its
              growth t(8k) - t(4k) against the extra KV bytes it reads / read bandwidth
              (goal: close to 1x), for the kernel and for the SDPA backend.

Timings are medians of repeats; the spread (min..max of the per-repeat ratios) and the load
average say how noisy the machine was. Usage:

  python bench/attention.py                    # full: 30 layers, 5 repeats, 9 paired forwards (~6 min)
  python bench/attention.py --quick            # 6 layers, 3 repeats, no forward section
  python bench/attention.py --threads 1 --batches 1 --contexts 4096 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

# the checkout, after site-packages: an installed specrt wins (and its spawned workers agree)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import copy_read_rate, read_bandwidth  # noqa: E402
from specrt import ops  # noqa: E402
from specrt.models.attention import AttentionMetadata  # noqa: E402
from specrt.models.config import ModelConfig  # noqa: E402
from specrt.models.llama import LlamaForCausalLM, paged_attention_sdpa  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
QUERIES = 5  # K = 4 drafted tokens + 1
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
               max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               torch_dtype="bfloat16")


@dataclass
class AttentionRow:
    threads: int | None    # torch CPU threads (None on a GPU)
    batch: int
    context: int
    kernel_ms: float       # one step (all layers), median
    kernel_cpu_ms: float   # process CPU time of that step (all threads), median
    sdpa_ms: float
    ratio: float           # median over repeats of sdpa / kernel
    ratio_min: float
    ratio_max: float
    kv_mb: float           # KV bytes the step reads
    floor_ms: float        # kv bytes / read bandwidth
    kernel_vs_floor: float
    wide_ms: float | None = None  # the kernel with every lane group 16 wide (ISA level 2; CPU AVX-512 only)


@dataclass
class ForwardRow:
    threads: int
    batch: int
    backend: str
    ms_low: float          # verify forward at the lower context
    ms_high: float
    growth_ms: float       # median over repeats of t(high) - t(low)
    extra_kv_mb: float
    extra_floor_ms: float  # extra KV bytes / read bandwidth
    growth_vs_floor: float


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def paged_context(batch: int, context: int, layers: int, dtype, seed: int = 0, device: str = "cpu",
                  queries: int = QUERIES):
    """A [layers, 2, blocks, 16, 3, 64] cache with random contents, shuffled block tables, and the
    metadata of a verify step (queries = 1: a decode step): every request has `context` tokens, the
    last `queries` new."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = -(-context // BLOCK)
    blocks = batch * per
    cache = torch.empty(layers, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    for layer in range(layers):
        cache[layer].copy_(torch.randn(cache.shape[1:], generator=g, device=device))
    tables_g = g if device == "cpu" else torch.Generator().manual_seed(seed)
    tables = torch.randperm(blocks, generator=tables_g).view(batch, per).tolist()
    meta = AttentionMetadata.build([context] * batch, [queries] * batch, tables, BLOCK, device)
    return cache, meta


def time_step(fn, layers: int, device: str = "cpu") -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call per layer."""
    _sync(device)
    t, c = time.perf_counter(), time.process_time()
    for layer in range(layers):
        fn(layer)
    _sync(device)
    return time.perf_counter() - t, time.process_time() - c


def bench_attention(threads: int, batch: int, context: int, layers: int, reps: int, bandwidth: float,
                    dtype=torch.bfloat16, device: str = "cpu", queries: int = QUERIES) -> AttentionRow:
    cache, meta = paged_context(batch, context, layers, dtype, device=device, queries=queries)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch * queries, HEADS, HEAD_DIM, generator=g).to(device)
    kv = torch.zeros(batch * queries, KV_HEADS, HEAD_DIM, device=device)  # read by fresh prefills only: none here
    scale = HEAD_DIM ** -0.5

    def kernel(layer):
        return ops.paged_attention(q, cache[layer], meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, 0,
                                   queries, context)

    def sdpa(layer):
        return paged_attention_sdpa(q, kv, kv, cache[layer], meta, scale, None)

    level = ops.attention_cpu_isa(-1) if device == "cpu" else 0

    def wide(layer):  # the same kernel without its narrow tile (same bits): what the narrow tile saves
        ops.attention_cpu_isa(2)
        try:
            return kernel(layer)
        finally:
            ops.attention_cpu_isa(level)

    diff = (kernel(0) - sdpa(0)).abs().max().item()
    tol = 1e-5 if device == "cpu" else 1e-3   # CUDA SDPA backends round differently
    assert diff < tol, f"kernel and gather + SDPA disagree by {diff}"
    ks, kcpu, ss, ratios, ws = [], [], [], [], []
    fns = {"kernel": kernel, "sdpa": sdpa, **({"wide": wide} if level >= 3 else {})}
    for r in range(reps):  # alternate, in an order that flips every repeat
        pair = {}
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            pair[name] = time_step(fns[name], layers, device)
        if "wide" in pair:
            ws.append(pair["wide"][0])
        ks.append(pair["kernel"][0])
        kcpu.append(pair["kernel"][1])
        ss.append(pair["sdpa"][0])
        ratios.append(pair["sdpa"][0] / pair["kernel"][0])
    kv_bytes = layers * batch * context * 2 * KV_HEADS * HEAD_DIM * cache.element_size()
    k_ms = statistics.median(ks) * 1e3
    floor_ms = kv_bytes / bandwidth * 1e3
    return AttentionRow(threads, batch, context, k_ms, statistics.median(kcpu) * 1e3, statistics.median(ss) * 1e3,
                        statistics.median(ratios),
                        min(ratios), max(ratios), kv_bytes / 1e6, floor_ms, k_ms / floor_ms,
                        statistics.median(ws) * 1e3 if ws else None)


GOAL_RATIO = 2.0   # issue 18: the kernel at least twice as fast as the gather + SDPA path


def goal_line(row: AttentionRow) -> str:
    """One goal line in bench/kernels.py's style: the figure (sdpa / kernel) and the floor."""
    verdict = "met" if row.ratio >= GOAL_RATIO else "MISSED"
    goal = f"paged_attention B={row.batch} ctx={row.context} >= {GOAL_RATIO:g}x gather+SDPA"
    threads = "-" if row.threads is None else str(row.threads)
    return (f"{goal:56s} {threads:>7s} {row.ratio:7.1f}x {row.kernel_ms:9.3f} {row.floor_ms:9.3f} "
            f"{row.kernel_vs_floor:8.1f}  {verdict}")


def section(device: str, thread_counts: list[int], quick: bool) -> dict:
    """bench/kernels.py's "attention" section: one verify step's attention at SmolLM2's shapes,
    the kernel vs gather + SDPA, batch 1 and 8, per CPU thread count (one run on a GPU).
    quick: 6 layers, 3 repeats, a 4k context; else 30 layers, 5 repeats, 4k and 8k."""
    layers, reps, contexts = (6, 3, (4096,)) if quick else (LAYERS, 5, (4096, 8192))
    rows, bandwidths = [], {}
    before = torch.get_num_threads()
    try:
        for n in (thread_counts if device == "cpu" else [None]):
            if n is not None:
                torch.set_num_threads(n)
            bw = bandwidths[str(n)] = read_bandwidth(device=device)
            rows += [bench_attention(n, b, c, layers, reps, bw, device=device) for b in (1, 8) for c in contexts]
    finally:
        torch.set_num_threads(before)
    return {"shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "queries": QUERIES,
                       "layers": layers, "block_size": BLOCK, "kv_dtype": "bfloat16"},
            "reps": reps, "read_bandwidth": bandwidths, "rows": [asdict(r) for r in rows],
            "goals": [goal_line(r) for r in rows]}


def smollm2_shaped(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_json(SMOLLM2))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(torch.bfloat16).eval()


def bench_forward(model, threads: int, batch: int, contexts: tuple[int, int], reps: int,
                  bandwidth: float, queries: int = QUERIES) -> list[ForwardRow]:
    """Verify forward (batch x queries tokens) over `contexts[0]` and `contexts[1]` tokens of context."""
    steps = {}
    for context in contexts:
        cache, meta = paged_context(batch, context, LAYERS, torch.bfloat16, seed=context, queries=queries)
        ids = torch.randint(0, SMOLLM2["vocab_size"], (batch * queries,))
        pos = torch.arange(context - queries, context).repeat(batch)
        steps[context] = (ids, pos, meta, cache)
    rows = []
    times = {(b, c): [] for b in ("kernel", "sdpa") for c in contexts}
    for r in range(reps):
        order = [(b, c) for b in ("kernel", "sdpa") for c in contexts]
        for backend, context in (order if r % 2 == 0 else order[::-1]):
            model.set_attention_backend(backend)
            ids, pos, meta, cache = steps[context]
            meta.scratch.clear()
            t = time.perf_counter()
            model(ids, pos, meta, cache)
            times[backend, context].append(time.perf_counter() - t)
    model.set_attention_backend("kernel")
    lo, hi = contexts
    extra = LAYERS * batch * (hi - lo) * 2 * KV_HEADS * HEAD_DIM * 2
    for backend in ("kernel", "sdpa"):
        growth = statistics.median(h - low for h, low in zip(times[backend, hi], times[backend, lo])) * 1e3
        floor = extra / bandwidth * 1e3
        rows.append(ForwardRow(threads, batch, backend, statistics.median(times[backend, lo]) * 1e3,
                               statistics.median(times[backend, hi]) * 1e3, growth, extra / 1e6, floor,
                               growth / floor))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers per attention step (each its own cache)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--queries", type=int, default=QUERIES,
                    help="new tokens per request: 5 = a K=4 verify step (the default), 1 = a decode step")
    ap.add_argument("--quick", action="store_true", help="6 layers, 3 repeats, no forward section")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--forward-reps", type=int, default=9,
                    help="paired 4k / 8k forwards per backend (the growth is their median difference)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.reps, args.no_forward = 6, 3, True
    threads = [int(x) for x in args.threads.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    load0 = os.getloadavg()
    step = "decode" if args.queries == 1 else f"K={args.queries - 1} verify"
    print(f"paged attention, SmolLM2 shapes (H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}), bf16 cache, {step} "
          f"({args.queries} queries/request), {args.layers} layers/step, {args.reps} repeats; "
          f"CPU ISA level {ops.attention_cpu_isa(-1)}; load average {load0[0]:.1f}")
    att_rows, fwd_rows, bandwidths, copies = [], [], {}, {}
    model = None if args.no_forward else smollm2_shaped()
    for n in threads:
        torch.set_num_threads(n)
        bw = bandwidths[n] = read_bandwidth()
        copies[n] = copy_read_rate()
        print(f"\n-- {n} thread(s): read bandwidth {bw / 1e9:.1f} GB/s (the floor's; int32 max over 256 MB, best "
              f"of 9); a copy reads {copies[n] / 1e9:.1f} GB/s")
        print(f"{'batch':>5} {'context':>7} {'kernel ms':>10} {'(cpu ms)':>9} {'sdpa ms':>10} {'sdpa/kernel':>12} "
              f"{'(min..max)':>13} {'KV MB':>7} {'floor ms':>9} {'kernel/floor':>12} {'16-wide ms':>11}")
        for b in batches:
            for c in contexts:
                row = bench_attention(n, b, c, args.layers, args.reps, bw, queries=args.queries)
                att_rows.append(row)
                goal = "ok" if row.ratio >= GOAL_RATIO else f"MISSED (goal >= {GOAL_RATIO:g})"
                print(f"{b:>5} {c:>7} {row.kernel_ms:>10.2f} {row.kernel_cpu_ms:>9.1f} {row.sdpa_ms:>10.1f} "
                      f"{row.ratio:>11.1f}x "
                      f"{row.ratio_min:>5.1f}..{row.ratio_max:<6.1f} {row.kv_mb:>7.1f} {row.floor_ms:>9.2f} "
                      f"{row.kernel_vs_floor:>11.2f}x "
                      f"{'-' if row.wide_ms is None else f'{row.wide_ms:.2f}':>11}  {goal}")
        if model is not None and len(contexts) >= 2:
            lo, hi = contexts[0], contexts[-1]
            print(f"   forward (30 layers, {step} step) growth {lo} -> {hi} context vs the extra KV bytes:")
            for b in batches:
                for row in bench_forward(model, n, b, (lo, hi), args.forward_reps, bw, args.queries):
                    fwd_rows.append(row)
                    print(f"   batch {b} {row.backend:>6}: {row.ms_low:8.1f} -> {row.ms_high:8.1f} ms, growth "
                          f"{row.growth_ms:8.1f} ms for {row.extra_kv_mb:6.1f} MB more KV (floor "
                          f"{row.extra_floor_ms:6.1f} ms): {row.growth_vs_floor:5.2f}x the floor")
    load1 = os.getloadavg()
    print(f"\nload average {load0[0]:.1f} at start, {load1[0]:.1f} at the end "
          f"(the machine has {os.cpu_count()} cores; per-repeat ratio spreads above show the noise)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"queries": args.queries, "attention": [asdict(r) for r in att_rows], "forward": [asdict(r) for r in fwd_rows],
                       "read_bandwidth": bandwidths, "copy_bandwidth": copies, "load": [load0, load1]}, f, indent=1)


if __name__ == "__main__":
    main()
