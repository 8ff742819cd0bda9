# eSurge-gRPC developer entry points. `make serve` and `make test` do all set-up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= models/default
PORT ?= 50051
PYTEST_ARGS ?=

.PHONY: install test serve proto lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the dependency list changes, so `make test` stays quick.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

serve: install
	$(PY) -m service --model $(MODEL) --port $(PORT)

proto: install
	$(PY) tools/gen_proto.py

lint: install
	$(VENV)/bin/ruff check esurge service tests bench tools
	$(VENV)/bin/mypy

bench: install
	$(PY) bench/kv_cache.py
	$(PY) bench/scheduler.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
