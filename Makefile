# Two commands for a newcomer:  `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup system-deps demo test test-fast test-gpu bench-placement clean

setup:
	@VELA_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(BIN)/vela demo

# Debian's chromium for the report's browser test; that test skips (and says why) without it.
system-deps:
	-@bash scripts/ci_system_deps.sh

test: setup system-deps
	$(BIN)/python -m pytest tests

test-fast: setup
	$(BIN)/python -m pytest tests/unit

# The GPU-marked tests (they skip on machines without CUDA).
test-gpu: setup
	$(BIN)/python -m pytest tests -m gpu

bench-placement: setup
	$(BIN)/python benchmarks/placement_suite.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
