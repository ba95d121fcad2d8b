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

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

dev: $(VENV)/.dev-installed

test: $(VENV)/.dev-installed
	$(PY) -m pytest -q

generate: $(VENV)/.installed
	$(VENV)/bin/deepinfer generate --prompt "The quick brown fox" --max-tokens 32

certify: $(VENV)/.installed
	$(VENV)/bin/deepinfer audit certify --suite smoke --out $(CERTIFY_OUT)
