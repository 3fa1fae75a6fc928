#!/usr/bin/env bash
# The main job: the side-by-side demo on the embedded model pair (creates or reuses .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m specfit_hf.demo "$@"
