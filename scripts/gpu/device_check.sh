#!/usr/bin/env bash
# One lease on a GPU machine (the device tool): the CUDA tests, then the benchmark. Run from the
# repository root with .gpu/ carried (wheels the image lacks and SmolLM2's tokenizer: see
# scripts/gpu/README.md). Logs go to $OUT (or ./gpu-out).
# Usage: bash scripts/gpu/device_check.sh [tests|bench|all] [pytest -k expression]
set -uo pipefail
what="${1:-all}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PAGEDSERVE_TOKENIZER_DIR="$PWD/.gpu/tok"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/whl/gguf-*.whl .gpu/whl/llguidance-*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" != bench ]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs --durations=15 \
        --tb=short ${PYTEST_ARGS:-} ${2:+-k "$2"} tests/kernels/test_triton_ops.py \
        tests/attention/test_triton_attention.py tests/worker/ 2>&1 | tee "$out/tests.log"
fi
if [ "$what" != tests ]; then
    SHAPES="${SHAPES:-1.7b}" timeout "${BENCH_TIMEOUT:-330}" \
        python3 scripts/gpu/bench_cuda.py .gpu/tok /tmp/bench-models 2>&1 | tee "$out/bench.log"
fi
