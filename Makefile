# One-command setup: the first target that needs the venv builds it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: setup test test-avx2 test-fast serve lint clean mutation planted-bugs

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Install the CPU build of torch first so the range in pyproject.toml is already satisfied.
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The CPU kernels (model/kernels/*.cpp: decode attention, int8 row mapping), built now rather than by the first
	# server or test that asks for them; without a C++ compiler PyTorch's paths serve and this says why.
	$(BIN)/python -m model.kernels
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The suite again on the kernels of a CPU with AVX2 only (no AVX-512, VNNI or AMX), whatever CPU runs it:
# PyTorch's ATen kernels, oneDNN and fbgemm are each held to AVX2, and int8 layers take the activations such
# a CPU gets (tests/helpers/avx2_only.py). CI runs it after `make test`; see docs/TESTING.md.
test-avx2: setup
	$(BIN)/python -m tests.helpers.avx2_only -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

serve: setup
	$(BIN)/tserve serve $(SERVE_ARGS)

# Mutation testing (not part of `make test` or CI): a seeded sample of mutants of the engines, the KV cache,
# sampling / beam search and the batcher, at most 60 minutes; see docs/TESTING.md. Options go in
# MUTATION_ARGS, e.g. MUTATION_ARGS="--sample 0 --time-limit 240" or "--seed 3 --sample 60".
mutation: setup
	$(BIN)/python tests/tools/mutation.py $(MUTATION_ARGS)

# Plants known bugs one at a time in a copy of the tree and checks that their tests fail, on this CPU's
# kernels and on AVX2-only ones (not part of `make test`); see docs/TESTING.md. PLANTED="cancel" picks bugs
# by name, PLANTED="--avx2" one kind of kernels.
planted-bugs: setup
	$(BIN)/python tests/tools/planted_bugs.py $(PLANTED)

lint: setup
	$(BIN)/ruff check model service tests bench

clean:
	rm -rf $(VENV) .pytest_cache
