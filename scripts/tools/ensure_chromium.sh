#!/usr/bin/env bash
# Headless Chromium for the report's browser tests (tests/app/test_report_browser.py): Debian's
# package, installed with apt-get when no Chromium is on PATH (CI runs as root). Playwright drives
# this system browser; it downloads no browser of its own.
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "no Chromium on PATH: install Debian's 'chromium' package (apt-get install chromium) for the browser tests" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
