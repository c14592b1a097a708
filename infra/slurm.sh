#!/usr/bin/env bash
# Bring up (or tear down) a Slurm cluster of $SLURM_NODES nodes (default 2) on this machine, with
# accounting (slurmdbd + MariaDB), as root on Debian without systemd: daemons are started
# directly, idempotently.
#   infra/slurm.sh up       install packages if missing, write /etc/slurm/{slurm,slurmdbd}.conf,
#                           start munged, mariadb, slurmdbd, slurmctld, one slurmd per node; wait
#                           until every node is idle
#   infra/slurm.sh status   daemons, sinfo, recent sacct
#   infra/slurm.sh down     stop every slurmd, slurmctld, slurmdbd, mariadb, munged; remove the
#                           nodes' namespaces and bridge (jobs' state is kept)
# Nodes: SLURM_NODES=1 runs one slurmd on this host, named as it. SLURM_NODES=N>1 runs afnode1..N
# ($SLURM_NODE_PREFIX), each slurmd in its own network namespace (address $SLURM_SUBNET.1i on the
# bridge afslurm0, whose host side, $SLURM_SUBNET.1, slurmctld listens on), UTS namespace
# (`hostname` is the node's name) and mount namespace, where $state/node-local is the node's own
# tmpfs (node-local scratch); the rest of the filesystem is the host's, shared by every node.
# The node names resolve for every job through /etc/hosts (a marked block, rewritten in place).
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
set -euo pipefail  # (no `cmd | grep -q`: grep leaving early fails cmd with SIGPIPE)
cd "$(dirname "$0")/.."
state=${ALIGNFLOW_SLURM_STATE:-/var/lib/alignflow-slurm}; mkdir -p "$state"
host=$(hostname -s)
nodes=${SLURM_NODES:-2}
prefix=${SLURM_NODE_PREFIX:-afnode}
subnet=${SLURM_SUBNET:-10.213.0}
bridge=afslurm0
[[ "$nodes" =~ ^[1-9][0-9]?$ ]] || { echo "SLURM_NODES must be 1..99, got '$nodes'" >&2; exit 2; }
cluster=${SLURM_CLUSTER:-alignflow}
dbpass=${SLURM_DB_PASS:-slurmdb}
export DEBIAN_FRONTEND=noninteractive

running() {  # running <pidfile>: its process lives and is the daemon the file is named for (slurmd-afnode1.pid: slurmd);
  # a pid file left by a machine restarted from a disk snapshot may name another process
  local p name; p=$(cat "$1" 2>/dev/null) || return 1
  name=$(basename "$1" .pid); name=${name%%-*}
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$name" ]
}
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
node_names() { if [ "$nodes" = 1 ]; then echo "$host"; else seq -f "$prefix%g" "$nodes"; fi; }
nodes_idle() { [ "$(sinfo -h -N -o %t | grep -cE '^(idle|mix|alloc)')" = "$nodes" ]; }
ctld_addr() { if [ "$nodes" = 1 ]; then echo 127.0.0.1; else echo "$subnet.1"; fi; }
node_addr() { if [ "$nodes" = 1 ]; then echo 127.0.0.1; else echo "$subnet.$((10 + ${1#"$prefix"}))"; fi; }
node_netns() { ip netns list | awk '{print $1}' | grep -E "^$prefix[0-9]+$" || true; }

network_up() {  # the bridge; per node a network namespace named as the node, a veth on the bridge
  ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
  ip addr show dev "$bridge" | grep "inet $subnet.1/24" >/dev/null || ip addr add "$subnet.1/24" dev "$bridge"
  ip link set "$bridge" up
  local name addr
  for name in $(node_names); do
    addr=$(node_addr "$name")
    if ! mountpoint -q "/run/netns/$name"; then  # absent, or a file a restarted machine kept without its namespace
      ip netns del "$name" 2>/dev/null || true; ip link del "v-$name" 2>/dev/null || true; ip netns add "$name"
    fi
    ip link show "v-$name" >/dev/null 2>&1 || ip link add "v-$name" type veth peer name eth0 netns "$name"
    ip link set "v-$name" master "$bridge" up
    ip -n "$name" link set lo up
    ip -n "$name" addr show dev eth0 | grep "inet $addr/" >/dev/null || ip -n "$name" addr add "$addr/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" route replace default via "$subnet.1"  # the host's own addresses (an S3 endpoint, a store server) are reachable
  done
}
network_down() {  # keep <names...>: every other node's namespace and veth go; with none kept, the bridge too
  local name
  for name in $(node_netns); do
    if ! printf '%s\n' "$@" | grep -x "$name" >/dev/null; then ip link del "v-$name" 2>/dev/null || true; ip netns del "$name"; fi
  done
  [ "$#" -gt 0 ] || ip link del "$bridge" 2>/dev/null || true
}
hosts_entries() {  # /etc/hosts: the nodes' names and addresses between two marker lines
  local begin="# alignflow slurm nodes: begin" end="# alignflow slurm nodes: end" name
  {
    sed "/^$begin\$/,/^$end\$/d" /etc/hosts
    if [ "$nodes" != 1 ]; then
      echo "$begin"; for name in $(node_names); do echo "$(node_addr "$name") $name"; done; echo "$end"
    fi
  } | write /etc/hosts 644 || true
}
slurmd_up() {  # slurmd_up <node>: in its namespaces (on a one-node cluster, this host's)
  # (nsenter, not `ip netns exec`, which remounts /sys without the cgroup tree slurmd needs)
  running "$state/slurmd-$1.pid" && return 0
  if [ "$nodes" = 1 ]; then slurmd -N "$1"; return; fi
  mkdir -p "$state/node-local"
  nsenter --net="/run/netns/$1" unshare --uts --mount --propagation private sh -c \
    'hostname "$1" && mount -t tmpfs -o size=1g,mode=1777 "node-local-$1" "$2" && exec slurmd -N "$1"' sh "$1" "$state/node-local"
}
stop_slurmds() {  # keep <names...>: stop every other slurmd (also of a cluster of another size)
  local pidfile name
  for pidfile in "$state"/slurmd*.pid; do
    [ -e "$pidfile" ] || continue
    name=$(basename "$pidfile" .pid); name=${name#slurmd}; name=${name#-}
    if ! printf '%s\n' "$@" | grep -x "$name" >/dev/null; then stop "$pidfile" slurmd && rm -f "$pidfile"; fi
  done
}
cancel_orphans() {  # cancel_orphans <epoch>: jobs started before then (restored by a controller started then)
  local id start  # whose processes are gone (every node is on this machine)
  while read -r id start; do
    [ -n "$id" ] && [ "$(date -d "$start" +%s)" -lt "$1" ] || continue
    pgrep -f "^slurmstepd: \[$id\." >/dev/null || { echo "job $id: restored as running, no process left: cancelled"; scancel "$id"; }
  done <<<"$(squeue -h -t RUNNING,COMPLETING -o '%A %S')"
}

up() {
  local missing
  missing=$(missing_packages munge slurmctld slurmd slurm-client slurmdbd mariadb-server iproute2)  # iproute2: the nodes' network
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

  # nodes: those of another cluster size go; this size's network and names
  # shellcheck disable=SC2046
  stop_slurmds $(node_names); network_down $([ "$nodes" = 1 ] || node_names)
  [ "$nodes" = 1 ] || network_up
  hosts_entries

  # config: restart slurm daemons whose config changed
  local cpus mem first_id changed=0
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p'); first_id=$(first_job_id)
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
# Written by infra/slurm.sh: a development cluster of $nodes node(s) on one machine.
ClusterName=$cluster
SlurmctldHost=$host($(ctld_addr))
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$state/ctld
FirstJobId=$first_id
SlurmdSpoolDir=$state/d/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd-%n.log
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
$(for name in $(node_names); do echo "NodeName=$name NodeAddr=$(node_addr "$name") CPUs=$cpus RealMemory=$mem State=UNKNOWN"; done)
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$changed" = 1 ]; then
    stop_slurmds; stop "$state/slurmctld.pid" slurmctld; stop "$state/slurmdbd.pid" slurmdbd
  fi

  running "$state/slurmdbd.pid" || slurmdbd
  wait_for 30 slurmdbd sacctmgr -n list cluster
  grep -qx "$cluster" <<<"$(sacctmgr -n -P list cluster format=cluster)" || sacctmgr -i add cluster "$cluster" >/dev/null
  local cold=0
  running "$state/slurmctld.pid" || { cold=$(date +%s); slurmctld; }
  wait_for 30 slurmctld scontrol ping
  for name in $(node_names); do slurmd_up "$name"; done
  [ "$cold" = 0 ] || cancel_orphans "$cold"
  wait_for 30 "nodes $(node_names | paste -sd ' ')" nodes_idle
  wait_for 30 sacct sacct -n -X -S now-1hours
  sinfo
  echo "Slurm up: cluster $cluster, $nodes node(s) $(node_names | paste -sd ' ') ($cpus CPUs, $mem MB each), partition debug; logs in $state"
  echo "  align run launcher=slurm launcher.partition=debug"
}

status() {
  for name in $(node_names); do
    running "$state/slurmd-$name.pid" && echo "slurmd $name: running" || echo "slurmd $name: stopped"
  done
  for d in slurmctld slurmdbd; do
    running "$state/$d.pid" && echo "$d: running" || echo "$d: stopped"
  done
  mariadb_up >/dev/null 2>&1 && echo "mariadb: running" || echo "mariadb: stopped"
  running /run/munge/munged.pid && echo "munged: running" || echo "munged: stopped"
  if running "$state/slurmctld.pid"; then sinfo; squeue; fi
  if running "$state/slurmdbd.pid"; then sacct -X -S now-1hours | tail -n 10; fi
}

down() {
  stop_slurmds
  network_down
  SLURM_NODES=1 nodes=1 hosts_entries
  stop "$state/slurmctld.pid" slurmctld
  stop "$state/slurmdbd.pid" slurmdbd
  if command -v mysqladmin >/dev/null && mariadb_up >/dev/null 2>&1; then mysqladmin shutdown; fi
  stop /run/munge/munged.pid munged
  echo "Slurm down"
}

# One `up` or `down` at a time (two sessions, two test workers would both start the daemons);
# the lock is flock(1)'s, closed for the script (-o), so no daemon it starts holds it.
case "${1:-up}" in
  up | down) exec flock -o "$state/lock" "$0" "locked-$1" ;;
  locked-up) up ;;
  locked-down) down ;;
  status) status ;;
  *) echo "usage: $0 up|status|down" >&2; exit 2 ;;
esac
