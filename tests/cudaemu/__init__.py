"""Build and load the project's CUDA kernels for the CPU SIMT emulator (csrc/emu/README.md).

``load()`` compiles the UNCHANGED csrc/cuda/*.cu files with g++ (through csrc/emu/cu2cpp.py and
the headers of csrc/emu) into a torch extension whose launchers register the CUDA ops of
``specrt`` under another op namespace, ``specrt_emu``, for CPU tensors (the emulated device's
memory). The op bodies (argument checks, output allocation) are specrt._C's own, linked in.
``load().active()`` routes ``torch.ops.specrt.<op>`` to those ops, so ``specrt.ops`` wrappers and
the existing test cases run unchanged against the emulated CUDA kernels.

Builds are cached under build/cudaemu/<variant>-<hash of every input> in the checkout (or
$SPECRT_EMU_BUILD_DIR); $SPECRT_EMU_JOBS (else $MAX_JOBS, else 2) compiles in parallel.
``environment_problem()`` says in one line why emulation cannot run here (no g++, no ucontext,
no C++20 compiler), so tests can skip; any other build failure is an error.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CSRC = REPO / "csrc"
EMU = CSRC / "emu"
CUDA_SOURCES = sorted((CSRC / "cuda").glob("*.cu"))
EMU_RUNTIME = [EMU / name for name in ("cuda_emu.cpp", "emu_collectives.cpp", "emu_errors.cpp")]   # torch-free
NAMESPACE = "specrt_emu"
BROKEN_NAMESPACE = "specrt_emu_broken"
ORDERS = ("forward", "reverse", "shuffle")

sys.path.insert(0, str(EMU))
cu2cpp = importlib.import_module("cu2cpp")
sys.path.remove(str(EMU))


class BuildError(RuntimeError):
    """The emulated build failed for a reason in the sources (not the environment)."""


def _cxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build_root() -> Path:
    root = os.environ.get("SPECRT_EMU_BUILD_DIR")
    return Path(root) if root else REPO / "build" / "cudaemu"


def _jobs() -> int:
    for var in ("SPECRT_EMU_JOBS", "MAX_JOBS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    return 2


_PROBE = r"""
#include <ucontext.h>
#include <source_location>
static ucontext_t a, b;
static char stack[65536];
static int hits = 0;
static void f() { ++hits; swapcontext(&b, &a); }
int main() {
  getcontext(&b); b.uc_stack.ss_sp = stack; b.uc_stack.ss_size = sizeof stack; makecontext(&b, f, 0);
  swapcontext(&a, &b);
  return hits == 1 && std::source_location::current().line() > 0 ? 0 : 1;
}
"""

_env_problem: list[str | None] = []


def environment_problem() -> str | None:
    """None if the emulator can be built and run here, else one line saying why not."""
    if _env_problem:
        return _env_problem[0]
    problem = None
    cxx = _cxx()
    if not sys.platform.startswith("linux"):
        problem = f"CUDA emulation needs Linux (fibers on ucontext), this is {sys.platform}"
    elif cxx is None:
        problem = f"CUDA emulation needs a C++ compiler: {os.environ.get('CXX', 'g++')} not found"
    else:
        probe_dir = build_root() / "probe"
        try:
            probe_dir.mkdir(parents=True, exist_ok=True)
            (probe_dir / "probe.cpp").write_text(_PROBE)
            exe = probe_dir / f"probe-{os.getpid()}"
            r = subprocess.run([cxx, "-std=c++20", "-O1", str(probe_dir / "probe.cpp"), "-o", str(exe)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                first = (r.stderr.strip().splitlines() or ["?"])[0]
                problem = f"CUDA emulation needs g++ with C++20 <source_location> and <ucontext.h>: {first}"
            elif subprocess.run([str(exe)]).returncode != 0:
                problem = "CUDA emulation needs working ucontext fibers (makecontext/swapcontext failed)"
            exe.unlink(missing_ok=True)
        except OSError as exc:
            problem = f"CUDA emulation cannot build here: {exc}"
    _env_problem.append(problem)
    return problem


# --------------------------------------------------------------------------- #
# building
# --------------------------------------------------------------------------- #
def _torch_flags() -> tuple[list[str], list[str]]:
    from torch.utils import cpp_extension
    inc = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    lib = cpp_extension.library_paths()
    link = [f"-L{p}" for p in lib] + [f"-Wl,-rpath,{p}" for p in lib] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    return inc + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"], link


def _specrt_extension() -> str:
    from specrt.ops import library
    return str(Path(library.extension_path()).resolve())


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        out = (r.stdout + r.stderr).strip().splitlines()
        errors = [line for line in out if "error" in line] or out
        raise BuildError(f"emulated build: {what} failed:\n" + "\n".join(errors[:25]) + "\n$ " + " ".join(cmd))


def _digest(paths: list[Path], extra: list[str]) -> str:
    h = hashlib.sha256()
    for p in sorted(set(paths)):
        h.update(str(p).encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:16]


def _inputs() -> list[Path]:
    files = [*CUDA_SOURCES, *EMU.rglob("*.h"), *EMU.rglob("*.cpp"), *EMU.rglob("*.py"),
             *(CSRC / "cuda").glob("*.cuh"), *(CSRC / "include").rglob("*.h"), *CSRC.glob("*.h"),
             *HERE.glob("*.cu")]          # (compiler flags and variant texts are hashed too)
    return [f for f in files if f.is_file()]


def _build(variant: str, sources: list[tuple[str, Path | str]], torch_side: bool, sanitize: bool,
           namespace: str) -> Path:
    """Compile `sources` ((name, .cu path or C++ text)) + the emulator runtime into one shared library."""
    cxx = _cxx()
    assert cxx is not None
    inc, link = _torch_flags() if torch_side else ([], [])
    ext = _specrt_extension() if torch_side else ""
    common = ["-std=c++20", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wno-unknown-pragmas",
              "-Wno-unused-function", "-Wno-unused-variable", f"-I{EMU / 'stubs'}", f"-I{EMU}", f"-I{CSRC}",
              f"-I{CSRC / 'include'}", f"-I{CSRC / 'cuda'}"]
    common += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,alignment",
               "-fno-sanitize-recover=all"] if sanitize else ["-O1"]
    if torch_side:
        common += inc + ["-DSPECRT_WITH_CUDA", f"-DSPECRT_EMU_NAMESPACE={namespace}"]
    texts = [s if isinstance(s, str) else "" for _, s in sources]
    key = _digest(_inputs(), [cxx, torch.__version__, ext, variant, namespace, *common, *link, *texts,
                              subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout])
    out_dir = build_root() / f"{variant}-{key}"
    lib = out_dir / f"lib{variant.replace('-', '_')}.so"
    if lib.is_file():
        return lib
    build_root().mkdir(parents=True, exist_ok=True)
    with open(build_root() / f".{variant}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build per variant at a time (parallel test processes)
        if lib.is_file():
            return lib
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        jobs = []
        for name, src in sources:
            cpp = tmp / f"{name}.cpp"
            if isinstance(src, str):      # CUDA text made by the caller (kept: messages name it)
                src_path = build_root() / "sources" / f"{name}-{key}.cu"
                src_path.parent.mkdir(parents=True, exist_ok=True)
                for old in src_path.parent.glob(f"{name}-*.cu"):
                    old.unlink()
                src_path.write_text(src)
            else:
                src_path = src
            if src_path.suffix == ".cu":
                try:
                    cpp.write_text(cu2cpp.convert(src_path, [CSRC / "include", CSRC / "cuda", CSRC]))
                except cu2cpp.Unsupported as exc:
                    raise BuildError(f"emulated build: {exc}") from None
                prelude = ["-include", str(EMU / ("torch_prelude.h" if torch_side else "cuda_emu.h"))]
            else:
                shutil.copyfile(src_path, cpp)
                prelude = []
            jobs.append([cxx, *common, *prelude, "-c", str(cpp), "-o", str(tmp / f"{name}.o")])
        jobs += [[cxx, *common, "-c", str(src), "-o", str(tmp / f"{src.stem}.o")] for src in EMU_RUNTIME]
        if torch_side:
            jobs.append([cxx, *common, "-c", str(EMU / "emu_ops.cpp"), "-o", str(tmp / "emu_ops.o")])
        try:
            with ThreadPoolExecutor(_jobs()) as pool:
                for f in [pool.submit(_run, cmd, f"compiling {Path(cmd[-3]).name}") for cmd in jobs]:
                    f.result()
            objs = [str(p) for p in sorted(tmp.glob("*.o"))]
            _run([cxx, "-shared", *[f for f in common if f.startswith("-fsanitize")], "-o", str(tmp / lib.name),
                  *objs, *link, *([ext, "-Wl,-z,defs"] if torch_side else [])], "linking")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
        # superseded builds of this variant (other source hashes) go
        stale = re.compile(re.escape(variant) + r"-[0-9a-f]{16}(\.tmp\d+)?")
        for old in build_root().iterdir():
            if old != out_dir and stale.fullmatch(old.name):
                shutil.rmtree(old, ignore_errors=True)
    return lib


def build_kernels(sanitize: bool = False) -> Path:
    """The extension with every csrc/cuda/*.cu file (ops in namespace specrt_emu)."""
    return _build("kernels-asan" if sanitize else "kernels", [(p.stem, p) for p in CUDA_SOURCES], True, sanitize,
                  NAMESPACE)


def build_selftest(sanitize: bool = False) -> Path:
    """The torch-free library of tests/cudaemu/selftest.cu (driven through ctypes)."""
    return _build("selftest-asan" if sanitize else "selftest", [("selftest", HERE / "selftest.cu")], False,
                  sanitize, "")


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #
_loaded: dict[str, "Emulated"] = {}


class Emulated:
    """A loaded emulated-kernel extension: its op namespace and the ops it implements."""

    def __init__(self, path: Path, namespace: str, texts: list[str]):
        torch.ops.load_library(str(path))
        self.path, self.namespace = path, namespace
        self.op_names = sorted({m.group(1) for text in texts for m in re.finditer(r'\bm\.impl\(\s*"(\w+)"', text)})
        # schemas: the very ones of torch.ops.specrt (csrc/*_ops.cpp)
        self._lib = torch.library.Library(namespace, "FRAGMENT")
        for name in self.op_names:
            schema = str(getattr(torch.ops.specrt, name).default._schema)
            self._lib.define(schema.split("::", 1)[1])
        self.ops = getattr(torch.ops, namespace)

    def set_order(self, order: str, seed: int = 0) -> None:
        self.ops._emu_set_order(order, seed)

    def stats(self) -> dict[str, int]:
        keys = ("launches", "blocks", "threads", "switches", "barriers", "collectives")
        return dict(zip(keys, self.ops._emu_stats()))

    @contextlib.contextmanager
    def active(self):
        """Route torch.ops.specrt.<op> of every emulated op here, with the CUDA value-check policy
        (specrt.ops checks values of device tensors only in debug mode)."""
        from specrt.ops import checks
        real = torch.ops.specrt
        names, emu_ops = set(self.op_names), self.ops

        class _Routed:
            def __getattr__(self, name):
                return getattr(emu_ops if name in names else real, name)

        def device_policy(t, check_values):
            return bool(check_values) if check_values is not None else checks._debug_checks

        patched = []
        for mod_name in ("specrt.ops.sampling", "specrt.ops.kv", "specrt.ops.tree"):
            mod = sys.modules.get(mod_name) or importlib.import_module(mod_name)
            if hasattr(mod, "_check_values"):
                patched.append((mod, mod._check_values))
                mod._check_values = device_policy
        setattr(torch.ops, "specrt", _Routed())
        try:
            yield self
        finally:
            setattr(torch.ops, "specrt", real)
            for mod, fn in patched:
                mod._check_values = fn


def sanitized() -> bool:
    """$SPECRT_EMU_SANITIZE=1: load() takes the AddressSanitizer (+ alignment) build; the process must run
    with asan_env()'s LD_PRELOAD (tests/test_cuda_emulated.py::test_kernels_under_address_sanitizer does)."""
    return os.environ.get("SPECRT_EMU_SANITIZE", "0") not in ("", "0")


def load() -> Emulated:
    """Build (cached) and load the emulated kernels; raises BuildError if the sources do not build."""
    if "kernels" not in _loaded:
        path = build_kernels(sanitize=sanitized())
        _loaded["kernels"] = Emulated(path, NAMESPACE, [p.read_text() for p in CUDA_SOURCES])
    return _loaded["kernels"]


def load_variant(name: str, source_name: str, text: str) -> Emulated:
    """A variant of one .cu file (its patched text), in namespace specrt_emu_<name>."""
    if name not in _loaded:
        namespace = f"{NAMESPACE}_{name}"
        path = _build(f"variant-{name}", [(source_name, text)], True, False, namespace)
        _loaded[name] = Emulated(path, namespace, [text])
    return _loaded[name]


class Selftest:
    """ctypes front of tests/cudaemu/selftest.cu."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_selftest.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                                          ctypes.POINTER(ctypes.c_longlong), ctypes.c_char_p, ctypes.c_size_t]

    def run(self, name: str, order: str = "forward", seed: int = 0) -> tuple[bool, int | str]:
        """(True, checksum) or (False, error message)."""
        res, msg = ctypes.c_longlong(0), ctypes.create_string_buffer(8192)
        rc = self.lib.emu_selftest(name.encode(), order.encode(), seed, ctypes.byref(res), msg, len(msg))
        return (True, res.value) if rc == 0 else (False, msg.value.decode())


def asan_env() -> dict[str, str] | None:
    """Variables for a child process that loads an AddressSanitizer build (libasan and libstdc++
    preloaded: python is not instrumented), or None if this compiler has no libasan."""
    cxx = _cxx()
    if cxx is None:
        return None
    libs = []
    for name in ("libasan.so", "libstdc++.so.6"):
        p = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not p or not os.path.isabs(p) or not os.path.exists(p):
            return None
        libs.append(os.path.realpath(p))
    return {"LD_PRELOAD": " ".join(libs),
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1:allocator_may_return_null=1"}
