# orgchart developer targets. `make help` lists them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-12s %s\n", $$1, $$2}'

$(BIN)/orgchart: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,bench]"
	@touch $@

install: $(BIN)/orgchart ## Create .venv and install orgchart with its dev and bench tools

demo: install ## Run the main job end to end (embedded Postgres, offline model if no Ollama)
	$(BIN)/orgchart run "Assess the market for durable agent runtimes"

test: install ## Run the test suite (embedded Postgres unless ORGCHART_TEST_DATABASE_URL is set)
	$(BIN)/python -m pytest -q

lint: install ## ruff and mypy
	$(BIN)/ruff check agents runtime policies tests bench migrations
	$(BIN)/mypy

bench: install ## Run the benchmarks; writes bench/results/latest.json
	$(BIN)/python -m bench.run_all

chaos: install ## Only the chaos suite (kills workers, restarts PostgreSQL)
	$(BIN)/python -m pytest -q tests/chaos

ha-demo: install ## Kill the primary of a local pg_auto_failover formation mid-tree (root)
	$(BIN)/python -m bench.ha_demo

ha: install ## Only the high-availability tests (a formation, network namespaces; root)
	$(BIN)/python -m pytest -q -s tests/ha

clean: ## Remove the virtualenv and local data
	rm -rf $(VENV) .orgchart

.PHONY: help install demo test lint bench chaos ha-demo ha clean
