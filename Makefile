# One command per verb. Each target creates or reuses .venv and installs the project into it.
VENV := .venv
PY := $(VENV)/bin/python
SG := $(VENV)/bin/sparseguard
STAMP := $(VENV)/.installed

.PHONY: run test lint bench fmt clean promtool

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(SG) model fetch
	$(SG) calibrate --level all --if-missing
	$(SG) probe

test: $(STAMP) promtool
	$(PY) -m pytest -q

# The exported Prometheus rules are checked with promtool (Debian package `prometheus`).
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(SG) model fetch
	$(SG) calibrate --level all --if-missing
	$(SG) bench engine
	$(SG) bench quality --data wiki --tokens 8192
	$(SG) bench gateway
	$(SG) bench pipeline

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
