#!/usr/bin/env bash
# One device call of the gpu check, as the device tool runs it (carry [".whl"]):
#   LABKIT_GIT_COMMIT=<full sha> LABKIT_RUN_ID=<utc>@<sha12> bash scripts/gpu_call.sh tests:150 00:240 01:150
# installs the carried wheels (.whl: tools/gpu-wheels.sh .whl jupyter bnb site; papermill, nbconvert, ipykernel,
# bitsandbytes and pytest-xdist, which the device image lacks) into /tmp/site, registers the python3 kernel, and runs
# scripts/gpu_check.sh with the stages given, its rows, run archive and caches under $OUT/a.
# LABKIT_GIT_COMMIT: the device's copy of the tree has a stale .git; records name this commit instead.
# LABKIT_RUN_ID: give every call of one session on one (warm) machine the same id, so claims that compare figures of
# two notebooks (05's engine against 00's HF, 06's plan against 08's) are checked across calls; a new id when the
# machine changes (a call that reports warm: false started a fresh one).
set -u
cd "$(dirname "$0")/.."
: "${LABKIT_GIT_COMMIT:?set LABKIT_GIT_COMMIT to the commit of the tree sent}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null ||
  echo "wheel install into /tmp/site failed: is .whl carried?"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH JUPYTER_PATH=/tmp/site/share/jupyter PYTHONUNBUFFERED=1
export GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-8} LABKIT_GIT_COMMIT
[ -n "${LABKIT_RUN_ID:-}" ] && export LABKIT_RUN_ID
python3 -m ipykernel install --user --name python3 >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=${OUT:-out/gpu_check}/a bash scripts/gpu_check.sh "$@"
