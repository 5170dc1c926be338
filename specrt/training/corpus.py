"""The training corpus: the running interpreter's standard library sources.

Every machine with Python has this text, so the built-in pair can be rebuilt
anywhere without downloads. Test directories and third-party code are
excluded; the modules in ``HELD_OUT_MODULES`` are never trained on and are
used only for evaluation (held-out loss, acceptance, demo prompts).

    python -m specrt.training.corpus            # print split statistics
"""
from __future__ import annotations

import argparse
import os
import sysconfig
from dataclasses import dataclass

# Fixed, documented evaluation set: top-level stdlib modules (a package means
# every file below it). Chosen to be self-contained, mid-sized, and typical
# Python (classes, string handling, algorithms, docstrings).
HELD_OUT_MODULES: tuple[str, ...] = (
    "json", "csv", "textwrap", "difflib", "fractions",
    "heapq", "bisect", "shlex", "calendar", "pprint",
)

# Directory names that are never part of the corpus (tests, vendored, tools).
EXCLUDED_DIRS: frozenset[str] = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages",
    "__pycache__", "lib2to3", "idlelib", "turtledemo", "ensurepip", "venv",
    "config-3", "tkinter",
})

MAX_FILE_BYTES = 400_000  # skip a few huge generated tables (e.g. pydoc_data)


@dataclass(frozen=True)
class SourceFile:
    module: str  # top-level module name, e.g. "json" for json/decoder.py
    relpath: str  # path relative to the stdlib root
    path: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith("config-") or name.startswith(".")


def iter_source_files(root: str | None = None) -> list[SourceFile]:
    """All eligible stdlib ``.py`` files, sorted by relative path (deterministic)."""
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _excluded_dir(d))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            if fn.startswith("test_") and dirpath != root:
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root)
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            top = rel.split(os.sep)[0]
            module = top[:-3] if top.endswith(".py") else top
            out.append(SourceFile(module=module, relpath=rel, path=path))
    out.sort(key=lambda s: s.relpath)
    return out


def split_files(root: str | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out) file lists; held-out = modules in HELD_OUT_MODULES."""
    files = iter_source_files(root)
    held = set(HELD_OUT_MODULES)
    train = [f for f in files if f.module not in held]
    evalf = [f for f in files if f.module in held]
    return train, evalf


def read_text(f: SourceFile) -> str:
    with open(f.path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def load_texts(split: str = "train", root: str | None = None) -> list[str]:
    train, evalf = split_files(root)
    files = train if split == "train" else evalf
    return [read_text(f) for f in files]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.corpus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", choices=["train", "eval"], help="print the file list")
    args = ap.parse_args(argv)
    train, evalf = split_files()
    if args.list:
        for f in (train if args.list == "train" else evalf):
            print(f.relpath)
        return 0
    tb = sum(os.path.getsize(f.path) for f in train)
    eb = sum(os.path.getsize(f.path) for f in evalf)
    print(f"stdlib: {stdlib_root()}")
    print(f"train: {len(train)} files, {tb / 1e6:.1f} MB")
    print(f"held-out ({', '.join(HELD_OUT_MODULES)}): {len(evalf)} files, {eb / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
