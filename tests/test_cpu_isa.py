"""One CPU feature detector and one knob (issue 37): csrc/cpu/cpu_isa.{h,cpp} reads the CPU's
features once, and SPECRT_CPU_ISA (or its debug op set_cpu_isa) is the ceiling of every CPU
kernel: sampling, fused, attention levels and linear ISAs. The per-kernel testing hooks
(attention_cpu_isa, set_linear_isa) still pick a lower path; the default choices are the
CPU's best (attention level 4 on AMD, 3 on other AVX-512 CPUs)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specrt import ops
from _env import CHILD_CWD, child_env  # noqa: E402  (tests/ on sys.path)

ROOT = Path(__file__).resolve().parent.parent
FEATURES = set(torch.ops.specrt.cpu_features())
AVX2 = {"avx2", "fma", "f16c"} <= FEATURES
AVX512 = AVX2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= FEATURES

PROBE = ("import json, torch\nfrom specrt import ops\n"
         "print(json.dumps([torch.ops.specrt.cpu_isa(), ops.attention_cpu_isa(-1), ops.linear_isa_names(), "
         "ops.linear_dynamic_isa()]))\n")


def _probe(**env: str) -> list:
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env=child_env(**env), cwd=CHILD_CWD)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_default_is_the_best_the_cpu_runs():
    isa, level, names, dynamic = _probe()
    if AVX512:
        assert isa == "avx512" and level == (4 if "amd" in FEATURES else 3)
        best = "avx512bf16" if "avx512bf16" in FEATURES else "avx512"
        assert names[0] == ("amx" if best == "avx512bf16" and "amx_bf16" in FEATURES else best)
        assert dynamic == ("avx512vnni" if "avx512vnni" in FEATURES else "avx2")
    elif AVX2:
        assert (isa, level, names[0], dynamic) == ("avx2", 1, "avx2", "avx2")
    else:
        assert (isa, level, names, dynamic) == ("scalar", 0, ["scalar"], "scalar")


@pytest.mark.parametrize("env,want", [("avx2", ["avx2", 1, ["avx2", "scalar"], "avx2"]),
                                      ("scalar", ["scalar", 0, ["scalar"], "scalar"])])
def test_one_knob_caps_every_kernel(env, want):
    if env == "avx2" and not AVX2:
        pytest.skip("CPU lacks AVX2")
    assert _probe(SPECRT_CPU_ISA=env) == want


def test_set_cpu_isa_caps_attention_and_linear_too():
    if not AVX2:
        pytest.skip("CPU lacks AVX2")
    try:
        torch.ops.specrt.set_cpu_isa("avx2")
        assert ops.attention_cpu_isa(-1) == 1 and ops.linear_isa_names()[0] == "avx2"
        assert ops.linear_dynamic_isa() == "avx2"
        with pytest.raises(ValueError, match="not supported"):
            ops.set_linear_isa("avx512")
    finally:
        torch.ops.specrt.set_cpu_isa("auto")
    assert torch.ops.specrt.cpu_isa() == ("avx512" if AVX512 else "avx2")


def test_only_cpu_isa_detects():
    """No other source asks the CPU for its features (a second detector would fail here)."""
    found = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".h", ".cpp", ".cu", ".cuh") and path.name not in ("cpu_isa.cpp",):
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}: {m}"
                      for m in re.findall(r"__builtin_cpu_\w+|__cpuid\w*|getenv\(\"SPECRT_\w*ISA\w*", text)]
    for path in sorted((ROOT / "specrt").rglob("*.py")):
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m}"
                  for m in re.findall(r"cpuinfo|(?:getenv|environ\.get|environ\[)\(?\s*[\"']SPECRT_\w*ISA", text)]
    assert not found, found


def test_one_way_to_target_an_isa():
    """Wider-ISA code is compiled only inside SPECRT_TARGET_BEGIN(SPECRT_ISA_*) ... SPECRT_TARGET_END regions
    (csrc/cpu/simd_target.h): no -m flags in the build, no target attributes or pragmas elsewhere, and
    every source that uses AVX2/AVX-512/AMX intrinsics opens a balanced region of a named ISA set."""
    found = []
    for build in ("CMakeLists.txt", "setup.py"):
        found += [f"{build}: {m}" for m in re.findall(r"-m(?:avx\w*|fma|f16c|arch=\w+)", (ROOT / build).read_text())]
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".h", ".cpp") or path.name == "simd_target.h":
            continue
        text, rel = path.read_text(), path.relative_to(ROOT)
        found += [f"{rel}: {m}" for m in re.findall(r"target\(\"|GCC target|clang attribute push", text)]
        begins = re.findall(r"^SPECRT_TARGET_BEGIN\((\w+)\)", text, re.M)
        ends = re.findall(r"^SPECRT_TARGET_END\b", text, re.M)
        if len(begins) != len(ends):
            found.append(f"{rel}: {len(begins)} regions opened, {len(ends)} closed")
        found += [f"{rel}: unknown ISA set {b}" for b in begins
                  if b not in ("SPECRT_ISA_AVX2", "SPECRT_ISA_AVX512", "SPECRT_ISA_AVX512_BF16", "SPECRT_ISA_AVX512_VNNI",
                               "SPECRT_ISA_AMX_BF16")]
        if path.suffix == ".cpp" and re.search(r"\b(_mm(256|512)|_tile)_\w+\(", text) and not begins:
            found.append(f"{rel}: AVX2/AVX-512/AMX intrinsics outside a target region")
    assert not found, found
