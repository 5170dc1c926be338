"""The paged-attention benchmarks run: bench/attention.py end to end, bench/attention_ab.py's two
modes (two builds, two ISA levels) and bench/attention_tile.py's tile harness, each on tiny sizes."""
from __future__ import annotations

import pytest
import torch

from specrt import ops


def test_benchmark_script_runs(capsys, tmp_path):
    """bench/attention.py end to end on tiny sizes (it checks kernel == gather + SDPA before timing)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--threads", "1", "--batches", "2", "--contexts", "40,300", "--layers", "2", "--reps", "1",
                    "--no-forward", "--json", str(tmp_path / "out.json")])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "read bandwidth" in out and "sdpa/kernel" in out
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["read_bandwidth"]["1"] > 0 and result["copy_bandwidth"]["1"] > 0
    rows = result["attention"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 40), (2, 300)]
    assert all(r["kv_mb"] > 0 and r["floor_ms"] > 0 for r in rows)


def test_build_ab_script_runs(tmp_path):
    """bench/attention_ab.py alternates two builds in child processes, each importing its own copy:
    the current extension twice, on a tiny shape (and a missing build is refused by name)."""
    import subprocess
    import sys
    from pathlib import Path

    from specrt.ops.library import extension_path

    root = Path(__file__).resolve().parent.parent
    so = extension_path()
    cmd = [sys.executable, str(root / "bench" / "attention_ab.py"), so, so, "--shape", "64:5:1", "--layers", "1",
           "--reps", "1", "--rounds", "1", "--evict-mb", "0"]
    out = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("round 1") == 2 and "after / before" in out.stdout
    bad = subprocess.run(cmd[:2] + [str(tmp_path / "none.so"), so], check=False, cwd=root, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "none.so is not a file" in bad.stderr


def test_level_ab_mode_runs():
    """bench/attention_ab.py --levels alternates two ISA levels of the current build in one process
    (scalar and AVX2-or-lower here, so any x86 CPU runs it), and refuses a malformed pair by name."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    top = min(ops.attention_cpu_isa(-1), 1)
    if top == 0:
        pytest.skip("needs a second level (AVX2)")
    cmd = [sys.executable, str(root / "bench" / "attention_ab.py"), "--levels", f"0,{top}", "--shape", "64:5:1",
           "--layers", "1", "--rounds", "2", "--evict-mb", "0"]
    out = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "level 0: min" in out.stdout and f"paired median, level {top} / level 0" in out.stdout
    bad = subprocess.run(cmd[:2] + ["--levels", "3,3"], check=False, cwd=root, capture_output=True, text=True)
    assert bad.returncode != 0 and "--levels: two different levels" in bad.stderr


def _avx512() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return all(f in flags for f in (" avx512f", " avx512bw", " avx512vl"))


def test_tile_harness_runs(tmp_path):
    """bench/attention_tile.py compiles its C++ harness against csrc/cpu/attention_avx512.cpp and
    times the decode and verify tiles (hot, streamed, streamed without prefetch)."""
    import importlib.util
    import json
    import shutil
    from pathlib import Path

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    if not _avx512():
        pytest.skip("the tiles need AVX-512 F/BW/VL")
    path = Path(__file__).resolve().parent.parent / "bench" / "attention_tile.py"
    spec = importlib.util.spec_from_file_location("bench_attention_tile", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tile.json"
    assert bench.main(["--lanes", "3,15", "--levels", "4,3", "--cache-mb", "1", "--rounds", "1",
                       "--build-dir", str(tmp_path / "build"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lanes"], r["level"]) for r in rows] == [(3, 4), (3, 3), (15, 4), (15, 3)]
    for r in rows:
        for mode in ("hot", "stream", "nopf"):
            m = r[mode]
            assert 0 < m["min_ns"] <= m["median_ns"]
            # a tile and kv head reads 32 keys x 64 dims of bf16 K and V: 8 KB per median_ns
            assert abs(m["kv_gbs"] * m["median_ns"] - 8192) < 0.01 * 8192
    exe = str(next((tmp_path / "build").glob("attention_tile")))
    with pytest.raises(SystemExit, match="LANES must be 1..16"):
        bench.run(exe, 17, 4, 1, 1)
