#!/usr/bin/env bash
# Creates .venv at the repo root with alignflow (the `align` command) and pinned dependencies.
# Usage: ./install.sh [extras]   e.g. ./install.sh dev   or   ./install.sh dev,bench
set -euo pipefail
cd "$(dirname "$0")"
extras=${1:-}
[ -x .venv/bin/python ] || python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
echo "installed: $(.venv/bin/align --version 2>/dev/null || echo alignflow) in $(pwd)/.venv"
