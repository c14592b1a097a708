#!/usr/bin/env bash
# Headless Chromium for screenshots of the Prefect UI (tests/integration), installed if missing.
#   infra/chromium.sh install              apt-get install chromium (idempotent); prints its path
#   infra/chromium.sh shot URL PNG [DOM]   screenshot URL into PNG (1400x1000) after letting the JS app
#                                          run (CHROMIUM_BUDGET_MS, default 15000); with DOM, also dump
#                                          the rendered DOM there
# Runs as root without a display: --headless --no-sandbox. Log of the install in .infra/apt-chromium.log.
set -euo pipefail
cd "$(dirname "$0")/.."
state=${ALIGNFLOW_INFRA_DIR:-$PWD/.infra}; mkdir -p "$state"

browser() { command -v chromium || command -v chromium-browser || command -v google-chrome || true; }

install() {
  if [ -z "$(browser)" ]; then
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core; } \
      >"$state/apt-chromium.log" 2>&1 || { echo "could not install chromium; see $state/apt-chromium.log" >&2; exit 1; }
  fi
  browser
}

flags() {
  echo --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars --no-first-run \
    --user-data-dir="$1" --window-size=1400,1000 --virtual-time-budget="${CHROMIUM_BUDGET_MS:-15000}"
}

case "${1:-install}" in
  install) install ;;
  shot)
    [ $# -ge 3 ] || { echo "usage: $0 shot URL PNG [DOM]" >&2; exit 2; }
    bin=$(install) profile=$(mktemp -d)
    trap 'rm -rf "$profile"' EXIT
    # shellcheck disable=SC2046
    "$bin" $(flags "$profile") --screenshot="$3" "$2" >"$state/chromium.log" 2>&1
    if [ -n "${4:-}" ]; then
      # shellcheck disable=SC2046
      "$bin" $(flags "$profile") --dump-dom "$2" >"$4" 2>>"$state/chromium.log"
    fi
    echo "$3"
    ;;
  *) echo "usage: $0 install | shot URL PNG [DOM]" >&2; exit 2 ;;
esac
