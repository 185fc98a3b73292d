# Quick start: `make demo` (tiny DFSFT run) and `make test` (the whole suite).
# Each creates .venv if absent and installs the package with pinned dependencies.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fv_accel_installed

.PHONY: demo demo-finetune test install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q torch==2.13.0
	# DS_BUILD_OPS=0: DeepSpeed (a dev extra) installs without compiling its C++/CUDA extensions.
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# The demo starts afresh each time: a run refuses an output folder holding another run's checkpoints.
demo: $(STAMP)
	rm -rf outputs/tiny_dfsft
	$(VENV)/bin/accelerate launch train_dfsft.py

demo-finetune: $(STAMP)
	rm -rf outputs/tiny_finetune
	$(VENV)/bin/accelerate launch train_finetune.py

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf outputs
