"""`python -m specrt.cli`: the `specrt` command."""
import sys

from specrt.cli import main

sys.exit(main())
