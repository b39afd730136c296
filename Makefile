# Two commands for a newcomer:  `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast bench-placement clean

setup:
	@VELA_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(BIN)/vela demo

test: setup
	$(BIN)/python -m pytest tests

test-fast: setup
	$(BIN)/python -m pytest tests/unit

bench-placement: setup
	$(BIN)/python benchmarks/placement.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
