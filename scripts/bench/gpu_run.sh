#!/usr/bin/env bash
# The GPU benchmark (scripts/bench/bench_gpu.py) on a lent device machine, offline, in one command.
# Run from the repository root there; see scripts/README.md ("bench_gpu on a lent GPU") for the call.
# Results land in $OUT: bench_gpu.md, bench_gpu.json, bench_gpu.log, nvidia-smi.txt (and llama1b_* with
# GPU_RUN_LLAMA1B=1, only while enough of the budget is left).
# Wheels the machine's image lacks (hydra-core, omegaconf, antlr4-python3-runtime; not transformers: the
# image's runs the project, .venv's needs a newer huggingface_hub) travel in .whl/ (named in the run tool's
# `carry`); bergson and its missing needs in .whl/bergson/ (scripts/README.md lists them).
set -uo pipefail
OUT=${OUT:-/tmp/bench_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_run.sh: installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The peer, optional: bergson and what the image lacks of its needs (scripts/README.md), in .whl/bergson/.
# If they do not install, bergson's row says "not installed" and the rest runs.
if compgen -G ".whl/bergson/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-bergson \
    .whl/bergson/*.whl && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site-bergson \
    || echo "gpu_run.sh: installing .whl/bergson/*.whl failed; bergson's row will say so" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the project itself, not installed there
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CIRCUITKIT_CACHE=/tmp/circuitkit-cache
nvidia-smi --query-gpu=name,memory.total,driver_version,utilization.gpu --format=csv | tee "$OUT/nvidia-smi.txt"
"$PY" -c "import torch, transformers, hydra, omegaconf; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'hydra', hydra.__version__, 'cuda', torch.cuda.is_available())" || exit 1
# At most 8 minutes for the benchmark itself (the issue's budget), SmolLM2's shape first.
timeout "${BENCH_TIMEOUT:-420}" "$PY" scripts/bench/bench_gpu.py --out "$OUT/bench_gpu.md" --json "$OUT/bench_gpu.json" \
  "$@" 2>&1 | grep -v '^USDT:' | tee "$OUT/bench_gpu.log"
status=${PIPESTATUS[0]}
left=$((480 - $(date +%s) + START))
if [ "${GPU_RUN_LLAMA1B:-0}" = 1 ] && [ "$left" -gt 150 ]; then
  timeout "$((left - 20))" "$PY" scripts/bench/bench_gpu.py --model llama1b --no-bergson --rows 1000 \
    --out "$OUT/llama1b_bench_gpu.md" --json "$OUT/llama1b_bench_gpu.json" 2>&1 | grep -v '^USDT:' \
    | tee "$OUT/llama1b_bench_gpu.log"
fi
exit "$status"
