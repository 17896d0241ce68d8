# The two set-up commands of the README: `make run` (main job on the embedded model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/k3serve generate --prompt "def fibonacci(n):" --max-tokens 48

test: $(STAMP)
	$(VENV)/bin/python -m pytest

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_mxfp4_kernel.py --quick
	$(VENV)/bin/python benchmarks/bench_decode.py --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
