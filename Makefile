# Set-up is part of every target: a fresh machine needs nothing but Python 3.11+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CLI := $(VENV)/bin/recompute-bench
# One run id per make invocation (a recursive variable would re-run `date` on every use).
ifndef RUN_ID
RUN_ID := $(shell date -u +%Y%m%d-%H%M%S)
endif
# Empty: compare picks results/golden/<device kind>.csv of the measured device (cpu.csv here).
GOLDEN ?=

.PHONY: demo gate test test-all bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Users bring their own CUDA torch; without an NVIDIA GPU take the CPU build (it lies on disk here).
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c 'import torch' 2>/dev/null; then \
		$(PY) -m pip install -q torch==2.13.0; fi
	# torchao (the fp8 extra) is one 3 MB wheel without dependencies: the FP8 tests run for real on the CPU.
	$(PY) -m pip install -q -e '.[test,fp8]'
	touch $(STAMP)

# The default sweep (every recompute setting of `tiny`, each in its own process), compared with the
# shipped golden of this device, then the Markdown report and Pareto plot of the run.
demo: $(STAMP)
	$(CLI) workloads
	$(CLI) sweep --run-id demo-$(RUN_ID)
	$(CLI) report demo-$(RUN_ID)

# What a CI job runs: measure (a failed point is recorded, not fatal here), then the gate decides the
# exit code (0 pass, 1 regression, 2 bad input) and writes JUnit XML and a Markdown summary
# (also appended to $$GITHUB_STEP_SUMMARY when set).
gate: $(STAMP)
	-$(CLI) sweep --run-id gate-$(RUN_ID) --no-golden
	$(CLI) compare gate-$(RUN_ID) $(if $(GOLDEN),--golden $(GOLDEN)) \
		--junit results/gate-$(RUN_ID)/junit.xml --markdown results/gate-$(RUN_ID)/compare.md

# The fast lane (about three minutes on 2 cores): everything but the tests marked slow (multi-rank
# launches, sweeps of worker processes, the wheel). test-all runs the whole suite, as CI does.
test: $(STAMP)
	$(PY) -m pytest -m "not slow"

# Two pytest workers (pytest-xdist), a test file each at a time (module fixtures built once): the
# slow tests mostly wait on the worker processes and ranks they start, so two overlap on 2 cores.
# Each worker takes its share of the cores for torch's threads and OMP_NUM_THREADS (tests/conftest.py).
test-all: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadscope

bench: $(STAMP)
	$(PY) bench/recompute_overhead.py
	$(PY) bench/auto_policy.py
	$(PY) bench/megatron_check.py
	$(PY) bench/time_model_check.py
	$(PY) bench/pipeline_bubble.py
	$(PY) bench/step_overhead.py
	$(PY) bench/layout_search.py

# Everything the GPU tests and the GPU-only checks need, in four calls (CALL=1, 2, 3, 4) of at most
# 8 minutes of steps each on one H100/H200 (a device command runs at most 10 minutes), or CALL=quick:
# what matters most in at most 6 minutes; with the device's own Python and torch (no venv): each
# leaves OUT/summary-<call>.md, .json and one archive of its runs and logs (docs/gpu-check.md).
# Without a GPU it prints what the call would run.
OUT ?= results/gpu-check-$(RUN_ID)
CALL ?= 1
gpu-check:
	PYTHONPATH=. $(PYTHON) bench/gpu_check.py $(if $(filter quick,$(CALL)),--quick,--call $(CALL)) --out $(OUT)

clean:
	rm -rf $(VENV) results/runs.jsonl
