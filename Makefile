# imgcls: `make train` trains the quickstart on the demo digits, `make test` runs the test suite.
# Both create .venv and install the package on a fresh machine first, every dependency from requirements.lock.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DATA   ?= data/digits
CONFIG ?= configs/quickstart.yaml
RUNS   ?= runs
LOCK   := requirements.lock

.PHONY: install lock train data test test-fast bench bench-quick gpu-wheels gpu-check dashboard sweep-dashboard pictures lint \
        clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The lock: every dependency of pyproject.toml (base, every extra, dev) pinned with the hashes of PyPI's files, for
# every platform (uv's universal resolution). Run it after editing pyproject.toml: pins that still fit are kept;
# UPGRADE=1 moves every pin to the newest version pyproject.toml allows.
lock: $(STAMP)
	$(BIN)/uv pip compile pyproject.toml --all-extras --universal --python-version 3.11 --generate-hashes \
	    --index-url https://pypi.org/simple --custom-compile-command "make lock" $(if $(UPGRADE),--upgrade) -o $(LOCK)

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

# The GPU check (benchmarks/gpu_check.py): `make gpu-wheels` here, then `make gpu-check` on a CUDA machine with .whl/
# beside it; that machine has no .venv, so its python3 runs it. `make gpu-check --dry-run` (make's -n) runs the same
# sections at tiny sizes on this machine: the + makes make run the line even then.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
DRY_RUN := $(if $(findstring n,$(firstword -$(MAKEFLAGS))),--dry-run)

gpu-wheels: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check --prepare

gpu-check:
	+$(GPU_PYTHON) -m benchmarks.gpu_check $(DRY_RUN)

dashboard: $(STAMP)
	$(BIN)/tensorboard --logdir $(RUNS) --host 127.0.0.1

# A sweep's trials in optuna-dashboard on http://127.0.0.1:$(PORT) (training/sweeps/dashboard.py). STORAGE as
# `imgcls sweep --storage` takes it, default $$IMGCLS_SWEEP_STORAGE; it reaches the dashboard through the environment,
# so a password in it is neither echoed here nor shown by `ps`.
PORT ?= 8080
sweep-dashboard: export IMGCLS_SWEEP_STORAGE := $(or $(STORAGE),$(IMGCLS_SWEEP_STORAGE))
sweep-dashboard: $(STAMP)
	$(BIN)/python -m training.sweeps.dashboard --port $(PORT)

# The pictures of README.md and docs/EXPERIMENTS.md (benchmarks/pictures.py): the quickstart and a short sweep trained
# under $(RUNS)/pictures/, their dashboards opened in headless Chromium (Debian's `chromium`), checked, photographed
# into docs/pictures/ with pictures.json (the machine, commit and command that made them).
pictures: data
	$(BIN)/python -m benchmarks.pictures

lint: $(STAMP)
	$(BIN)/ruff check .

# What `make train`, `make bench-quick`, `make pictures` and the tools made, and nothing else: a run of yours under
# $(RUNS)/ stays.
MADE   ?= $(DATA) $(RUNS)/quickstart $(RUNS)/bench-quick $(RUNS)/pictures .pytest_cache .ruff_cache

clean:
	@for path in $(MADE); do if [ -e "$$path" ]; then rm -rf "$$path" && echo "removed $$path"; fi; done
	@kept="$$(cd $(RUNS) 2>/dev/null && ls -d */ | sed 's|/$$||; s|^|$(RUNS)/|' | paste -sd' ')"; \
	if [ -n "$$kept" ]; then echo "kept $$kept"; fi
