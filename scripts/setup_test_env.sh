#!/usr/bin/env bash
# Everything the tests need, on a fresh machine: this package with its test and pd extras, the lean
# set of SGLang's own clients (frontend DSL, bench_serving) in `.venv-sglang`, a venv of their
# own that sees the packages of the environment running this script, a virtualenv or not (a
# .pth file lists its site-packages; `--system-site-packages` would share the base
# interpreter's instead), so torch/transformers/starlette are installed once.
# tests/e2e/conftest.py finds it. sglang's full install is ~10 GB of CUDA wheels; its clients
# need only this set. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Mooncake's transfer engine (the pd extra: prefill-decode disaggregation) loads libibverbs and
# librdmacm even over TCP; CI runs as root on a fresh Debian machine.
if ! ldconfig -p | grep -q librdmacm.so.1 || ! ldconfig -p | grep -q libibverbs.so.1; then
  apt-get update -q && apt-get install -y -q libibverbs1 librdmacm1
fi
python -m pip install -q -e ".[test,pd]"

[ -x .venv-sglang/bin/python ] || python -m venv .venv-sglang
# Re-pointed on every run (the environment running the tests may have changed), and before
# the installs below, so that pip sees torch and transformers as installed.
python - <<'PY'
import pathlib, site, subprocess, sysconfig
paths = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")] + site.getsitepackages()
target = subprocess.check_output(
    [".venv-sglang/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    text=True,
).strip()
pathlib.Path(target, "_srt_ascend_parent_env.pth").write_text("\n".join(dict.fromkeys(paths)) + "\n")
PY
if ! .venv-sglang/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"; then
  constraints=$(mktemp)
  printf 'torch==2.13.0\ntransformers==5.23.0\n' > "$constraints"
  .venv-sglang/bin/pip install -q --no-deps sglang==0.5.23 triton==3.3.1 torchvision==0.16.2
  .venv-sglang/bin/pip install -q -c "$constraints" aiohttp==3.14.5 apache-tvm-ffi==0.1.11 \
    compressed-tensors==0.20.1 datasets==5.2.0 gguf==0.19.0 msgspec==0.23.0 pillow==13.0.0 \
    ipython==8.12.3 psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 sentencepiece==0.2.3
  rm -f "$constraints"
fi
.venv-sglang/bin/python -c "import sglang, starlette, torch, transformers"
