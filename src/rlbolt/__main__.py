"""`python -m rlbolt ...` is the `rlbolt` command."""

import sys

from rlbolt.app.cli import main

sys.exit(main())
