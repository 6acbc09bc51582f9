"""Print an installed package's requirements (no extras), one per line, leaving out the named ones.

    python requirements_without.py PACKAGE [EXCLUDED ...]
"""

import importlib.metadata
import re
import sys

package, excluded = sys.argv[1], {name.lower() for name in sys.argv[2:]}
for requirement in importlib.metadata.requires(package) or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()
    if name not in excluded:
        print(requirement.split(";")[0].strip())
