#!/usr/bin/env bash
# steps.sh FILE — run on the device machine after install-on-device.sh, detached from the call that
# starts it, so that its steps outlive each call's 10 minutes and follow one another with no gap:
#
#   (setsid nohup bash scripts/gpu-kit/steps.sh scripts/gpu-kit/waiting.steps >/dev/null 2>&1 </dev/null &)
#
# FILE holds one step per line ("NAME: COMMAND"; "#" comments and blank lines skipped), each run
# under the kit's env.sh from the repository's root, one after another, whatever the one before
# returned. Each step's output goes to $STEPS_DIR/NAME.log (default /tmp/gpukit/steps), and a line
# per start and end to $STEPS_DIR/status; a step writes what it wants brought back (JSON) to
# $STEPS_DIR/out. collect.sh, in the calls that follow, waits for them and brings it back.
set -uo pipefail
file=${1:?usage: steps.sh FILE}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck disable=SC1091
. "${GPUKIT_ROOT:-/tmp/gpukit}/env.sh"
export STEPS_DIR=${STEPS_DIR:-/tmp/gpukit/steps} PYTHONUNBUFFERED=1
mkdir -p "$STEPS_DIR/out"
nvidia-smi -L >> "$STEPS_DIR/status" 2>&1
skip='^[[:space:]]*(#|$)'  # comments and blank lines
while IFS= read -r line; do
  [[ $line =~ $skip ]] && continue
  name=${line%%:*} command=${line#*:}
  echo "$(date +%T) start $name" >> "$STEPS_DIR/status"
  OUT=$STEPS_DIR/out bash -c "$command" > "$STEPS_DIR/$name.log" 2>&1
  rc=$?
  echo "$(date +%T) end $name rc=$rc" >> "$STEPS_DIR/status"
done < "$file"
echo "$(date +%T) all done" >> "$STEPS_DIR/status"
