"""`python -m airlock`: the command line (what `airlock` runs; a command that needs root runs itself again so)."""

import sys

from airlock.cli import main

sys.exit(main())
