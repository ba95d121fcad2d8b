PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install dev test generate certify

CERTIFY_OUT ?= certify-out/$(shell date -u +%Y%m%dT%H%M%SZ)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

# NeMo AutoModel is the V4.1 oracle (transformers has no V4.1 class); its wheel pins a training
# stack the forward does not need, so it goes in without dependencies (see deepinfer/ARCHITECTURE.md).
NEMO_AUTOMODEL := nemo-automodel==0.7.0

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(NEMO_AUTOMODEL)
	touch $@

install: $(VENV)/.installed

dev: $(VENV)/.dev-installed

# One worker per core, each file on one worker (module fixtures are built once); tests/conftest.py gives
# each worker its share of the threads. xdist queues files with more tests first (its default): starting the
# longest files first instead put test_invariance beside test_parallel's 4-rank launch and ran 745 s, not 692 s.
test: $(VENV)/.dev-installed
	$(VENV)/bin/pytest -q -n auto --dist loadfile

generate: $(VENV)/.installed
	$(VENV)/bin/deepinfer generate --prompt "The quick brown fox" --max-tokens 32

certify: $(VENV)/.installed
	$(VENV)/bin/deepinfer audit certify --suite smoke --out $(CERTIFY_OUT)
