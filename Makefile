# vjpgen — `make demo` runs the main job, `make test` the tests. Every target sets up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install generate check-generated test demo bench bench-generate coverage clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -c 'from vjpgen.runtime.native import main; main()'
	touch $(STAMP)

generate: $(STAMP)
	$(PY) -m vjpgen generate

check-generated: $(STAMP)
	$(PY) -m vjpgen check

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP) generate
	$(PY) -m vjpgen.runtime.demo

coverage: $(STAMP)
	$(PY) -m tests.conformance --out coverage --edges --edge-max-samples 2

bench-generate: $(STAMP)
	$(PY) bench/bench_generate.py

bench: $(STAMP) bench-generate
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/bench_backward.py

clean:
	rm -rf $(VENV) build *.egg-info
