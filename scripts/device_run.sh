#!/usr/bin/env bash
# The prepared GPU run (issue 43, item 6): one command on a bare CUDA image that has python3
# with torch and triton but no network.
#
#   scripts/device_run.sh prepare   # here, with network: wheels/ holds what the image lacks
#   scripts/device_run.sh [run] [ARGS]  # there: installs wheels/ offline, runs the device
#                                       # check (ARGS go to benchmark/device_check.py)
#
# `prepare` takes this environment's resolved dependency closure of the package (the versions
# the tests ran with), less what the image brings (torch, triton, numpy, CUDA's own wheels),
# as wheels for CPython $DEVICE_PYTHON (3.12) on manylinux x86-64. The run installs them into
# /tmp/site (first on PYTHONPATH, before this tree), then runs benchmark/device_check.py under
# $DEVICE_TIMEOUT seconds (480: the 8 minutes the issue allows); its table ends the output and
# $OUT/device_check.json holds every figure (OUT defaults to runs/device). With the device
# tool: run(command="scripts/device_run.sh", carry=["wheels"]).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
WHEELS=${WHEELS:-wheels}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ${1:-} == prepare ]]; then
  mkdir -p "$WHEELS"
  # name==version for every distribution the package needs at run time, here
  "$PY" - > "$WHEELS/requirements.txt" <<'PY'
import re
import tomllib
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

IMAGE = re.compile(r"^(torch|triton|numpy|nvidia-.*|cuda-.*|setuptools|pip|wheel)$")
TARGET = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
todo = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
seen: dict[str, str] = {}
while todo:
    req = Requirement(todo.pop())
    name = req.name.lower().replace("_", "-")
    if name in seen or IMAGE.match(name) or (req.marker and not req.marker.evaluate(TARGET)):
        continue
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        continue  # optional on this platform
    seen[name] = dist.version
    todo += dist.requires or []
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PY
  platforms=()
  for n in 17 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "${DEVICE_PYTHON:-3.12}" "${platforms[@]}" --platform manylinux2014_x86_64 \
    -d "$WHEELS" -r "$WHEELS/requirements.txt"
  echo "$(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
  exit 0
fi

[[ ${1:-} == run ]] && shift  # the rest goes to device_check.py (e.g. --quick)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH="/tmp/site:$ROOT" PYTHONUNBUFFERED=1
export OUT=${OUT:-$ROOT/runs/device}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
set -o pipefail
timeout "${DEVICE_TIMEOUT:-480}" "$PY" benchmark/device_check.py "$@" 2>&1 \
  | tee "$OUT/device_check.log"
