"""`python -m circuitkit.cli ...`: the `circuitkit` command, whose code is `circuitkit_app.cli`."""

import sys

from circuitkit_app.cli import main

if __name__ == "__main__":
    sys.exit(main())
