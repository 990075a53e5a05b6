# vjpgen — `make demo` runs the main job, `make test` the tests. Every target sets up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the torch release generated/ is for (pyproject.toml admits every supported release)
DEV_TORCH := 2.13.0

.PHONY: install generate check-generated test test-torch tt-venv port-start demo demo-ddp bench bench-generate coverage clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' 'torch==$(DEV_TORCH)'
	$(PY) -c 'from vjpgen.runtime.native import main; main()'
	touch $(STAMP)

generate: $(STAMP)
	$(PY) -m vjpgen generate

check-generated: $(STAMP)
	$(PY) -m vjpgen check

test: $(STAMP)
	$(PY) -m pytest -q

# make test-torch TORCH=2.15.0 (any release; a ported one must pass): a throwaway venv under /tmp
# with that torch from the package index (a CUDA build on Linux, ~5 GB), vjpgen installed into it
# (which must keep that torch), the package regenerated for it in vjpgen's cache and verified
# against its live nodes, the op_db conformance (random values, edge values, compiled autograd),
# the native helper, then the demo. generated/ and .venv are not touched. This machine's pip
# configuration caps torch through a constraints file; PIP_CONSTRAINT=/dev/null lifts it for these
# throwaway venvs' pip commands only.
TORCH ?=
TT_VENV ?= /tmp/vjpgen-venv-torch-$(TORCH)
TT_PY := $(TT_VENV)/bin/python
TT_PIP := PIP_CONSTRAINT=/dev/null $(TT_PY) -m pip
RELEASE_CHECK_ARGS ?=

tt-venv:
	@test -n "$(TORCH)" || { echo "usage: make $(MAKECMDGOALS) TORCH=2.15.0"; exit 2; }
	test -x $(TT_PY) || $(PYTHON) -m venv $(TT_VENV)
	$(TT_PIP) install --quiet 'torch==$(TORCH)'
	$(TT_PIP) install --quiet -e '.[test]'
	$(TT_PY) -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(TORCH)' else f'installing vjpgen replaced torch $(TORCH) with {v}')"

test-torch: tt-venv
	$(TT_PY) -m tests.release_check $(RELEASE_CHECK_ARGS)
	$(TT_PY) -m vjpgen.runtime.demo

# make port-start TORCH=2.16.0: start porting a new release (docs/releases.md): its throwaway venv,
# the new and changed formulas and the new and re-signatured helpers since the last ported release
# (runtime/ported_release.json; written to port-$(TORCH)/), then the full release check.
port-start: tt-venv
	$(TT_PY) -m tests.port_start --out port-$(TORCH)
	$(TT_PY) -m tests.release_check $(RELEASE_CHECK_ARGS)

demo: $(STAMP) generate
	$(PY) -m vjpgen.runtime.demo

demo-ddp: $(STAMP) generate
	$(PY) -m vjpgen.runtime.demo_ddp

coverage: $(STAMP)
	$(PY) -m tests.conformance --out coverage --compiled-autograd --edges --edge-max-samples 2 --higher-order

bench-generate: $(STAMP)
	$(PY) bench/bench_generate.py

bench: $(STAMP) bench-generate
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/bench_backward.py
	$(PY) bench/bench_ddp.py
	$(PY) bench/bench_ca_kernels.py
	$(PY) bench/bench_higher_order.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
