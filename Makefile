# Quick start: `make demo` (250 steps of the tiny DFSFT default, under a minute), `make demo-full` (its
# 1,250 steps), `make test` (the whole suite), `make bench` (the step-overhead guard, docs/performance.md)
# and `make test-fast` (an everyday subset, under a minute).
# Each creates .venv if absent and installs the package with pinned dependencies (with uv): the demos
# what they need (`-e .`), the tests the dev extras on top (DeepSpeed, W&B, bitsandbytes, prodigyopt,
# pytest), each step recorded by its own stamp file. `.venv/bin/uv pip install ...` adds a package.
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
UV_VERSION := 0.13.9
STAMP := $(VENV)/.fv_accel_installed
DEV_STAMP := $(VENV)/.fv_accel_dev_installed
# uv reads no pip configuration: pip's find-links (a folder of local wheels, such as a CPU build of
# torch) are passed on to it, from PIP_FIND_LINKS or pip's config files.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(UV) pip install -q --python $(PY) $(foreach d,$(FIND_LINKS),--find-links $(d))

.PHONY: demo demo-full demo-finetune test test-fast bench install clean

# Python writes the bytecode of what it imports into .venv (and __pycache__, ignored by git) even where
# the environment sets PYTHONDONTWRITEBYTECODE: without it every process compiles torch, diffusers and
# peft from source again (12 s of a 19 s start here; each process of a multi-process test pays it).
unexport PYTHONDONTWRITEBYTECODE

# The environment: a venv with uv in it (installed by the system's pip), then the package with pinned
# dependencies installed by uv.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv --without-pip $(VENV)
	@test -x $(UV) || python3 -m pip --python $(PY) install -q --disable-pip-version-check uv==$(UV_VERSION)
	# torch pinned in the same command: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
	$(UV_INSTALL) torch==2.13.0 -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	# DeepSpeed (a dev extra, a source package) builds against the venv's torch, without compiling its
	# C++/CUDA extensions (DS_BUILD_OPS=0); setuptools first, which that build imports.
	$(UV_INSTALL) setuptools wheel
	DS_BUILD_OPS=0 $(UV_INSTALL) --no-build-isolation-package deepspeed -e ".[dev]"
	@touch $(DEV_STAMP)

install: $(DEV_STAMP)

# The demo starts afresh each time: a run refuses an output folder holding another run's checkpoints.
# Every launcher option given (one process, full precision, no compiler): `accelerate launch` without
# a config file otherwise prints a notice listing the defaults it used. With no thread option the run
# computes on every core (fv_accel.cpu_threads).
DEMO_LAUNCH = $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no

# demo: the first 250 of the recipe's 1,250 steps, sample videos at steps 0 and 250 (under a
# minute on 2 cores); demo-full: all 1,250 steps, where the squares move as in their clips
# (docs/validation-and-telemetry.md, "What the tiny demo shows").
demo: $(STAMP)
	rm -rf outputs/tiny_dfsft
	$(DEMO_LAUNCH) train_dfsft.py --max_train_steps 250 --callbacks.validation.every_steps 250

demo-full: $(STAMP)
	rm -rf outputs/tiny_dfsft
	$(DEMO_LAUNCH) train_dfsft.py

demo-finetune: $(STAMP)
	rm -rf outputs/tiny_finetune
	$(DEMO_LAUNCH) train_finetune.py

# --durations: the 15 slowest tests, listed at the end.
test: $(DEV_STAMP)
	$(PY) -m pytest -q --durations=15 tests

# The fast lane: recipe parsing and validation, schedulers, the methods' losses, the data loader,
# input errors, the model card and Hub push, the context-parallel layout and the memory estimate;
# no multi-process or slow test. CI runs `make test`.
FAST_TESTS := tests/test_config.py tests/test_schedulers.py tests/test_layering.py tests/test_timestep_range.py \
	tests/test_methods.py tests/test_loader.py tests/test_bad_input.py tests/test_hub.py \
	tests/test_context_parallel.py tests/test_memory_estimate.py
test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q -m "not slow and not multiproc" $(FAST_TESTS)

# The step-overhead guard (docs/performance.md: run it before a release and after a change to the
# loop): our SFT, DFSFT and LoRA steps against bare PyTorch loops at the small size, MET or MISSED
# per target, exit status 1 when one is missed. ~15 min on 2 idle cores; keep the machine quiet.
BENCH_ROUNDS ?= 12
bench: $(DEV_STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$(nproc)} $(PY) benchmarks/step_overhead.py --sizes small --rounds $(BENCH_ROUNDS) \
		--name step_overhead_$$(date +%Y-%m-%d)

clean:
	rm -rf outputs
