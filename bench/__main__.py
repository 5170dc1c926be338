"""``python -m bench ...`` from the repository root: the end-to-end benchmark (bench.cli)."""
import sys

from bench.cli import main

sys.exit(main())
