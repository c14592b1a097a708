#!/usr/bin/env bash
# Bring up (or tear down) a local S3 endpoint (moto_server, in memory) with one bucket, idempotently.
#   infra/s3.sh up       start it on this machine's first address (hostname -I; $S3_HOST), port
#                        ${S3_PORT:-9000}, create bucket ${S3_BUCKET:-alignflow}. Not loopback: the
#                        Slurm nodes of infra/slurm.sh (own network namespaces) reach it there
#   infra/s3.sh status
#   infra/s3.sh down     stop it (its contents are lost)
# Log and pidfile in .infra/ (s3.log, s3.pid). Then, as `up` prints:
#   export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_ENDPOINT_URL=http://127.0.0.1:9000
#   align run store.root=s3://alignflow/outputs +store.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:9000
set -euo pipefail
cd "$(dirname "$0")/.."
state=.infra; mkdir -p "$state"
pidfile=$state/s3.pid
port=${S3_PORT:-9000} bucket=${S3_BUCKET:-alignflow}
host=${S3_HOST:-$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -v : | head -n 1)}; host=${host:-127.0.0.1}  # first IPv4
url=http://$host:$port
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1

running() { local p; p=$(cat "$pidfile" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }
answers() { curl -s -o /dev/null "$url/"; }

case "${1:-up}" in
  up)
    if ! running; then
      set -m  # its own process group, so `down` stops it and its children
      nohup .venv/bin/moto_server -H "$host" -p "$port" >"$state/s3.log" 2>&1 &
      echo $! >"$pidfile"
      set +m
      for _ in $(seq 60); do answers && break; sleep 0.5; done
    fi
    answers || { echo "S3 server did not start; see $state/s3.log" >&2; exit 1; }
    # create the bucket (PUT is idempotent for its owner)
    curl -sf -X PUT -o /dev/null "$url/$bucket" || { echo "could not create bucket $bucket" >&2; exit 1; }
    echo "S3 (moto) up at $url, bucket s3://$bucket"
    echo "export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_ENDPOINT_URL=$url"
    echo "align run store.root=s3://$bucket/outputs +store.storage_options.client_kwargs.endpoint_url=$url"
    ;;
  status)
    if running && answers; then echo "S3 up at $url: $(curl -s "$url/" | grep -o '<Name>[^<]*</Name>' | sed 's/<[^>]*>//g' | tr '\n' ' ')"
    else echo "S3 down"; fi
    ;;
  down)
    if running; then p=$(cat "$pidfile"); kill -- -"$p" 2>/dev/null || kill "$p"
      for _ in $(seq 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -f "$pidfile"
    echo "S3 down"
    ;;
  *) echo "usage: $0 up|status|down" >&2; exit 2 ;;
esac
