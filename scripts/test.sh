#!/usr/bin/env bash
# Lint (ruff, configured in pyproject.toml), then run the test suite (creates or reuses .venv
# first).  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest "$@"
