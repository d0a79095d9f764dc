#!/usr/bin/env bash
# The GPU run on the H200 image as it is (no network, nothing installed): the checkout goes on
# PYTHONPATH and the image's own jax and libraries are used.  Results go to $OUT (or --out);
# see bench/gpu_run.py for the steps and bench/README.md for the exact device command.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" bench/gpu_run.py "$@"
