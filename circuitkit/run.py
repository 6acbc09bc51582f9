"""`python -m circuitkit.run [overrides]`: the name users type for `circuitkit_app.run` (the Hydra entry)."""

import sys

from circuitkit_app.run import main

if __name__ == "__main__":
    sys.exit(main())
