"""Build specrt: setuptools drives CMake + Ninja to build the pybind11 module specrt._C.

Environment:
  SPECRT_CUDA=0|1        force the CPU-only build (0) or the CUDA build (1, fails loudly if impossible).
                         Unset: CUDA when torch is a CUDA build and an nvcc of the same CUDA major is found.
  TORCH_CUDA_ARCH_LIST   e.g. "9.0+PTX" (default), "8.0;9.0", "9.0a". Never probes for a GPU.
  CUDA_HOME / CUDACXX    where to find nvcc (default: /usr/local/cuda, then PATH).
  MAX_JOBS               parallel compile jobs.
Install with `pip install --no-build-isolation .` so the extension is built against the torch you run.

Progress: every compiled file is one line, "specrt [done/total, elapsed] Building CXX object ...";
`pip install -v` shows them (pip hides a build's output otherwise). The CMake build folder is
build/temp.*/{cpu,cuda} in the source tree, kept between builds: a second `pip install` of the same
tree with the same torch recompiles only what changed (seconds instead of minutes).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"),
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _nvcc_version(nvcc: str) -> str | None:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _cuda_architectures(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST ("9.0+PTX", "8.0;9.0", "9.0a") -> CMAKE_CUDA_ARCHITECTURES."""
    archs: list[str] = []
    for item in re.split(r"[;\s,]+", arch_list.strip()):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        item = item.removesuffix("+PTX")
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)", item)
        if not m:
            raise RuntimeError(f"TORCH_CUDA_ARCH_LIST: cannot parse {item!r} (expected e.g. 9.0, 9.0a, 9.0+PTX)")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        archs.append(f"{num}-real")
        if ptx:
            archs.append(f"{num}-virtual")
    if not archs:
        raise RuntimeError("TORCH_CUDA_ARCH_LIST is empty")
    return ";".join(archs)


def _decide_cuda(torch) -> tuple[bool, str | None, str]:
    """(build CUDA?, nvcc path, reason)."""
    forced = os.environ.get("SPECRT_CUDA")
    if forced not in (None, "", "0", "1"):
        raise RuntimeError(f"SPECRT_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False, None, "SPECRT_CUDA=0"
    nvcc = _find_nvcc()
    torch_cuda = torch.version.cuda
    problem = None
    if torch_cuda is None:
        problem = f"torch {torch.__version__} is a CPU-only build"
    elif nvcc is None:
        problem = "no nvcc found (set CUDA_HOME or CUDACXX)"
    else:
        nv = _nvcc_version(nvcc)
        if nv is None or nv.split(".")[0] != torch_cuda.split(".")[0]:
            problem = f"nvcc {nv} at {nvcc} does not match torch's CUDA {torch_cuda} (same major version needed)"
    if problem:
        if forced == "1":
            raise RuntimeError(f"SPECRT_CUDA=1 but the CUDA kernels cannot be built: {problem}")
        return False, None, problem
    return True, nvcc, f"torch CUDA {torch_cuda}, nvcc at {nvcc}"


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch
        import torch.utils.cpp_extension as cpp

        use_cuda, nvcc, reason = _decide_cuda(torch)
        print(f"specrt: building {'CPU + CUDA' if use_cuda else 'CPU-only'} kernels ({reason})", flush=True)
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_temp = Path(self.build_temp).resolve() / ("cuda" if use_cuda else "cpu")
        build_temp.mkdir(parents=True, exist_ok=True)

        cmake = shutil.which("cmake")
        try:
            import cmake as cmake_pkg  # pip's cmake (4.x): the system one may be too old for CUDA C++20
            cmake = os.path.join(cmake_pkg.CMAKE_BIN_DIR, "cmake")
        except ImportError:
            pass
        if cmake is None:
            raise RuntimeError("cmake >= 3.26 is required: pip install cmake")
        generator = []
        ninja = shutil.which("ninja")
        try:
            import ninja as ninja_pkg
            ninja = os.path.join(ninja_pkg.BIN_DIR, "ninja")
        except ImportError:
            pass
        if ninja:
            generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]

        cfg = [
            cmake, str(ROOT), *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DTORCH_INCLUDE_DIRS={';'.join(cpp.include_paths())}",
            f"-DTORCH_LIBRARY_DIRS={';'.join(cpp.library_paths())}",
            f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={ext_path.parent}",
            f"-DSPECRT_CUDA={'ON' if use_cuda else 'OFF'}",
        ]
        if use_cuda:
            cfg += [f"-DCMAKE_CUDA_COMPILER={nvcc}",
                    f"-DCMAKE_CUDA_ARCHITECTURES={_cuda_architectures(os.environ.get('TORCH_CUDA_ARCH_LIST', '9.0+PTX'))}"]
            extra = []
            try:  # cuBLAS/cuSPARSE headers of pip's CUDA packages, needed by some torch headers
                import nvidia
                for base in nvidia.__path__:
                    for sub in ("cu13/include", "cu12/include"):
                        if os.path.isdir(os.path.join(base, sub)):
                            extra.append(os.path.join(base, sub))
            except ImportError:
                pass
            cfg.append(f"-DSPECRT_EXTRA_CUDA_INCLUDE_DIRS={';'.join(extra)}")
        fresh = not any((build_temp / f).exists() for f in ("build.ninja", "Makefile"))
        if "pip-req-build-" in str(ROOT):
            print("specrt: pip is building a temporary copy of the source (pip < 21.3), so this compile is not kept "
                  "for the next install: `pip install -U pip` builds in the checkout and reuses build/", flush=True)
        t0 = time.monotonic()
        subprocess.check_call(cfg, cwd=build_temp)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        print(f"specrt: {'compiling' if fresh else 'updating'} specrt._C in {build_temp} with {jobs} parallel jobs: "
              + ("the first build takes minutes (about 8 on 2 cores), one line per file"
                 if fresh else "only files changed since the last build recompile"), flush=True)
        env = dict(os.environ)
        env.setdefault("NINJA_STATUS", "specrt [%f/%t, %es] ")    # ninja's progress prefix: done/total, elapsed
        subprocess.check_call([cmake, "--build", ".", "--parallel", jobs], cwd=build_temp, env=env)
        print(f"specrt: specrt._C built in {time.monotonic() - t0:.0f} s", flush=True)
        built = list(ext_path.parent.glob("_C*.so"))
        if not any(p.name == ext_path.name for p in built):
            raise RuntimeError(f"CMake did not produce {ext_path.name} in {ext_path.parent} (found {built})")


setup(
    ext_modules=[Extension("specrt._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
