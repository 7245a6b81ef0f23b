# imgcls: `make train` trains the quickstart on the demo digits, `make test` runs the test suite.
# Both create .venv and install the package on a fresh machine first.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DATA   ?= data/digits
CONFIG ?= configs/quickstart.yaml
RUNS   ?= runs

.PHONY: install train data test test-fast bench bench-quick dashboard lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/imgcls demo-data $(DATA)

train: data
	$(BIN)/imgcls fit --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick --out $(RUNS)/bench-quick/PERFORMANCE.md

dashboard: $(STAMP)
	$(BIN)/tensorboard --logdir $(RUNS) --host 127.0.0.1

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(RUNS) $(DATA) .pytest_cache
