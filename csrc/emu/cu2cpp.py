"""Rewrite a CUDA source file into C++ for the SIMT emulator (csrc/emu/README.md).

Three source-level changes, each keeping every line where it was (compiler
messages point at the .cu file through a #line directive):

  kernel<<<grid, block, smem, stream>>>(args)
      -> ::emu::launch(kernel, "kernel", __FILE__, __LINE__, grid, block, smem, stream)(args)
  __shared__ T name[dims];
      -> static char emu_shared_key_N; auto& name = ::emu::block_shared<T[dims]>(&emu_shared_key_N);
  extern __shared__ T name[];
      -> T* const name = ::emu::dynamic_shared<T>();

and one check: device math whose bits the CPU cannot reproduce (expf, logf,
exp, pow, sinf, __expf, ...: CUDA's implementations differ from glibc's) is an
error naming the line, never a silent host fallback. The files the .cu
includes with quotes (csrc/cuda/*.cuh, csrc/include/specrt/*.h) are checked too.

Usage: python cu2cpp.py IN.cu OUT.cpp [-I DIR ...]
"""
from __future__ import annotations

import re
import sys
from pathlib import Path


class Unsupported(Exception):
    """Source the emulator cannot run faithfully; the message names file:line."""


# Device math with implementation-defined rounding on the GPU (libdevice, MUFU).
# Exact operations (fmaf, sqrtf, fabsf, floorf, fminf, ldexpf, isfinite, ...) are fine.
INEXACT = ("exp", "exp2", "exp10", "expm1", "log", "log2", "log10", "log1p", "pow", "powi", "sin", "cos", "tan",
           "sincos", "sinpi", "cospi", "sincospi", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh",
           "acosh", "atanh", "erf", "erfc", "erfinv", "erfcinv", "erfcx", "lgamma", "tgamma", "cbrt", "rcbrt",
           "hypot", "rhypot", "norm3d", "norm4d", "rnorm", "rsqrt", "normcdf", "normcdfinv", "j0", "j1", "y0", "y1")
_INEXACT_RE = re.compile(r"(?<![\w.>])(?:std::|::)?(__)?(" + "|".join(INEXACT) + r")(f|l)?\s*\(")
_FAST_INTRINSIC_RE = re.compile(r"(?<![\w.>])(__(?:fdividef|frcp_\w+|fsqrt_\w+|saturatef|sinf|cosf|tanf|expf|exp10f|"
                                r"logf|log2f|log10f|powf|sincosf|tanhf))\s*\(")


def _code_mask(src: str) -> list[bool]:
    """True for characters that are code (not inside comments, string or char literals)."""
    mask = [True] * len(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            mask[i:j] = [False] * (j - i)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            mask[i:j] = [False] * (j - i)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            mask[i + 1:j - 1] = [False] * max(0, j - 1 - (i + 1))   # keep the quotes as code
            i = j
        else:
            i += 1
    return mask


def _blank_non_code(src: str) -> str:
    """src with comments and literal contents replaced by spaces (newlines kept): positions unchanged."""
    mask = _code_mask(src)
    return "".join(ch if (m or ch == "\n") else " " for ch, m in zip(src, mask))


def _line_of(src: str, pos: int) -> int:
    return src.count("\n", 0, pos) + 1


def check_math(path: str, src: str) -> None:
    code = _blank_non_code(src)
    for rx in (_INEXACT_RE, _FAST_INTRINSIC_RE):
        m = rx.search(code)
        if m:
            name = m.group(0).rstrip("( \t\n")
            raise Unsupported(
                f"{path}:{_line_of(code, m.start())}: {name}() in CUDA code: the GPU's implementation does not "
                "return the CPU's bits, so the emulator cannot run it faithfully; use the deterministic functions "
                "of csrc/include/specrt (exp_det, log_det, exp2_det)")


def _kernel_start(code: str, end: int) -> int:
    """Start of the kernel expression ending at `end` (identifier, ::, template arguments)."""
    i = end
    while i > 0 and code[i - 1].isspace():
        i -= 1
    if i > 0 and code[i - 1] == ">":          # template arguments: back to the matching '<'
        depth = 0
        while i > 0:
            i -= 1
            if code[i] == ">":
                depth += 1
            elif code[i] == "<":
                depth -= 1
                if depth == 0:
                    break
        while i > 0 and code[i - 1].isspace():
            i -= 1
    while i > 0 and (code[i - 1].isalnum() or code[i - 1] in "_:"):
        i -= 1
    return i


def rewrite_launches(path: str, src: str) -> str:
    out = []
    code = _blank_non_code(src)
    pos = 0
    while True:
        start = code.find("<<<", pos)
        if start < 0:
            break
        depth, j = 0, start + 3
        while j < len(code):
            if code[j] in "([{":
                depth += 1
            elif code[j] in ")]}":
                depth -= 1
            elif depth == 0 and code.startswith(">>>", j):
                break
            j += 1
        else:
            raise Unsupported(f"{path}:{_line_of(code, start)}: unterminated <<<...>>> launch")
        k0 = _kernel_start(code, start)
        kernel = src[k0:start]
        if not kernel.strip():
            raise Unsupported(f"{path}:{_line_of(code, start)}: cannot find the kernel before <<<")
        config = src[start + 3:j]
        after = j + 3
        while after < len(code) and code[after].isspace():
            after += 1
        if after >= len(code) or code[after] != "(":
            raise Unsupported(f"{path}:{_line_of(code, start)}: expected (args) after >>>")
        label = " ".join(kernel.split()).replace("\\", "\\\\").replace('"', '\\"')
        out.append(src[pos:k0])
        out.append(f'::emu::launch({kernel}, "{label}", __FILE__, __LINE__, {config})')
        out.append(src[j + 3:after])
        pos = after
    out.append(src[pos:])
    return "".join(out)


_SHARED_RE = re.compile(
    r"(?P<extern>\bextern\s+)?(?P<static>\bstatic\s+)?__shared__\s+(?P<type>[^;=(){}]*?)\s*\b(?P<name>[A-Za-z_]\w*)"
    r"\s*(?P<dims>(?:\[[^\]]*\]\s*)*);")


def rewrite_shared(path: str, src: str) -> str:
    code = _blank_non_code(src)
    out, pos, n = [], 0, 0
    for m in _SHARED_RE.finditer(code):
        text = src[m.start():m.end()]
        if "\n" in text:
            raise Unsupported(f"{path}:{_line_of(code, m.start())}: a __shared__ declaration must fit on one line")
        typ, name, dims = m.group("type").strip(), m.group("name"), m.group("dims").replace(" ", "")
        if not typ:
            raise Unsupported(f"{path}:{_line_of(code, m.start())}: cannot parse this __shared__ declaration")
        out.append(src[pos:m.start()])
        if m.group("extern"):
            if dims != "[]":
                raise Unsupported(f"{path}:{_line_of(code, m.start())}: extern __shared__ must be an unsized array")
            out.append(f"{typ}* const {name} = ::emu::dynamic_shared<{typ}>();")
        else:
            out.append(f"static char emu_shared_key_{n}_; auto& {name} = ::emu::block_shared<{typ}{dims}>"
                       f"(&emu_shared_key_{n}_);")
            n += 1
        pos = m.end()
    out.append(src[pos:])
    result = "".join(out)
    left = _blank_non_code(result).find("__shared__")
    if left >= 0:
        raise Unsupported(f"{path}:{_line_of(result, left)}: unsupported __shared__ declaration")
    return result


def local_includes(path: Path, src: str, include_dirs: list[Path]) -> list[Path]:
    """Files reached through #include "..." (recursively), from the file's directory and include_dirs."""
    seen: list[Path] = []

    def visit(p: Path, text: str) -> None:
        for m in re.finditer(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            for d in [p.parent, *include_dirs]:
                cand = (d / m.group(1)).resolve()
                if cand.is_file():
                    if cand not in seen:
                        seen.append(cand)
                        visit(cand, cand.read_text())
                    break

    visit(path, src)
    return seen


def convert(path: str | Path, include_dirs: list[str | Path] = ()) -> str:
    path = Path(path).resolve()
    src = path.read_text()
    check_math(str(path), src)
    for inc in local_includes(path, src, [Path(d) for d in include_dirs]):
        if "csrc/emu" not in inc.as_posix():
            check_math(str(inc), inc.read_text())
    body = rewrite_shared(str(path), rewrite_launches(str(path), src))
    return f'#line 1 "{path.as_posix()}"\n{body}'


def main(argv: list[str]) -> int:
    args, incs = [], []
    it = iter(argv)
    for a in it:
        if a == "-I":
            incs.append(next(it))
        elif a.startswith("-I"):
            incs.append(a[2:])
        else:
            args.append(a)
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        text = convert(args[0], incs)
    except Unsupported as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    Path(args[1]).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
