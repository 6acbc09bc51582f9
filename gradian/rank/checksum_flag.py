"""`--skip-checksums`, the flag of `gradian rank` and `gradian attribute` that skips the shards' sha256 check.

It was `--no-verify`, which read as the opposite of `gradian attribute --verify` (retrain and
measure); the old spelling still works and says what it became.
"""

from __future__ import annotations

import argparse
import sys


def add_skip_checksums(parser: argparse.ArgumentParser, help: str) -> None:
    """Add `--skip-checksums` and its deprecated spelling `--no-verify` to `parser`."""
    parser.add_argument("--skip-checksums", action="store_true", help=help)
    parser.add_argument("--no-verify", action="store_true", dest="no_verify_deprecated",
                        help="deprecated spelling of --skip-checksums")


def skip_checksums(args: argparse.Namespace) -> bool:
    """Whether the run skips the sha256 check; one line on stderr for the deprecated spelling."""
    if getattr(args, "no_verify_deprecated", False):
        print("warning: --no-verify is now --skip-checksums (it skips the shards' sha256 check; it has nothing to do"
              " with gradian attribute --verify); the old spelling will go.", file=sys.stderr)
        return True
    return bool(getattr(args, "skip_checksums", False))
