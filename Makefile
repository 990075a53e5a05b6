# vjpgen — `make demo` runs the main job, `make test` the tests. Every target sets up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the torch release generated/ is for (pyproject.toml admits every supported release)
DEV_TORCH := 2.13.0

.PHONY: install generate check-generated test test-extra test-autograd test-torch test-matrix tt-venv port-start demo demo-ddp bench bench-deps bench-generate gpu-check gpu-wheels coverage clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' 'torch==$(DEV_TORCH)'
	$(PY) -m vjpgen native
	touch $(STAMP)

generate: $(STAMP)
	$(PY) -m vjpgen generate

check-generated: $(STAMP)
	$(PY) -m vjpgen check

# two xdist workers (this machine has 2 cores), a test file per unit (its module-scoped fixtures
# run once), the slowest files first (tests/conftest.py). TEST_WORKERS=0 runs them in one process.
# Cases marked `extra` (the bench scripts' smoke runs, tests/conftest.py's EXTRA_FILES) are left to `make test-extra`, which CI runs
# after `make test`: `make test` stays under five minutes on this machine.
TEST_WORKERS ?= 2
PYTEST_N := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: $(STAMP)
	$(PY) -m pytest -q -m "not extra" $(PYTEST_N)

test-extra: $(STAMP)
	$(PY) -m pytest -q -m extra $(PYTEST_N)

# make test-autograd TEST_AUTOGRAD=/path/to/test_autograd.py: PyTorch's own autograd tests (a local
# copy of the public file for the installed torch's release, not committed) run in eager and with
# backward routed through vjpgen; the report (tests/autograd_suite.py) goes to coverage/autograd_suite.md
TEST_AUTOGRAD ?=
SUITE_ARGS ?=
test-autograd: $(STAMP)
	@test -n "$(TEST_AUTOGRAD)" || { echo "usage: make test-autograd TEST_AUTOGRAD=/path/to/test_autograd.py"; exit 2; }
	$(PY) -m tests.autograd_suite $(TEST_AUTOGRAD) --out coverage/autograd_suite.md $(SUITE_ARGS)

# make test-torch TORCH=2.15.0 (any release; a ported one must pass): a throwaway venv under /tmp
# with that torch from the package index (a CUDA build on Linux, ~5 GB), vjpgen installed into it
# (which must keep that torch), the package regenerated for it in vjpgen's cache and verified
# against its live nodes, the op_db conformance (random values, edge values, compiled autograd),
# the native helper, the behavioural tests against eager (TT_BEHAVIOUR), then the demo.
# make test-matrix TORCH=2.15.0: the same venv, the structure and semantics matrices alone. generated/ and .venv are not touched. This machine's pip
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

# the behaviour on that release: the structure and semantics matrices and the entry contract
# against eager, the backend (its ops, its limits), the fused optimizer, TorchScript, distributed
TT_BEHAVIOUR := tests/runtime/test_structures.py tests/runtime/test_semantics_matrix.py \
  tests/runtime/test_entry_contract.py tests/runtime/test_dynamo_backend.py tests/runtime/test_backend_ops.py \
  tests/runtime/test_fused_optim.py tests/runtime/test_torchscript.py tests/distributed/test_backend_distributed.py
# the matrices alone (CI runs them on the current release, TORCH=2.15.0, from a venv kept in /tmp)
TT_MATRIX := tests/runtime/test_structures.py tests/runtime/test_semantics_matrix.py
TT_PYTEST := $(TT_PY) -m pytest -q -p no:cacheprovider $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-torch: tt-venv
	$(TT_PY) -m tests.release_check $(RELEASE_CHECK_ARGS)
	$(TT_PYTEST) $(TT_BEHAVIOUR)
	$(TT_PY) -m examples.demo

test-matrix: tt-venv
	$(TT_PYTEST) $(TT_MATRIX)

# make port-start TORCH=2.16.0: start porting a new release (docs/releases.md): its throwaway venv,
# the new and changed formulas and the new and re-signatured helpers since the last ported release
# (runtime/ported_release.json; written to port-$(TORCH)/), then the full release check.
port-start: tt-venv
	$(TT_PY) -m tests.port_start --out port-$(TORCH)
	$(TT_PY) -m tests.release_check $(RELEASE_CHECK_ARGS)

demo: $(STAMP) generate
	$(PY) -m examples.demo

demo-ddp: $(STAMP) generate
	$(PY) -m examples.demo_ddp

coverage: $(STAMP)
	$(PY) -m tests.conformance --out coverage --compiled-autograd --edges --edge-max-samples 2 --higher-order
	$(PY) -m tests.conformance_backend --out coverage

bench-generate: $(STAMP)
	$(PY) bench/bench_generate.py

# the bench extra (pyproject.toml) whenever any of its packages is missing, torchvision pinned to the
# installed torch's release; fails if that changed torch (bench/deps.py)
bench-deps: $(STAMP)
	$(PY) bench/deps.py

# every bench script, results to bench/results/ (docs/benchmarks.md); `--smoke` runs of the same
# scripts are in `make test` (tests/test_bench_smoke.py)
bench: $(STAMP) bench-deps bench-generate
	$(PY) bench/bench_backward.py
	$(PY) bench/bench_models.py
	$(PY) bench/bench_step.py
	$(PY) bench/bench_optim.py
	$(PY) bench/bench_ddp.py
	$(PY) bench/bench_ca_kernels.py
	$(PY) bench/bench_higher_order.py
	$(PY) bench/bench_higher_step.py
	$(PY) bench/bench_warm_start.py

# The GPU check, for the lent GPU machine (docs/benchmarks.md): its own python3 and torch, no
# registry there. `make gpu-wheels` here fetches the pure-Python wheels it lacks into .whl/ (ignored),
# which the device tool carries; there `make gpu-check` (or `bash bench/gpu_check.sh`) installs them
# and vjpgen offline and writes bench/results/gpu.md. Without CUDA it stops at the first CUDA call.
GPU_PY ?= 3.12
GPU_WHEELS := black==26.10.1 platformdirs==4.14.9 pytokens==0.4.1 expecttest==0.3.0
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform any -d .whl $(GPU_WHEELS)
	ls -l .whl

gpu-check:
	PYTHON=$${PYTHON_GPU:-python3} bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
