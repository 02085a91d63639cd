"""`python -m deploy ...` is the `pdserve` command (handy under `ray job submit`)."""

import sys

from deploy.cli import main

sys.exit(main())
