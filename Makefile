# Two commands for a newcomer:  `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup system-deps demo test test-fast test-gpu gpu-battery gpu-check test-latest lock bench-placement wheelhouse gpu-wheels clean

setup:
	@VELA_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(BIN)/vela demo

# Debian's chromium for the report's browser test; that test skips (and says why) without it.
system-deps:
	-@bash scripts/ci_system_deps.sh

test: setup system-deps
	$(BIN)/python -m pytest tests

# Leaves out `job` tests (all of tests/ray, JobRunner and `vela` CLI runs), `slow` and `gpu` ones: under 3 min.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not job and not slow and not gpu"

# The GPU-marked tests. They skip on machines without CUDA; here VELA_REQUIRE_GPU=1 makes such a skip a
# failure (tests/conftest.py), so a machine with broken CUDA cannot pass having tested nothing.
test-gpu: setup
	VELA_REQUIRE_GPU=1 $(BIN)/python -m pytest tests -m gpu

# The GPU battery, for a bare offline GPU node (its own CUDA torch, plus only what `make gpu-wheels` carries):
# the environment, exactness against peft on the GPU, speed, tiers and NCCL, Ray-free, in 6 minutes, into
# benchmarks/results/gpu/battery.json (scripts/gpu_check.py --battery; deploy/README.md, "A bare GPU node").
# The node's python runs it (NODE_PYTHON, default python3), not .venv. Fails, saying so, without CUDA.
NODE_PYTHON ?= python3
gpu-battery:
	$(NODE_PYTHON) scripts/gpu_check.py --battery

# Everything a GPU machine with the project installed should show: the battery and the gpu tests (Ray's
# included), into benchmarks/results/gpu/gpu_check.json (scripts/gpu_check.py). Fails, saying so, without CUDA.
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py

# The newest releases of every dependency (torch kept), in .venv-latest, against the tests an upstream
# change breaks first: the family discovery, checkpoint loading and peft-equivalence tests.
LATEST_TESTS := tests/unit/test_families.py tests/unit/test_loading.py tests/unit/test_every_family.py \
	tests/unit/test_broker_equivalence.py tests/unit/test_bf16_expert_adapters.py tests/unit/test_family_checks.py
test-latest:
	@VELA_VENV=.venv-latest VELA_LATEST=1 bash scripts/setup.sh
	@.venv-latest/bin/python scripts/versions.py
	.venv-latest/bin/python -m pytest $(LATEST_TESTS)

# Re-resolve every dependency to its newest release and rewrite constraints.txt (then run `make test`).
lock:
	@bash scripts/lock.sh

bench-placement: setup
	$(BIN)/python benchmarks/placement_suite.py

# An offline install for GPU nodes without internet (deploy/README.md, "Install without internet"):
# every pin of constraints.txt but torch/triton/nvidia-*, plus vela-ray's own wheel, for the node's
# Python and platform, packed into OUT/parts (60 MiB parts + SHA256SUMS + offline_install.sh).
# e.g. make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64 OUT=wheelhouse (defaults: this python's)
OUT ?= wheelhouse
wheelhouse:
	@PY=$(PY) PLATFORM=$(PLATFORM) bash scripts/wheelhouse.sh $(OUT)

# Only what a bare, offline GPU node lacks for the Ray-free GPU battery, beside its own CUDA torch and numpy:
# the training core's closure (transformers, peft, pydantic, ...) at the pins, and vela-ray's wheel, as plain
# wheels in gpu-wheels/ (60 MiB at most; the node's install line is gpu-wheels/INSTALL; scripts/gpu_wheels.py).
# e.g. make gpu-wheels PY=3.12 PLATFORM=manylinux_2_28_x86_64 (the defaults: the reference node's)
gpu-wheels: setup
	$(BIN)/python scripts/gpu_wheels.py $(if $(PY),--python-version $(PY)) $(if $(PLATFORM),--platform $(PLATFORM))

clean:
	rm -rf $(VENV) .venv-latest .pytest_cache build *.egg-info
