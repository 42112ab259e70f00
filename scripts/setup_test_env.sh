#!/usr/bin/env bash
# Everything the tests need, on a fresh machine: this package with its test extra, and the lean
# set of SGLang's own clients (frontend DSL, bench_serving) in `.venv-sglang`, a venv of their
# own that shares this environment's torch/transformers (tests/e2e/conftest.py finds it).
# sglang's full install is ~10 GB of CUDA wheels; its clients need only this set. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q -e ".[test]"

if [ ! -x .venv-sglang/bin/python ] || ! .venv-sglang/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"; then
  python -m venv --system-site-packages .venv-sglang
  constraints=$(mktemp)
  printf 'torch==2.13.0\ntransformers==5.23.0\n' > "$constraints"
  .venv-sglang/bin/pip install -q --no-deps sglang==0.5.23 triton==3.3.1 torchvision==0.16.2
  .venv-sglang/bin/pip install -q -c "$constraints" aiohttp==3.14.5 apache-tvm-ffi==0.1.11 \
    compressed-tensors==0.20.1 datasets==5.2.0 gguf==0.19.0 msgspec==0.23.0 pillow==13.0.0 \
    psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 sentencepiece==0.2.3
  rm -f "$constraints"
fi
