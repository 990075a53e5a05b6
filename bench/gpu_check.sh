#!/usr/bin/env bash
# `make gpu-check`: vjpgen on the lent GPU machine (one H200; its own Python 3.12, torch with CUDA,
# Triton, transformers, timm; no package registry). Unattended, within 8 minutes with the machine's
# start-up: offline installs (~20 s), then bench/gpu_check.py's steps within its budget.
#
#   here:  make gpu-wheels             # the pure-Python wheels that machine lacks, into .whl/ (ignored)
#   there: bash bench/gpu_check.sh     # the device tool: run(command="bash bench/gpu_check.sh", carry=[".whl"])
#
# Without a CUDA device it stops at the first CUDA call with one line (exit 2); everything before
# that (the wheels, the editable install, importing vjpgen) runs anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${VJPGEN_GPU_SITE:-/tmp/vjpgen-gpu-site}
T0=$(date +%s)
log() { echo "[gpu-check $(( $(date +%s) - T0 ))s] $*"; }

# 1. the carried wheels (black and what it needs beyond that machine's image), into a side folder
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu-check: installing the carried wheels (.whl/) failed"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  log "carried wheels: $(ls .whl | tr '\n' ' ')"
fi
for m in setuptools jinja2 yaml black torch; do
  $PY -c "import $m" 2>/dev/null || { echo "gpu-check: python module '$m' is missing on this machine (carry its wheel: make gpu-wheels)"; exit 1; }
done

# 2. vjpgen without dependencies, against this machine's torch (offline: no build isolation)
PIPLOG=$(mktemp)
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$PIPLOG" 2>&1 \
  || { cat "$PIPLOG"; echo "gpu-check: pip install --no-deps --no-build-isolation -e . failed"; exit 1; }
log "vjpgen installed (editable) against torch $($PY -c 'import torch; print(torch.__version__)')"

# 3. the checks (versions, then the first CUDA call; demo, conformance slice, bench models)
exec $PY bench/gpu_check.py "$@"
