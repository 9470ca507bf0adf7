# One-command setup: the first target that needs the venv builds it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: setup test test-fast serve lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Install the CPU build of torch first so the range in pyproject.toml is already satisfied.
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

serve: setup
	$(BIN)/tserve serve $(SERVE_ARGS)

lint: setup
	$(BIN)/ruff check model service tests bench

clean:
	rm -rf $(VENV) .pytest_cache
