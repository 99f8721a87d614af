# The two commands of the README: `make up` starts the platform, `make test` runs the tests (all of them,
# as CI does). `make check` is the fast lane while working: every test not marked slow or e2e (whole
# platforms, faults, ahead-of-time compiles), in a few minutes.
# Both set up .venv (and missing Debian packages) first through scripts/bootstrap.sh.
VENV := .venv
# Python keeps its bytecode caches, whatever the shell says (some export PYTHONDONTWRITEBYTECODE): the
# suite starts about 150 Python processes, and without the caches each one compiles the project's modules
# from source again, and each pytest worker rewrites the asserts of every test module again.
unexport PYTHONDONTWRITEBYTECODE
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
	$(VENV)/bin/mypy gateway billing tollgate admin_ui engine kernels

fmt: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/engine_throughput.py
