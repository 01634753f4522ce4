#!/usr/bin/env bash
# Set up .venv (with the test dependencies) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
exec .venv/bin/python -m pytest -q "$@"
