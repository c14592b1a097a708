#!/usr/bin/env bash
# Bring up (or tear down) a local Prefect server, on SQLite or PostgreSQL, and a process worker,
# idempotently, as root on Debian without systemd.
#   infra/prefect-server.sh up [--postgres]  start the server on 127.0.0.1:4200, on SQLite
#                                            (.infra/prefect.db) by default; --postgres or PREFECT_DB=postgres:
#                                            install and start PostgreSQL, role/db `prefect`, and use it.
#                                            Without either it keeps the database of a running server;
#                                            PREFECT_DB=sqlite|postgres switches (restarts the server).
#   infra/prefect-server.sh worker [--postgres]  `up`, then create work pool `align-process` (type
#                                            process, default working_dir = repo root) and start a
#                                            worker on it, in the repo root with .venv/bin first on PATH;
#                                            a running worker started with other credentials
#                                            (AWS_*, WANDB_API_KEY, HF_TOKEN) is restarted with these
#   infra/prefect-server.sh status           server, worker, database
#   infra/prefect-server.sh down             stop the worker, the server, and PostgreSQL if it started it
# Logs and pidfiles in .infra/ (prefect-server.log, prefect-worker.log).
# Optional: PREFECT_SERVER_PORT (4200), PREFECT_POOL (align-process), ALIGNFLOW_INFRA_DIR (.infra: state,
# SQLite database, logs, pidfiles), so a second server (tests/integration) runs beside a developer's.
# Then point alignflow at it:  export PREFECT_API_URL=http://127.0.0.1:4200/api
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD state=${ALIGNFLOW_INFRA_DIR:-$PWD/.infra}; mkdir -p "$state"
pidfile=$state/prefect-server.pid wpidfile=$state/prefect-worker.pid wenvfile=$state/prefect-worker.secrets dbfile=$state/prefect-server.db
port=${PREFECT_SERVER_PORT:-4200} pool=${PREFECT_POOL:-align-process}
db=${PREFECT_DB:-$(cat "$dbfile" 2>/dev/null || echo sqlite)}  # asked for, else the running one
[ "${2:-}" = --postgres ] && db=postgres
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
# the server streams a flow run's logs out, so `prefect deployment run --watch` shows them
# between its events (off by default: --watch would show events only)
export PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED=true PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED=true
export PREFECT_API_URL=http://127.0.0.1:$port/api PATH=$root/.venv/bin:$PATH
pg_url=postgresql+asyncpg://prefect:prefect@127.0.0.1:5432/prefect

# what a flow run's jobs need from the worker's environment, by digest (values never written)
secret_vars() { env | grep -E '^(AWS_[A-Z_]+|WANDB_API_KEY|HF_TOKEN)=' | sort || true; }
secret_digest() {  # salted per state dir, so that the digest of a weak secret is no lookup away
  [ -s "$state/salt" ] || od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$state/salt"
  { cat "$state/salt"; secret_vars; } | sha256sum | cut -c1-16
}
secret_names() { local n; n=$(secret_vars | cut -d= -f1 | paste -sd, -); echo "${n:-none set}"; }
running() { local p; p=$(cat "$1" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }
healthy() { curl -sf "$PREFECT_API_URL/health" >/dev/null; }
stop() {  # stop <pidfile>: TERM its process group, wait up to 20 s
  if running "$1"; then
    local p; p=$(cat "$1"); kill -- -"$p" 2>/dev/null || kill "$p"
    for _ in $(seq 40); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$1"
}
pg_cluster() { pg_lsclusters -h 2>/dev/null | awk '$3 == 5432 {print $1, $2; exit}'; }
pg_sql() { runuser -u postgres -- psql -qtAc "$1"; }

postgres_up() {
  if [ -z "$(pg_cluster)" ]; then
    command -v pg_lsclusters >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; } >"$state/apt.log"
    [ -n "$(pg_cluster)" ] || pg_createcluster "$(ls /usr/lib/postgresql | sort -n | tail -1)" main -p 5432
  fi
  # shellcheck disable=SC2046
  set -- $(pg_cluster)
  pg_ctlcluster "$1" "$2" status >/dev/null 2>&1 || pg_ctlcluster "$1" "$2" start
  [ "$(pg_sql "SELECT 1 FROM pg_roles WHERE rolname='prefect'")" = 1 ] || pg_sql "CREATE ROLE prefect LOGIN PASSWORD 'prefect'"
  [ "$(pg_sql "SELECT 1 FROM pg_database WHERE datname='prefect'")" = 1 ] || pg_sql "CREATE DATABASE prefect OWNER prefect"
}

down() {
  stop "$wpidfile"; stop "$pidfile"
  if [ "$(cat "$dbfile" 2>/dev/null)" = postgres ] && [ -n "$(pg_cluster)" ]; then
    # shellcheck disable=SC2046
    set -- $(pg_cluster)
    pg_ctlcluster "$1" "$2" status >/dev/null 2>&1 && pg_ctlcluster "$1" "$2" stop
  fi
  rm -f "$dbfile"
}

up() {
  # a server running on the other database is restarted on the requested one
  if running "$pidfile" && [ "$(cat "$dbfile" 2>/dev/null)" != "$db" ]; then down; fi
  if [ "$db" = postgres ]; then
    .venv/bin/python -c 'import asyncpg' 2>/dev/null || { echo "asyncpg missing in .venv: .venv/bin/pip install asyncpg" >&2; exit 1; }
    postgres_up
    export PREFECT_API_DATABASE_CONNECTION_URL=$pg_url
  else  # its own file, not ~/.prefect/prefect.db that ephemeral runs lock
    export PREFECT_API_DATABASE_CONNECTION_URL=sqlite+aiosqlite:///$state/prefect.db
  fi
  if ! running "$pidfile"; then
    echo "$db" >"$dbfile"
    set -m  # its own process group, so `down` stops the server and its children
    nohup prefect server start --host 127.0.0.1 --port "$port" >"$state/prefect-server.log" 2>&1 &
    echo $! >"$pidfile"
    set +m
    for _ in $(seq 90); do healthy && break; sleep 1; done
  fi
  healthy || { echo "prefect server did not start; see $state/prefect-server.log" >&2; exit 1; }
  echo "Prefect server up ($(cat "$dbfile")): UI http://127.0.0.1:$port"
}

worker() {
  up
  if ! prefect work-pool inspect "$pool" >/dev/null 2>&1; then
    # the pool's default working_dir is the repo root (else flow runs start in a temp dir)
    prefect work-pool get-default-base-job-template --type process | python3 -c '
import json, sys; t = json.load(sys.stdin)
t["variables"]["properties"]["working_dir"]["default"] = sys.argv[1]; print(json.dumps(t))' "$root" >"$state/$pool.json"
    prefect work-pool create "$pool" --type process --base-job-template "$state/$pool.json" >/dev/null
  fi
  # the worker passes its environment (the store's and wandb's credentials) to every flow run:
  # one started with other credentials than these is restarted, not silently kept
  local secrets; secrets=$(secret_digest)
  if running "$wpidfile" && [ "$(cat "$wenvfile" 2>/dev/null)" != "$secrets" ]; then
    echo "restarting the worker: it runs with other credentials ($(secret_names)) than this shell"
    stop "$wpidfile"
  fi
  if ! running "$wpidfile"; then
    echo "$secrets" >"$wenvfile"
    set -m  # else the background worker ignores SIGINT, and `down` could not stop its children
    nohup prefect worker start --pool "$pool" --type process >"$state/prefect-worker.log" 2>&1 &
    echo $! >"$wpidfile"
    set +m
    for _ in $(seq 60); do grep -q "started" "$state/prefect-worker.log" && break; sleep 1; done
  fi
  running "$wpidfile" || { echo "prefect worker did not start; see $state/prefect-worker.log" >&2; exit 1; }
  echo "Prefect worker up: pool $pool (process), cwd $root; log $state/prefect-worker.log"
}

case "${1:-up}" in
  up) up ;;
  worker) worker ;;
  status)
    healthy && echo "server: up ($(cat "$dbfile" 2>/dev/null)) at $PREFECT_API_URL" || echo "server: down"
    running "$wpidfile" && echo "worker: up (pool $pool)" || echo "worker: down"
    exit 0 ;;
  down) down; echo "Prefect down"; exit 0 ;;
  *) echo "usage: $0 up|worker [--postgres] | status | down" >&2; exit 2 ;;
esac
echo "export PREFECT_API_URL=$PREFECT_API_URL"
