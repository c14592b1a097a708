#!/usr/bin/env bash
# Bring up (or tear down) a single-node Slurm cluster with accounting (slurmdbd + MariaDB), as
# root on Debian without systemd: daemons are started directly, idempotently.
#   infra/slurm.sh up       install packages if missing, write /etc/slurm/{slurm,slurmdbd}.conf,
#                           start munged, mariadb, slurmdbd, slurmctld, slurmd; wait for an idle node
#   infra/slurm.sh status   daemons, sinfo, recent sacct
#   infra/slurm.sh down     stop slurmd, slurmctld, slurmdbd, mariadb, munged (jobs' state is kept)
# State and logs: /var/lib/alignflow-slurm (or $ALIGNFLOW_SLURM_STATE), machine-wide like the
# cluster itself (/etc/slurm, MariaDB's /var/lib/mysql). Job ids stay unique in the accounting
# database (sacct, hence submitit, reads a job's state by id): a controller starting without
# state (first `up`, or its state removed) counts on from the database's highest id
# (FirstJobId). One partition `debug`.
# Then:  align run launcher=slurm launcher.partition=debug
#
# Requeue/cancel with submitit 1.5 (measured here, Slurm 22.05; see the infra report for details):
#   - `scancel <id>` -> CANCELLED; job.result() raises UncompletedJobError once submitit's watcher
#     sees it in sacct (no slurmdbd: result() blocks forever). The watcher polls every
#     min(600 s, job age/2), then waits 15 s for a result file: poll job.done(force_check=True).
#   - `scancel --signal=USR2 <id>` (plain; no --batch/--full needed) signals every task of the
#     srun step; rank 0 calls checkpoint(), runs `scontrol requeue` and exits; the job restarts
#     ~11 s later (cred_expire=10 + 1) and job.result() returns the final result. --full works too
#     (the batch shell dies of the USR2, racing the requeue); --batch alone fails the job.
#     Ranks != 0 keep running (submitit ignores SIGTERM) until they end or KillWait (30 s).
#   - Slurm sends USR2 itself slurm_signal_delay_s (default 90) s, or a bit more, before the limit.
#   - submitit counts a USR2 as a timeout (max_num_timeout, default 3) when the job ran
#     >= min(0.8*limit, limit-10min): always for timeout_min <= 10; else as a preemption.
set -euo pipefail
cd "$(dirname "$0")/.."
state=${ALIGNFLOW_SLURM_STATE:-/var/lib/alignflow-slurm}; mkdir -p "$state"
node=$(hostname -s)
cluster=${SLURM_CLUSTER:-alignflow}
dbpass=${SLURM_DB_PASS:-slurmdb}
export DEBIAN_FRONTEND=noninteractive

running() { local p; p=$(cat "$1" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }
stop() {  # stop <pidfile> <name>: TERM, then wait up to 15 s
  running "$1" || return 0
  kill "$(cat "$1")"
  for _ in $(seq 30); do running "$1" || return 0; sleep 0.5; done
  echo "$2 did not stop" >&2; return 1
}
wait_for() {  # wait_for <seconds> <what> <command...>
  local n=$1 what=$2; shift 2
  for _ in $(seq "$((n * 2))"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "$what not ready after ${n}s; see $state/" >&2; return 1
}
# write <file> <mode>, content on stdin; returns 0 only if the file changed
write() {
  local tmp; tmp=$(mktemp); cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; return 1; fi
  install -m "$2" "$tmp" "$1"; rm -f "$tmp"
}
mariadb_up() { mysqladmin --connect-timeout=2 ping; }
missing_packages() {  # the named Debian packages that are not installed, each after a space
  # No pipeline: under pipefail `dpkg-query ... | grep` takes dpkg-query's failure for an unknown package.
  local p out=""
  for p in "$@"; do
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || out="$out $p"
  done
  echo "$out"
}
first_job_id() {  # kept while the controller has state; else above every job the database knows
  if [ -s "$state/ctld/job_state" ]; then
    sed -n 's/^FirstJobId=//p' /etc/slurm/slurm.conf 2>/dev/null | grep . || echo 1
  else
    mysql -N -e "SELECT COALESCE(MAX(id_job), 0) + 1 FROM slurm_acct_db.\`${cluster}_job_table\`" 2>/dev/null || echo 1
  fi
}
node_idle() { sinfo -h -n "$node" -o %t | grep -qE '^(idle|mix|alloc)'; }

up() {
  local missing
  missing=$(missing_packages munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
  if [ -n "$missing" ]; then
    echo "installing$missing (log: $state/apt.log)"
    # shellcheck disable=SC2086
    { apt-get update -q && apt-get install -y -q $missing; } >"$state/apt.log" 2>&1 \
      || { tail -n 20 "$state/apt.log" >&2; echo "could not install$missing; see $state/apt.log" >&2; exit 1; }
    missing=$(missing_packages $missing)
    [ -z "$missing" ] || { echo "still not installed:$missing; see $state/apt.log" >&2; exit 1; }
  fi

  # munge
  [ -s /etc/munge/munge.key ] || { head -c 1024 /dev/urandom >/etc/munge/munge.key; }
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge /var/log/munge /var/lib/munge
  running /run/munge/munged.pid || runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged sh -c 'munge -n | unmunge'

  # mariadb (slurmdbd's storage)
  install -d -o mysql -g mysql /run/mysqld
  if ! mariadb_up >/dev/null 2>&1; then
    touch "$state/mariadb.log"; chown mysql "$state/mariadb.log"
    (setsid /usr/sbin/mariadbd --user=mysql --log-error="$state/mariadb.log" \
       --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &)
    wait_for 30 mariadb mariadb_up
  fi
  mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$dbpass';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

  # config: restart slurm daemons whose config changed
  local cpus mem first_id changed=0
  cpus=$(nproc); mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p'); first_id=$(first_job_id)
  mkdir -p /etc/slurm "$state/ctld" "$state/d"
  write /etc/slurm/slurmdbd.conf 600 <<EOF && changed=1 || true
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$state/slurmdbd.log
PidFile=$state/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
  write /etc/slurm/slurm.conf 644 <<EOF && changed=1 || true
# Written by infra/slurm.sh: single-node development cluster.
ClusterName=$cluster
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$state/ctld
FirstJobId=$first_id
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$changed" = 1 ]; then
    stop "$state/slurmd.pid" slurmd; stop "$state/slurmctld.pid" slurmctld; stop "$state/slurmdbd.pid" slurmdbd
  fi

  running "$state/slurmdbd.pid" || slurmdbd
  wait_for 30 slurmdbd sacctmgr -n list cluster
  grep -qx "$cluster" <<<"$(sacctmgr -n -P list cluster format=cluster)" || sacctmgr -i add cluster "$cluster" >/dev/null
  running "$state/slurmctld.pid" || slurmctld
  wait_for 30 slurmctld scontrol ping
  running "$state/slurmd.pid" || slurmd
  wait_for 30 "node $node" node_idle
  wait_for 30 sacct sacct -n -X -S now-1hours
  sinfo
  echo "Slurm up: cluster $cluster, node $node ($cpus CPUs, $mem MB), partition debug; logs in $state"
  echo "  align run launcher=slurm launcher.partition=debug"
}

status() {
  for d in slurmd slurmctld slurmdbd; do
    running "$state/$d.pid" && echo "$d: running" || echo "$d: stopped"
  done
  mariadb_up >/dev/null 2>&1 && echo "mariadb: running" || echo "mariadb: stopped"
  running /run/munge/munged.pid && echo "munged: running" || echo "munged: stopped"
  if running "$state/slurmctld.pid"; then sinfo; squeue; fi
  if running "$state/slurmdbd.pid"; then sacct -X -S now-1hours | tail -n 10; fi
}

down() {
  stop "$state/slurmd.pid" slurmd
  stop "$state/slurmctld.pid" slurmctld
  stop "$state/slurmdbd.pid" slurmdbd
  if command -v mysqladmin >/dev/null && mariadb_up >/dev/null 2>&1; then mysqladmin shutdown; fi
  stop /run/munge/munged.pid munged
  echo "Slurm down"
}

case "${1:-up}" in
  up) up ;;
  status) status ;;
  down) down ;;
  *) echo "usage: $0 up|status|down" >&2; exit 2 ;;
esac
