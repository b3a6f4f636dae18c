# One command per verb. Each target creates or reuses .venv and installs the project into it.
VENV := .venv
PY := $(VENV)/bin/python
SG := $(VENV)/bin/sparseguard
STAMP := $(VENV)/.installed

.PHONY: run test lint bench fmt clean tools compose-check llama-cpp llama-server

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(SG) kernels build
	touch $(STAMP)

# First serve in minutes on 2 cores: calibration on 32 samples and 1024 held-out tokens (the
# defaults, 100 and 4096, take about 6 minutes) and without its baseline pass; the baselines
# and the trust model come from worker jobs that `up` queues once the stack is up, and the
# gateways install them from the control topic.
run: $(STAMP)
	$(SG) model fetch
	$(SG) calibrate --level all --if-missing --samples 32 --heldout-tokens 1024 --no-baseline
	$(SG) probe
	$(SG) up

test: $(STAMP) tools
	$(PY) -m pytest -q

# Debian tools the tests use, installed when missing: promtool (package prometheus) checks the
# exported alert rules; docker-compose (v1.29, no engine needed) validates docker-compose.yml
# offline; chromium renders the status page.
tools:
	@missing=""; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

compose-check: $(STAMP) tools
	$(PY) -m pytest -q tests/test_compose.py

# mypy's cache lives beside the other caches, outside the checkout: a fresh checkout (CI's) then
# rechecks only the files whose contents changed (2 minutes cold, seconds warm, on 2 cores).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY_CACHE_DIR=$(HOME)/.cache/sparseguard/mypy $(VENV)/bin/mypy

bench: $(STAMP)
	$(SG) model fetch
	$(SG) calibrate --level all --if-missing
	$(SG) bench engine
	$(SG) bench quality --data wiki --tokens 8192
	$(SG) bench gateway
	$(SG) bench batch-step
	$(SG) bench pipeline
	$(SG) bench speed

# Optional: llama.cpp's Python binding, for `bench speed`'s comparison row. It builds from
# source (about 5 minutes on 2 cores) and no test depends on it. Built without the AMX kernels:
# the default native build crashed (signal 11) on its first token on machines whose processors
# report AMX; AVX-512 only where the processor has it (an AVX-512 build dies with signal 4 on
# an AVX2-only processor).
LLAMA_AVX512 := $(shell grep -qs avx512f /proc/cpuinfo && echo ON || echo OFF)
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(LLAMA_AVX512) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
llama-cpp: $(STAMP)
	command -v cmake >/dev/null || (apt-get update -qq && apt-get install -y -qq cmake >/dev/null)
	$(PY) -m pip uninstall --quiet --yes llama-cpp-python  # a build for another processor
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install --quiet --no-cache-dir llama-cpp-python==0.3.36

# Optional: llama.cpp's own HTTP server, for `bench gateway`'s comparison row, built from the
# llama.cpp sources vendored in the same llama-cpp-python sdist (about 6 minutes on 2 cores),
# with the same processor flags; installed as ~/.cache/sparseguard/bin/llama-server.
LLAMA_SERVER_DIR := $(HOME)/.cache/sparseguard/llama-server
llama-server: $(STAMP)
	command -v cmake >/dev/null || (apt-get update -qq && apt-get install -y -qq cmake >/dev/null)
	mkdir -p $(LLAMA_SERVER_DIR) $(HOME)/.cache/sparseguard/bin
	test -f $(LLAMA_SERVER_DIR)/llama_cpp_python-0.3.36.tar.gz || $(PY) -m pip download --quiet \
		--no-deps --no-binary :all: -d $(LLAMA_SERVER_DIR) llama-cpp-python==0.3.36
	tar -xzf $(LLAMA_SERVER_DIR)/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_SERVER_DIR)
	cmake -S $(LLAMA_SERVER_DIR)/llama_cpp_python-0.3.36/vendor/llama.cpp \
		-B $(LLAMA_SERVER_DIR)/build $(LLAMA_CMAKE) -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
		-DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server -j 2 >/dev/null
	cp $(LLAMA_SERVER_DIR)/build/bin/llama-server $(HOME)/.cache/sparseguard/bin/llama-server

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
