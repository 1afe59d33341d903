#!/usr/bin/env bash
# The checks that need a GPU, in one run for a lent H100/H200 (the `device` tool copies the working tree there):
# the gpu-marked tests that the image's packages allow (Triton quantizer and one-pass bucket kernel bit-exact against
# their references, CUDA IPC staging buffers between processes; with megatron-core: a GRPO + AIS step with the
# trainer on the GPU, megatron's MoE logits on the GPU against transformers, the bridge into a CUDA arena), the
# quantizer-against-copy benchmark of the bridge issue's GPU target, the one-pass bucket kernel alone against a copy,
# and the bridge benchmark at TP1 on the GPU, at 88M parameters and at the Qwen3-4B shape.
# Everything it prints also lands in OUT_DIR; each step has a time limit so that one hang cannot eat the lease.
#
#   bash tools/device_checks.sh [OUT_DIR]        # OUT_DIR defaults to $OUT (the device tool's), else /tmp/device-checks
#
# The image has torch, triton, transformers, pytest and hypothesis but not megatron-core: carry it as a wheel in
# .whl/ (python 3.12, see the device tool's notes); without it the megatron steps are skipped, the rest still run.
# DEVICE_CHECKS_BRIDGE=0 skips the bridge test and benchmark.
set -uo pipefail
out=${1:-${OUT:-/tmp/device-checks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/gpu.txt"
status=0
run_tests() {  # run_tests SECONDS PYTEST_ARGS...: appends to the log, remembers a failure
    timeout "$1" python3 -m pytest -q -rs --tb=short "${@:2}" 2>&1 | tee -a "$out/gpu_tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
run_tests 150 -m gpu tests/kernels/test_fp8_blockwise.py tests/kernels/test_bucket_pass.py tests/bridge/test_cuda_arena.py
megatron=0
python3 -c "import megatron.core" 2>/dev/null && megatron=1
bridge=$megatron
[ "${DEVICE_CHECKS_BRIDGE:-1}" = 1 ] || bridge=0
if [ "$megatron" = 1 ]; then
    run_tests 240 -m gpu tests/grpo/test_grpo_step.py tests/model/test_moe_parity.py
fi
if [ "$bridge" = 1 ]; then
    run_tests 150 -m gpu tests/bridge/test_bridge_sync.py
fi
{ timeout 60 python3 tools/bench_fp8_quant.py --repeats 50
  timeout 60 python3 tools/bench_fp8_quant.py --rows 4096 --cols 14336 --repeats 50
} 2>&1 | tee "$out/bench_fp8_quant.txt"
# the one-pass bucket kernel alone at two Qwen3-4B layers, default tiles and warps (`--sweep` tunes them: ~2 min)
timeout 90 python3 tools/bench_bucket_pass.py 2>&1 | tee "$out/bench_bucket_pass.txt"
if [ "$bridge" = 1 ]; then
    timeout 150 python3 tools/bench_bridge.py --tensor-model-parallel-size 1 --repeats 5 2>&1 | tee "$out/bench_bridge.txt"
    # issue 31's target shape (Qwen3-4B: BF16 sync <= 0.05 s, FP8 <= 1.1x BF16)
    timeout 240 python3 tools/bench_bridge.py --tensor-model-parallel-size 1 --hidden-size 2560 --num-layers 36 \
        --intermediate-size 9728 --vocab-size 151936 --repeats 3 2>&1 | tee "$out/bench_bridge_4b.txt"
fi
exit "$status"
