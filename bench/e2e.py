"""End-to-end benchmark: a thin wrapper around `specrt bench` (specrt/benchmarks.py).

    python bench/e2e.py --quick [--out DIR]
    python bench/e2e.py --target builtin --draft builtin --device cuda
    python bench/e2e.py cost-curve --target-shape 8b --draft-shape 1b     # random weights, GPU
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specrt.benchmarks import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
