"""Two builds of the extension, alternated: the paged-attention kernel's cold step time (issue 18).

On a shared machine the memory bandwidth drifts by 2x within minutes, so separate runs of
bench/attention.py cannot tell a 10% change from noise. This times the same step with two builds of
specrt._C (two .so files, e.g. the extension before and after a change), each in its own process,
taking turns `--rounds` times. Every run builds the same 30-layer SmolLM2-shaped bf16 cache
(bench/attention.py's `paged_context`), reads an `--evict-mb` buffer between steps so the KV comes
from DRAM as in a forward (read, as a forward reads its weights: a written buffer would leave dirty
lines whose write-back the timed step pays), and reports the median step time and the achieved KV
read bandwidth. The last line gives the median over rounds of each build and their ratio. Usage:

  python bench/attention_ab.py BEFORE.so AFTER.so --shape 4096:5:1 --threads 1 --rounds 4
  (shape = context:queries:batch; queries 5 = a K=4 verify step, 1 = a decode step)

Two paths of one build (the kernel's CPU instruction-set levels, `ops.attention_cpu_isa`) are
compared more tightly: `--levels 3,4` alternates them step by step in this process, so a drift of
the machine hits both alike, and prints each level's min / lower quartile / median and the median
of the per-pair ratios (`--rounds` pairs of steps):

  python bench/attention_ab.py --levels 3,4 --shape 4096:5:1 --rounds 30
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_step(context: int, queries: int, batch: int, layers: int, evict_mb: int):
    """A callable: one step over `layers` SmolLM2-shaped bf16 caches (after touching an `evict_mb`
    buffer, untimed), returning its seconds; with whatever specrt._C this process imports."""
    import torch

    if ROOT not in sys.path:  # run as a script: the repository's bench/ (an installed specrt still first)
        sys.path.append(ROOT)
    from bench.attention import HEAD_DIM, paged_context
    from specrt import ops
    cache, meta = paged_context(batch, context, layers, torch.bfloat16, queries=queries)
    q = torch.randn(queries * batch, 9, HEAD_DIM)
    junk = torch.ones(evict_mb << 18)  # float32: evict_mb MB

    def step() -> float:
        if junk.numel():
            float(junk.sum())  # read, not written: no dirty lines left for the step to write back
        t = time.perf_counter()
        for layer in range(layers):
            ops.paged_attention(q, cache[layer], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                HEAD_DIM ** -0.5, 0, queries, context)
        return time.perf_counter() - t

    return step


def run_one(context: int, queries: int, batch: int, layers: int, reps: int, evict_mb: int) -> tuple[float, float]:
    """(median step seconds, KV GB/s) in this process, with whatever specrt._C it imports."""
    from bench.attention import HEAD_DIM, KV_HEADS
    step = timed_step(context, queries, batch, layers, evict_mb)
    step()
    med = statistics.median(step() for _ in range(reps))
    kv_bytes = layers * batch * context * 2 * KV_HEADS * HEAD_DIM * 2
    return med, kv_bytes / med / 1e9


def compare_levels(levels: list[int], context: int, queries: int, batch: int, layers: int, pairs: int,
                   evict_mb: int) -> None:
    """Steps at two ISA levels of the extension in use, alternated (ABBA) in this process."""
    step = timed_step(context, queries, batch, layers, evict_mb)  # puts the repository on sys.path
    from specrt import ops
    default = ops.attention_cpu_isa(-1)
    times: dict[int, list[float]] = {lv: [] for lv in levels}
    try:
        for lv in levels:  # warm-up, and the level each request gets (capped to the CPU's)
            ops.attention_cpu_isa(lv)
            if ops.attention_cpu_isa(-1) != lv:
                raise SystemExit(f"--levels: this CPU runs level {ops.attention_cpu_isa(-1)} at most, not {lv}")
            step()
        for i in range(pairs):
            for lv in (levels if i % 2 == 0 else levels[::-1]):
                ops.attention_cpu_isa(lv)
                times[lv].append(step())
    finally:
        ops.attention_cpu_isa(default)
    for lv in levels:
        x = sorted(times[lv])
        print(f"  level {lv}: min {x[0] * 1e3:8.2f}  q1 {x[len(x) // 4] * 1e3:8.2f}  "
              f"median {x[len(x) // 2] * 1e3:8.2f} ms")
    a, b = levels
    ratio = statistics.median(y / x for x, y in zip(times[a], times[b]))
    print(f"paired median, level {b} / level {a} = {ratio:.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="*", help="two specrt._C shared objects (before, after)")
    ap.add_argument("--levels", help="instead of two builds: two ISA levels of this one, e.g. 3,4")
    ap.add_argument("--shape", default="4096:5:1", help="context:queries:batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=7, help="steps per run (median)")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each build, alternated")
    ap.add_argument("--evict-mb", type=int, default=1024, help="buffer read between steps (0: hot cache)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    context, queries, batch = (int(x) for x in args.shape.split(":"))
    if args.child:  # one run; the parent put the build under test first on sys.path
        import torch
        torch.set_num_threads(args.threads)
        from specrt.ops.library import extension_path
        if not extension_path().startswith(os.getcwd()):  # python -m puts the cwd first on sys.path
            raise SystemExit(f"imported {extension_path()}, not the build under test")
        med, gbs = run_one(context, queries, batch, args.layers, args.reps, args.evict_mb)
        print(f"{med * 1e3:.3f} {gbs:.3f}")
        return
    if args.levels is not None:
        if args.builds:
            raise SystemExit("--levels compares one build: give no builds")
        try:
            levels = [int(x) for x in args.levels.split(",")]
        except ValueError:
            levels = []
        if len(levels) != 2 or levels[0] == levels[1] or min(levels) < 0:
            raise SystemExit(f"--levels: two different levels >= 0 like 3,4, not {args.levels!r}")
        import torch
        torch.set_num_threads(args.threads)
        print(f"paged attention step, shape {args.shape} (context:queries:batch), {args.layers} layers, "
              f"{args.threads} thread(s), {args.evict_mb} MB evicted between steps; levels {args.levels} "
              f"alternated in one process, {args.rounds} pairs", flush=True)
        compare_levels(levels, context, queries, batch, args.layers, args.rounds, args.evict_mb)
        return
    if len(args.builds) != 2:
        raise SystemExit("builds: give two .so files (or --levels)")
    for so in args.builds:
        if not os.path.isfile(so):
            raise SystemExit(f"builds: {so} is not a file")
    results: dict[str, list[float]] = {so: [] for so in args.builds}
    with tempfile.TemporaryDirectory() as tmp:
        # each build as its own specrt package copy's _C, the child's cwd (first on sys.path), so the
        # child imports exactly that file
        pkgs = {}
        for i, so in enumerate(args.builds):
            pkg_root = os.path.join(tmp, str(i))
            shutil.copytree(os.path.join(ROOT, "specrt"), os.path.join(pkg_root, "specrt"),
                            ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
            shutil.copy(so, os.path.join(pkg_root, "specrt", "_C" + sysconfig.get_config_var("EXT_SUFFIX")))
            pkgs[so] = pkg_root
        print(f"paged attention step, shape {args.shape} (context:queries:batch), {args.layers} layers, "
              f"{args.threads} thread(s), {args.evict_mb} MB evicted between steps; builds alternated")
        for r in range(args.rounds):
            for so in (args.builds if r % 2 == 0 else args.builds[::-1]):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkgs[so], ROOT]))
                out = subprocess.run([sys.executable, "-m", "bench.attention_ab", *args.builds, "--child",
                                      "--shape", args.shape, "--threads", str(args.threads), "--layers",
                                      str(args.layers), "--reps", str(args.reps), "--evict-mb", str(args.evict_mb)],
                                     env=env, cwd=pkgs[so], capture_output=True, text=True, check=True)
                med, gbs = (float(x) for x in out.stdout.split()[-2:])
                results[so].append(med)
                print(f"  round {r + 1} {os.path.basename(so):>40}: {med:8.2f} ms  ({gbs:.2f} GB/s of KV)")
    a, b = (statistics.median(results[so]) for so in args.builds)
    print(f"median over rounds: {a:.2f} ms -> {b:.2f} ms, after / before = {b / a:.3f}")


if __name__ == "__main__":
    main()
