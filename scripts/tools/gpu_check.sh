#!/usr/bin/env bash
# Device check on a CUDA machine (see scripts/tools/gpu_check.py): JSON report in ${1:-gpu_check.json}, under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec timeout 480 python scripts/tools/gpu_check.py --out "${1:-gpu_check.json}" "${@:2}"
