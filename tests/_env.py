"""Where the specrt under test lives, and how child processes find the same one.

CI runs ``pytest`` against an installed wheel while the working directory is the source tree,
whose ``specrt/`` has no compiled ``_C``. A child started with ``-c``/``-m`` puts its working
directory first on ``sys.path``, so children run outside the tree (``CHILD_CWD``) with the
directory holding the imported specrt first on ``PYTHONPATH`` (``child_env``).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import specrt

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent                                          # the checkout: bench/, README.md
SPECRT_DIR = Path(specrt.__file__).resolve().parent          # the package under test
SPECRT_ROOT = SPECRT_DIR.parent                              # site-packages, or REPO when built in place
CHILD_CWD = tempfile.gettempdir()


def child_env(*extra_paths: str | os.PathLike, **env: str) -> dict[str, str]:
    """os.environ plus ``env``, with PYTHONPATH = the specrt under test, ``extra_paths``, tests/."""
    paths = [str(SPECRT_ROOT), *map(str, extra_paths), str(TESTS)]
    old = os.environ.get("PYTHONPATH")
    if old:
        paths.append(old)
    return {**os.environ, **env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
