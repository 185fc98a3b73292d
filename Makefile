# Quick start: `make demo` (tiny DFSFT run), `make test` (the whole suite), `make bench` (the step-overhead
# guard, docs/performance.md) and `make test-fast`
# (an everyday subset, under a minute).
# Each creates .venv if absent and installs the package with pinned dependencies: the demos what
# they need (`pip install -e .`), the tests the dev extras on top (DeepSpeed, W&B, bitsandbytes,
# prodigyopt, pytest), each step recorded by its own stamp file.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fv_accel_installed
DEV_STAMP := $(VENV)/.fv_accel_dev_installed

.PHONY: demo demo-finetune test test-fast bench install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	# DS_BUILD_OPS=0: DeepSpeed (a dev extra) installs without compiling its C++/CUDA extensions.
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[dev]"
	@touch $(DEV_STAMP)

install: $(DEV_STAMP)

# The demo starts afresh each time: a run refuses an output folder holding another run's checkpoints.
# `accelerate launch` gives a lone CPU process one thread unless OMP_NUM_THREADS says otherwise: the
# demos use every core (an OMP_NUM_THREADS already set is kept).
DEMO_THREADS = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$(nproc)}
# Every launcher option given (one process, full precision, no compiler): `accelerate launch` without
# a config file otherwise prints a notice listing the defaults it used.
DEMO_LAUNCH = $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no

demo: $(STAMP)
	rm -rf outputs/tiny_dfsft
	$(DEMO_THREADS) $(DEMO_LAUNCH) train_dfsft.py

demo-finetune: $(STAMP)
	rm -rf outputs/tiny_finetune
	$(DEMO_THREADS) $(DEMO_LAUNCH) train_finetune.py

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
