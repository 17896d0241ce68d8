# The two set-up commands of the README: `make run` (main job on the embedded model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet -e ".[test,cluster]"   # cluster: Ray, so the cluster tests run too
	touch $(TEST_STAMP) $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/k3serve generate --prompt "def fibonacci(n):" --max-tokens 48

test: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest

bench: $(RUN_STAMP)
	$(VENV)/bin/python benchmarks/bench_mxfp4_kernel.py --quick
	$(VENV)/bin/python benchmarks/bench_decode.py --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
