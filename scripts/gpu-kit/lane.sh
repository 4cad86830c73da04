#!/usr/bin/env bash
# lane.sh [PYTEST ARGS...] — the GPU lane on the device machine, after install-on-device.sh: every
# GPU-marked test (python3 -m pytest -m gpu tests) with the kit's environment, its log in
# $OUT/lane.log when the device tool gives an $OUT. Arguments go to pytest: -k EXPR, or test files
# in place of the whole tests/ folder.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck disable=SC1091
. "${GPUKIT_ROOT:-/tmp/gpukit}/env.sh"
where=(tests)
for arg in "$@"; do [[ $arg != -* && -e ${arg%%::*} ]] && where=(); done  # test paths given: not the whole folder
log=${OUT:+$OUT/lane.log}
PYTHONUNBUFFERED=1 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "${where[@]}" "$@" 2>&1 | tee "${log:-/dev/null}"
