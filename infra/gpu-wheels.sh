#!/usr/bin/env bash
# The wheels a GPU machine lacks to run bench/gpu.py (its phases: the bench, the GPU tests) from source: its
# image has Python 3.12, torch 2.11, transformers, accelerate, peft, pyarrow, pandas, pytest and
# more, but no megatron-core, omegaconf, hydra, submitit, trl or datasets, and no package index.
# Neither the bench nor the GPU tests import Prefect; `align run` (the demo pipelines) does.
#
#   bash infra/gpu-wheels.sh            here (with a package index): cp312 manylinux wheels into .whl/
#                                       (gitignored), their total size; fails over 40 MiB
#   bash infra/gpu-wheels.sh prefect    here: also Prefect's closure into .whl/prefect/ (39 MiB; the
#                                       image has part of it, pip takes the rest from there)
#   bash infra/gpu-wheels.sh install    there, from the repository root with .whl/ carried: installs them
#                                       into /tmp/site, seen by every python3 (the tests' subprocesses
#                                       too), and lists what they need that the machine lacks; with
#                                       .whl/prefect/ also Prefect into the machine's environment
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIMIT_MIB=40
SITE=${SITE:-/tmp/site}
# What `bench/gpu.py --install` needs beyond the image, at the pins CI resolves (constraints of
# pyproject's dev/bench extras), and no more: hydra-core and omegaconf need antlr4-python3-runtime
# 4.9.* (only an sdist on PyPI: built here, pure Python); datasets needs dill and multiprocess;
# math-verify (eval's answers) needs latex2sympy2_extended (and sympy, torch's own dependency).
# Not lm-eval: the benchmark stage runs in neither the bench nor the GPU tests.
PINS=(megatron-core==0.16.1 omegaconf==2.3.1 hydra-core==1.3.8 submitit==1.5.4 trl==1.16.0 datasets==5.2.0 dill==0.4.1
      multiprocess==0.70.19 math-verify==0.9.0 latex2sympy2_extended==1.11.0)
SDISTS=(antlr4-python3-runtime==4.9.3)
# pyproject's Prefect pin; its server breaks on fastapi >= 0.151 (constraints.txt says why).
PREFECT=(prefect==3.8.8 "fastapi<0.151")
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do PLATFORMS+=(--platform "${tag}_x86_64"); done

fetch() {
  rm -rf .whl && mkdir .whl
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl "${PINS[@]}"
  "$PYTHON" -m pip wheel -q --no-deps --no-binary=:all: -w .whl "${SDISTS[@]}"
  local bytes
  bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
  ls -1 .whl
  echo "$(ls .whl/*.whl | wc -l) wheels, $(awk "BEGIN {printf \"%.2f\", $bytes / 1048576}") MiB (limit $LIMIT_MIB MiB)"
  if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "over $LIMIT_MIB MiB: the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
  fi
}

fetch_prefect() {
  rm -rf .whl/prefect
  "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl/prefect "${PREFECT[@]}"
  du -sh .whl/prefect
}

install() {
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  # Tests that start subprocesses set PYTHONPATH to the repository alone: a .pth file in the
  # interpreter's site-packages puts $SITE on every python3's path.
  echo "$SITE" > "$("$PYTHON" -c 'import site; print(site.getsitepackages()[0])')/alignflow-gpu-wheels.pth"
  SITE=$SITE "$PYTHON" - <<'PY'
import importlib.metadata as md
import os
from packaging.requirements import Requirement

have = {}
for dist in md.distributions():  # path order: the first one found is the one imported
    have.setdefault(dist.metadata["Name"].lower().replace("_", "-"), dist.version)
problems = 0
for dist in md.distributions(path=[os.environ["SITE"]]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        found = have.get(req.name.lower().replace("_", "-"))
        if found is None or not req.specifier.contains(found, prereleases=True):
            problems += 1
            print(f"{'MISSING' if found is None else 'CONFLICT'}: {dist.metadata['Name']} {dist.version} needs {text}; here: {found}")
print(f"installed in {os.environ['SITE']}: {', '.join(sorted(d.metadata['Name'] for d in md.distributions(path=[os.environ['SITE']])))}; "
      f"{problems} unmet requirement(s)")
PY
  if [ -d .whl/prefect ]; then  # into the machine's environment, so pip keeps what the image has
    "$PYTHON" -m pip install -q --no-index --find-links .whl/prefect "${PREFECT[@]}"
    "$PYTHON" -c 'import fastapi, prefect; print(f"prefect {prefect.__version__}, fastapi {fastapi.__version__}")'
  fi
}

case "${1:-fetch}" in
  fetch) fetch ;;
  prefect) fetch_prefect ;;
  install) install ;;
  *) echo "usage: $0 [fetch|prefect|install]" >&2; exit 2 ;;
esac
