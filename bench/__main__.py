"""``python -m bench ...`` (installed with specrt, or from the repository root): the end-to-end
benchmark (bench.cli), the same as ``specrt bench ...``."""
import sys

from bench.cli import main

sys.exit(main())
