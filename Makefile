# Set-up is part of every target: a fresh machine needs nothing but Python 3.10+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Users bring their own CUDA torch; without an NVIDIA GPU take the CPU build (it lies on disk here).
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c 'import torch' 2>/dev/null; then \
		$(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test,report]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recompute-bench workloads
	$(VENV)/bin/recompute-bench run --workload tiny

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/recompute_overhead.py

clean:
	rm -rf $(VENV) results/runs.jsonl
