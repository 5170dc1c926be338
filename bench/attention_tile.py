"""The CPU paged-attention kernel's AVX-512 tiles timed directly (issue 18): bench/attention_tile.cpp.

The op-level benchmarks (bench/attention.py, bench/attention_ab.py) time whole steps, where a
machine's memory noise swamps a 10% change in the tile. This compiles a small C++ program against
csrc/cpu/attention_avx512.cpp (the same source the extension builds, with the extension's
optimisation flags) and times one 32-key tile of one kv head at SmolLM2's shapes: "hot" (one tile
repeated, in L1), "stream" (every tile of a large paged cache in shuffled block order, the next
tile prefetched on the driver's schedule) and "nopf" (the same without prefetch), alternated round
by round in one process. stream / hot is how much memory time the tile leaves exposed. Usage:

  python bench/attention_tile.py                          # decode (3 lanes) and verify (15), levels 4 and 3
  python bench/attention_tile.py --lanes 15 --levels 4 --cache-mb 94 --rounds 9 --ghz 3.58

--ghz converts nanoseconds to cycles (a 15-lane tile does 2,048 score and 1,920 p * v 512-bit FMAs:
1,984 cycles at two per cycle). Needs a C++20 compiler and an AVX-512 CPU (F/BW/VL); exits with a
message otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = [os.path.join(ROOT, "bench", "attention_tile.cpp"), os.path.join(ROOT, "csrc", "cpu", "attention_avx512.cpp")]
HEADERS = [os.path.join(ROOT, "csrc", "cpu", "attention_tile.h"), os.path.join(ROOT, "csrc", "include", "specrt",
                                                                             "attention.h")]
# the extension's C++ flags (CMakeLists.txt), so the tiles compile as they do there
FLAGS = ["-O3", "-std=c++20", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wno-unused-function"]
LINE = re.compile(r"^(\w+)\s+ns_per_tile_head min ([\d.]+) median ([\d.]+)\s+kv_gbs ([\d.]+)")


def build(out_dir: str) -> str:
    """The harness binary under out_dir, rebuilt when a source or header is newer."""
    exe = os.path.join(out_dir, "attention_tile")
    newest = max(os.path.getmtime(p) for p in SOURCES + HEADERS)
    if os.path.exists(exe) and os.path.getmtime(exe) >= newest:
        return exe
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise SystemExit("no C++ compiler found (set CXX)")
    os.makedirs(out_dir, exist_ok=True)
    cmd = [cxx, *FLAGS, "-I", os.path.join(ROOT, "csrc"), "-I", os.path.join(ROOT, "csrc", "include"), *SOURCES,
           "-o", exe]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling the tile harness failed:\n{' '.join(cmd)}\n{done.stderr}")
    return exe


def run(exe: str, lanes: int, level: int, cache_mb: int, rounds: int) -> dict:
    """One harness run: {mode: {"min_ns", "median_ns", "kv_gbs"}} per tile and kv head."""
    done = subprocess.run([exe, str(lanes), str(level), str(cache_mb), str(rounds)], capture_output=True, text=True)
    if done.returncode == 2:
        raise SystemExit(done.stderr.strip())
    if done.returncode != 0:
        raise SystemExit(f"the tile harness failed ({done.returncode}): {done.stderr.strip()}")
    modes = {}
    for line in done.stdout.splitlines():
        m = LINE.match(line)
        if m:
            modes[m.group(1)] = {"min_ns": float(m.group(2)), "median_ns": float(m.group(3)),
                                 "kv_gbs": float(m.group(4))}
    if set(modes) != {"hot", "stream", "nopf"}:
        raise SystemExit(f"unexpected harness output:\n{done.stdout}")
    return modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", default="3,15", help="live lanes per group: 3 = decode, 15 = K=4 verify")
    ap.add_argument("--levels", default="4,3", help="ISA levels (3: keys transposed, 4: many-lane keys in place)")
    ap.add_argument("--cache-mb", type=int, default=94, help="the streamed cache (94 MB: 30 layers at 4k)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ghz", type=float, help="also print cycles at this clock")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "attention_tile"))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    exe = build(args.build_dir)
    rows = []
    print(f"paged-attention tiles, one 32-key tile x one kv head (SmolLM2: 3 kv heads, D=64, bf16, 16-token "
          f"blocks); stream: a {args.cache_mb} MB cache; {args.rounds} rounds, median (min) ns")
    print(f"{'lanes':>5} {'level':>5} {'hot':>16} {'stream':>16} {'nopf':>16} {'stream/hot':>10} {'stream KV':>10}"
          + (f" {'hot cycles':>10} {'stream cycles':>13}" if args.ghz else ""))
    for lanes in (int(x) for x in args.lanes.split(",")):
        for level in (int(x) for x in args.levels.split(",")):
            modes = run(exe, lanes, level, args.cache_mb, args.rounds)
            rows.append({"lanes": lanes, "level": level, "cache_mb": args.cache_mb, "rounds": args.rounds, **modes})
            cell = {k: f"{v['median_ns']:.0f} ({v['min_ns']:.0f})" for k, v in modes.items()}
            ratio = modes["stream"]["median_ns"] / modes["hot"]["median_ns"]
            extra = (f" {modes['hot']['median_ns'] * args.ghz:>10.0f} {modes['stream']['median_ns'] * args.ghz:>13.0f}"
                     if args.ghz else "")
            print(f"{lanes:>5} {level:>5} {cell['hot']:>16} {cell['stream']:>16} {cell['nopf']:>16} {ratio:>9.2f}x "
                  f"{modes['stream']['kv_gbs']:>6.1f} GB/s{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ghz": args.ghz}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
