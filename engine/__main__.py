"""`python -m engine ...` is the `pdserve` command."""

import sys

from engine.cli import main

sys.exit(main())
