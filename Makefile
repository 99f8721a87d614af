# The two commands of the README: `make up` starts the platform, `make test` runs the tests (all of them,
# as CI does). `make check` is the fast lane while working: every test not marked slow or e2e (whole
# platforms, faults, ahead-of-time compiles), in a few minutes.
# Both set up .venv (and missing Debian packages) first through scripts/bootstrap.sh.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2

.PHONY: setup up test check lint bench fmt

setup:
	@bash scripts/bootstrap.sh

up: setup
	$(VENV)/bin/tollgate up $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q --durations=15 $(PYTEST_ARGS)

check: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -m "not slow and not e2e" --durations=10 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy gateway billing tollgate admin_ui

fmt: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/engine_throughput.py
