#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install specfit_hf
# with its test and evaluation extras.  Re-running is cheap: a stamp file records
# which version of the package metadata was installed.
#
# torch: on a machine without an NVIDIA driver we pin the CPU build's version
# (torch==2.13.0, served from local disk on the project's CPU machines) because an
# unpinned `torch` resolves to a multi-GB CUDA build.  With a driver present, pip's
# normal resolution (a CUDA build) is kept.  Override with SPECFIT_TORCH="torch==X".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=".venv/.specfit-$(cat setup.cfg pyproject.toml scripts/bootstrap.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if [ -n "${SPECFIT_TORCH:-}" ]; then
    torch_req="$SPECFIT_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_req="torch>=2.4"
  else
    torch_req="torch==2.13.0"
  fi
  echo "bootstrap: installing $torch_req" >&2
  "$VPY" -m pip install -q "$torch_req" 2>&1 | grep -v "is ignored" || true
fi
echo "bootstrap: installing specfit_hf[dev] into .venv" >&2
"$VPY" -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
"$VPY" -c "import specfit_hf, torch, transformers" 
rm -f .venv/.specfit-*
touch "$stamp"
