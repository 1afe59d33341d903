#!/usr/bin/env bash
# The checks that need a GPU, in one run for a lent H100/H200 (the `device` tool copies the working tree there):
# the gpu-marked tests that the image's packages allow (Triton quantizer bit-exact against the reference, CUDA IPC
# staging buffers between processes, the bridge into a CUDA arena when megatron-core travels as a wheel) and the
# quantizer-against-copy benchmark of the bridge issue's GPU target. Everything it prints also lands in OUT_DIR.
#
#   bash tools/device_checks.sh [OUT_DIR]        # OUT_DIR defaults to $OUT (the device tool's), else /tmp/device-checks
#
# The image has torch, triton, transformers, pytest and hypothesis but not megatron-core: carry it as a wheel in
# .whl/ (python 3.12, see the device tool's notes); without it the bridge test is skipped, the rest still run.
set -uo pipefail
out=${1:-${OUT:-/tmp/device-checks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
tests=(tests/kernels/test_fp8_blockwise.py tests/bridge/test_cuda_arena.py)
if python3 -c "import megatron.core" 2>/dev/null; then
    tests+=(tests/bridge/test_bridge_sync.py)
fi
python3 -m pytest -q -m gpu -rs "${tests[@]}" 2>&1 | tee "$out/gpu_tests.log"
status=${PIPESTATUS[0]}
python3 tools/bench_fp8_quant.py 2>&1 | tee "$out/bench_fp8_quant.txt"
exit "$status"
