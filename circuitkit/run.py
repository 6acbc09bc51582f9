"""`python -m circuitkit.run [overrides]`: the name users type for `entry.run` (the Hydra entry)."""

import sys

from entry.run import main

if __name__ == "__main__":
    sys.exit(main())
