"""`python -m circuitkit.cli ...`: the `circuitkit` command, whose code is `entry.cli`."""

import sys

from entry.cli import main

if __name__ == "__main__":
    sys.exit(main())
