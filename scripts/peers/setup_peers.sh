#!/usr/bin/env bash
# `make peers`: the peer tools in git-ignored virtual environments, never project dependencies.
#
#   .venv-peers        bergson, traker, dattri next to the CPU build of torch 2.13.0
#   .venv-autocircuit  auto-circuit with transformer-lens<3 and transformers 4.x (torch 2.13.0)
#   .venv-kronfluence  kronfluence 1.0.1 (EK-FAC influence) with transformers 5.x (torch 2.13.0)
#   .venv-tlens4       transformer-lens 4.3.0 (TransformerBridge attribution patching; transformers>=5.9)
#   .venv-lexsi        Lexsi Labs' CircuitKIT 0.2.0 (PyPI `circuitkit`, transformer-lens 3.8.0; torch 2.13.0).
#                      It imports as `circuitkit`, like this project: its own venv, never the project's.
#
# PEERS="kronfluence tlens4" builds only the venvs named (peers, autocircuit, kronfluence, tlens4, lexsi);
# default: all of them.
#
# Workarounds (docs/benchmarks.md, "Peers"):
# * bergson requires torchvision and torchaudio; from PyPI they pull torch 2.14.1 (a CUDA build,
#   ~6 GB) in place of 2.13.0, and PyPI's torchvision does not import next to the 2.13.0 CPU wheel.
#   bergson never imports them on the paths benchmarked, so it is installed with --no-deps and its
#   other requirements are installed separately, with torch held at 2.13.0 by a constraint.
# * transformer-lens 2.x holds numpy below 2, while the newest pyarrow (pulled by datasets)
#   needs numpy 2: pyarrow is held below 23.
# * kronfluence 1.0.1 requires torchvision, which it imports only for its vision examples: it is
#   installed with --no-deps, like bergson, and its other requirements separately.
# * Lexsi's circuitkit 0.2.0 needs nothing worked around: one `pip install` with torch held at the
#   2.13.0 CPU wheel by the constraint (~2 min from the local mirror, a 2.2 GB venv: it pulls
#   transformer-lens 3.8.0, transformers 5.x, spacy, sentence-transformers, evaluate, bert-score,
#   torch-pruning; `pip check` is clean). It must stay out of the project venv: both import as
#   `circuitkit`. What running it on a local model takes is in scripts/peers/worker_lexsi.py.
# Each venv is rebuilt only when this script changes (a stamp file records the script's hash).
set -euo pipefail
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP=$(sha256sum "$0" | cut -c1-16)
TORCH=torch==2.13.0

PEERS=${PEERS:-peers autocircuit kronfluence tlens4 lexsi}

fresh() {  # fresh VENV: true when VENV needs (re)building; then it is removed and recreated
  [[ " $PEERS " == *" ${1#.venv-} "* ]] || return 1
  if [[ -f "$1/.peers-$STAMP" ]]; then echo "$1 is up to date"; return 1; fi
  rm -rf "$1"
  "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install --quiet --upgrade pip
  "$1/bin/python" -m pip install --quiet "$TORCH"
}

CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "$TORCH" > "$CONSTRAINT"

if fresh .venv-peers; then
  pip=(.venv-peers/bin/python -m pip install --quiet -c "$CONSTRAINT")
  "${pip[@]}" --no-deps bergson
  mapfile -t bergson_deps < <(.venv-peers/bin/python "$HERE/requirements_without.py" bergson torchvision torchaudio)
  # hydra-core, rich: the workers' shared tokenization (scripts/peers/lmdata.py) imports gradian.data.rows,
  # which imports circuitkit.core.config (without them the traker worker fails: "No module named 'hydra'").
  "${pip[@]}" "${bergson_deps[@]}" traker dattri hydra-core rich
  touch ".venv-peers/.peers-$STAMP"
fi

if fresh .venv-autocircuit; then
  .venv-autocircuit/bin/python -m pip install --quiet -c "$CONSTRAINT" \
    auto-circuit "transformer-lens<3" "transformers>=4.40,<5" "pyarrow>=21,<23"
  touch ".venv-autocircuit/.peers-$STAMP"
fi

if fresh .venv-kronfluence; then
  pip=(.venv-kronfluence/bin/python -m pip install --quiet -c "$CONSTRAINT")
  "${pip[@]}" --no-deps kronfluence==1.0.1
  mapfile -t kronfluence_deps < <(.venv-kronfluence/bin/python "$HERE/requirements_without.py" kronfluence torchvision)
  # hydra-core: gradian.data.rows (the workers' shared tokenization, scripts/peers/lmdata.py) imports circuitkit.core.config.
  "${pip[@]}" "${kronfluence_deps[@]}" "transformers>=5,<6" hydra-core rich
  touch ".venv-kronfluence/.peers-$STAMP"
fi

if fresh .venv-tlens4; then
  .venv-tlens4/bin/python -m pip install --quiet -c "$CONSTRAINT" transformer-lens==4.3.0
  touch ".venv-tlens4/.peers-$STAMP"
fi

if fresh .venv-lexsi; then
  .venv-lexsi/bin/python -m pip install --quiet -c "$CONSTRAINT" circuitkit==0.2.0
  touch ".venv-lexsi/.peers-$STAMP"
fi

for venv in .venv-peers .venv-autocircuit .venv-kronfluence .venv-tlens4 .venv-lexsi; do
  [[ -x "$venv/bin/python" ]] || continue
  echo "$venv:"
  "$venv/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(torch|transformers|transformer-lens|auto-circuit|bergson|traker|dattri|kronfluence|circuitkit|numpy)==' | sed 's/^/  /'
done
