#!/usr/bin/env bash
# collect.sh SECONDS — run on the device machine in the calls after steps.sh started: waits until
# its steps are all done or SECONDS have passed, then puts under $OUT what the device tool brings
# back (at most 8 files): the status, every step's log and what the steps wrote to $STEPS_DIR/out
# in logs.tgz, and out's first six files beside it. Prints the status and the end of the latest log.
set -uo pipefail
steps=${STEPS_DIR:-/tmp/gpukit/steps}
end=$((SECONDS + ${1:?usage: collect.sh SECONDS}))
while [ $SECONDS -lt "$end" ] && ! grep -q "all done" "$steps/status" 2>/dev/null; do sleep 5; done
cat "$steps/status" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  cp "$steps/status" "$OUT/" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$steps" --exclude=status --exclude=out/lane.log . 2>/dev/null
  find "$steps/out" -maxdepth 1 -type f ! -name lane.log | head -6 | xargs -r cp -t "$OUT/"  # lane.sh's log: in logs.tgz
fi
latest=$(ls -t "$steps"/*.log 2>/dev/null | head -1)
[ -n "$latest" ] && { echo "== the end of $latest"; tail -30 "$latest"; }
exit 0
