# The two commands of the README: `make up` starts the platform, `make test` runs the tests.
# Both set up .venv (and missing Debian packages) first through scripts/bootstrap.sh.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2

.PHONY: setup up test lint bench fmt

setup:
	@bash scripts/bootstrap.sh

up: setup
	$(VENV)/bin/tollgate up $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy gateway billing tollgate admin_ui

fmt: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/engine_throughput.py
