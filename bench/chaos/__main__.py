"""`python -m bench.chaos`: see the package's docstring."""

import sys

from bench.chaos.cli import main

if __name__ == "__main__":
    sys.exit(main())
