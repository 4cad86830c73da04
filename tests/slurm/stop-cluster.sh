#!/usr/bin/env bash
# Stop the test cluster that tests/slurm/start-cluster.sh started in STATE_DIR, by its pid files
# (munged only when that script started it).
#   tests/slurm/stop-cluster.sh [STATE_DIR]
set -uo pipefail
state=$(realpath -m "${1:-/tmp/draftsmith-slurm}")

stop() {  # stop NAME: TERM the pid in run/NAME.pid, wait up to 10 s, then KILL
  local pidfile=$state/run/$1.pid pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
}
for daemon in slurmd slurmctld slurmdbd mariadbd munged; do stop "$daemon"; done
