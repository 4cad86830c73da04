#!/usr/bin/env bash
# Start a single-node SLURM test cluster on this machine: munge, a private MariaDB, slurmdbd,
# slurmctld and slurmd, with GRES gpu on a node that has no GPU: plain files stand in for the
# device files, so the scheduler books and accounts GPUs and nothing touches a device.
#
#   tests/slurm/start-cluster.sh [STATE_DIR]     (default /tmp/draftsmith-slurm; needs root)
#
# Installs Debian's slurmctld, slurmd, slurmdbd, slurm-client, munge and mariadb-server with
# apt-get when they are missing (--no-install-recommends; about 40 s here, exit status 3 if it fails).
# Everything else lives under STATE_DIR; /etc is not touched (munge's key aside, which the munge
# package creates). Clients find the cluster through SLURM_CONF=STATE_DIR/etc/slurm.conf.
# Idempotent: returns at once when the cluster of STATE_DIR is already up. Stop it with
# tests/slurm/stop-cluster.sh STATE_DIR.
#
# Settings (environment): SLURM_TEST_GPUS (GRES gpu count of the node, default 4),
# SLURM_TEST_PORT_BASE (slurmctld port; slurmd, slurmdbd and MariaDB take the next three;
# default 16817, away from SLURM's defaults so a real installation is left alone).
set -euo pipefail

state=$(realpath -m "${1:-/tmp/draftsmith-slurm}")
gpus=${SLURM_TEST_GPUS:-4}
port=${SLURM_TEST_PORT_BASE:-16817}
etc=$state/etc
log=$state/log
export SLURM_CONF=$etc/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin

say() { printf '[slurm-test] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
elapsed() { echo "$((SECONDS - t0))s"; }
t0=$SECONDS

[[ $(id -u) == 0 ]] || die "must run as root (starts daemons, may apt-get install)"

if [[ -f $SLURM_CONF ]] && timeout 10 sinfo -h -o '%t' 2>/dev/null | grep -qx 'idle\|mix\|alloc'; then
  say "cluster of $state already up"
  exit 0
fi

# --- packages ---------------------------------------------------------------------------------
need=()
for pair in slurmctld:slurmctld slurmd:slurmd slurmdbd:slurmdbd sbatch:slurm-client \
             munged:munge mariadbd:mariadb-server; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if ((${#need[@]})); then
  command -v apt-get >/dev/null || die "missing ${need[*]} and no apt-get to install them"
  say "apt-get install ${need[*]} (about a minute)"
  export DEBIAN_FRONTEND=noninteractive
  # Exit status 3: the packages could not be installed (tests skip on it).
  apt-get update -qq >"$state.apt.log" 2>&1 || { tail -20 "$state.apt.log" >&2; say "apt-get update failed"; exit 3; }
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurmdbd slurm-client munge \
    mariadb-server mariadb-client >>"$state.apt.log" 2>&1 \
    || { tail -20 "$state.apt.log" >&2; say "apt-get install failed (log: $state.apt.log)"; exit 3; }
  say "packages installed after $(elapsed)"
fi

# --- a fresh state directory (a half-started earlier cluster is stopped first) ----------------
"$(dirname "$0")/stop-cluster.sh" "$state" >/dev/null 2>&1 || true
rm -rf "$state"
mkdir -p "$etc" "$log" "$state/run" "$state/spool/ctld" "$state/spool/d" "$state/mysql"
for p in $port $((port + 1)) $((port + 2)) $((port + 3)); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    die "port $p is taken (another test cluster? stop it with tests/slurm/stop-cluster.sh DIR, or set SLURM_TEST_PORT_BASE)"
  fi
done

# --- munge: the system daemon and key (SLURM's auth/munge talks to its default socket) ----------
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || { mkdir -p /etc/munge; (command -v mungekey >/dev/null && mungekey -c -f -k /etc/munge/munge.key) \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
  chown -R munge:munge /etc/munge; chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 755 /run/munge
  runuser -u munge -- munged || die "munged did not start (see /var/log/munge/munged.log)"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munge credentials do not round-trip"
  # Started here, so stopped with the cluster.
  cp /run/munge/munged.pid "$state/run/munged.pid" 2>/dev/null || pgrep -x -n munged >"$state/run/munged.pid" || true
fi

# --- MariaDB for slurmdbd: a private instance on 127.0.0.1 ------------------------------------
dbport=$((port + 3))
mariadb-install-db --user=root --datadir="$state/mysql" --auth-root-authentication-method=socket \
  --skip-test-db >"$log/mariadb-install.log" 2>&1 || { tail "$log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
sock=$state/run/mysqld.sock
# Started with setsid so it outlives this script and the caller's process group.
setsid mariadbd --no-defaults --user=root --datadir="$state/mysql" --socket="$sock" --port="$dbport" \
  --bind-address=127.0.0.1 --pid-file="$state/run/mariadbd.pid" --log-error="$log/mariadbd.log" \
  --innodb-buffer-pool-size=128M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
  </dev/null >/dev/null 2>&1 &
for _ in $(seq 100); do [[ -S $sock ]] && mariadb --socket="$sock" -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
mariadb --socket="$sock" -e 'select 1' >/dev/null 2>&1 || { tail "$log/mariadbd.log" >&2; die "MariaDB did not start"; }
mariadb --socket="$sock" <<'SQL'
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL

# --- SLURM configuration for this host ----------------------------------------------------------
host=$(hostname -s)
# slurmd -C prints this machine's real CPU layout and memory as a NodeName line.
hw=$(slurmd -C | head -1 | sed -E 's/^NodeName=[^ ]+ //; s/ UpTime=.*//')
cat >"$etc/slurm.conf" <<EOF
# Single-node test cluster (written by tests/slurm/start-cluster.sh).
ClusterName=draftsmith
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/spool/ctld
SlurmdSpoolDir=$state/spool/d
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$log/slurmctld.log
SlurmdLogFile=$log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: process tracking by /proc, no CPU binding, memory booked but not enforced.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
# CPUs, memory and GPUs are all consumable, so each job's request shows in ReqTRES/AllocTRES.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((port + 2))
AccountingStorageTRES=gres/gpu
# Keep sbatch --comment (the Snakemake rule and wildcards) in the database, for sacct.
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
# Finished jobs stay visible to scontrol for 10 minutes (sacct has them for good).
MinJobAge=600
InactiveLimit=0
KillWait=5
Waittime=0
NodeName=$host NodeAddr=127.0.0.1 $hw Gres=gpu:$gpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
# Stand-in GPUs: slurmd drops GPUs without File= ("Removing file-less GPU"), and never opens these
# files, so plain files stand in for /dev/nvidiaN. Jobs get CUDA_VISIBLE_DEVICES as on a GPU node.
mkdir -p "$state/dev"
for ((i = 0; i < gpus; i++)); do : >"$state/dev/gpu$i"; done
cat >"$etc/gres.conf" <<EOF
AutoDetect=off
NodeName=$host Name=gpu File=$state/dev/gpu[0-$((gpus - 1))]
EOF
cat >"$etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((port + 2))
SlurmUser=root
PidFile=$state/run/slurmdbd.pid
LogFile=$log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$dbport
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
chmod 600 "$etc/slurmdbd.conf"

# --- daemons ------------------------------------------------------------------------------------
wait_for() {  # wait_for SECONDS DESCRIPTION LOGFILE COMMAND...
  local secs=$1 what=$2 logfile=$3; shift 3
  for _ in $(seq $((secs * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  say "$what not ready after ${secs}s; last lines of $logfile:"; tail -20 "$logfile" >&2 || true
  die "$what did not start"
}
setsid slurmdbd </dev/null >"$log/slurmdbd.out" 2>&1
wait_for 60 slurmdbd "$log/slurmdbd.log" sacctmgr -n list cluster
# Register the cluster before slurmctld connects, so its first registration is accepted.
sacctmgr -i add cluster draftsmith >/dev/null 2>&1 || true
setsid slurmctld </dev/null >"$log/slurmctld.out" 2>&1
wait_for 60 slurmctld "$log/slurmctld.log" scontrol ping
setsid slurmd </dev/null >"$log/slurmd.out" 2>&1
node_up() { sinfo -h -N -o '%t' | grep -qx 'idle\|mix\|alloc'; }
wait_for 60 "node $host" "$log/slurmd.log" node_up
# An account with root in it, so jobs can be submitted with -A as on a real cluster.
sacctmgr -i add account draftsmith Description=tests Organization=draftsmith >/dev/null
sacctmgr -i add user root Account=draftsmith >/dev/null
say "cluster up after $(elapsed): SLURM_CONF=$SLURM_CONF"
sinfo -N -o '%N %c %m %G %t' >&2
