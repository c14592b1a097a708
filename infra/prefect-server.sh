#!/usr/bin/env bash
# Bring up (or tear down) a local Prefect server on SQLite, idempotently.
#   infra/prefect-server.sh up     start it on 127.0.0.1:4200 (logs in .infra/prefect-server.log)
#   infra/prefect-server.sh down   stop it
# Then point alignflow at it:  export PREFECT_API_URL=http://127.0.0.1:4200/api
set -euo pipefail
cd "$(dirname "$0")/.."
state=.infra; mkdir -p "$state"
pidfile=$state/prefect-server.pid
port=${PREFECT_SERVER_PORT:-4200}
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

case "${1:-up}" in
  up)
    if ! running; then
      set -m  # its own process group, so `down` stops the server and its children
      nohup .venv/bin/prefect server start --host 127.0.0.1 --port "$port" >"$state/prefect-server.log" 2>&1 &
      echo $! >"$pidfile"
      for _ in $(seq 90); do
        curl -sf "http://127.0.0.1:$port/api/health" >/dev/null && break
        sleep 1
      done
    fi
    curl -sf "http://127.0.0.1:$port/api/health" >/dev/null || { echo "prefect server did not start; see $state/prefect-server.log" >&2; exit 1; }
    echo "Prefect server up: UI http://127.0.0.1:$port"
    echo "export PREFECT_API_URL=http://127.0.0.1:$port/api"
    ;;
  down)
    if running; then kill -- -"$(cat "$pidfile")" 2>/dev/null || kill "$(cat "$pidfile")"; fi
    rm -f "$pidfile"
    echo "Prefect server down"
    ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
