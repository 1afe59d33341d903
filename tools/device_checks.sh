#!/usr/bin/env bash
# The checks that need a GPU, in one run for a lent H100/H200 (the `device` tool copies the working tree there), in
# three parts, the ones no GPU has run yet first:
#   cluster  what one GPU can tell about the first cluster run (issue 49; `tools/gpu_checks.py`): the GPU memory a
#            second process pays to map the CUDA-IPC arena and whether 50 more opens leak; the Triton quantizer and
#            the one-pass bucket kernel at production shapes (12288x4096, 4096x12288, MoE experts 768x2048) bit for
#            bit against the CPU reference; a Qwen3-8B-width model of 2 and 4 layers: the FP8 bridge into a
#            double-buffered arena on the GPU (peak memory, sync and verification time per GB) and rank 0's
#            activation peak in a GRPO step at sequence 4096 and 8192-token micro-batches (with megatron-core);
#   tests    the gpu-marked tests that the image's packages allow (Triton quantizer and one-pass bucket kernel
#            bit-exact against their references, CUDA IPC staging buffers between processes; with megatron-core: a
#            GRPO + AIS step with the trainer on the GPU, megatron's MoE logits on the GPU against transformers, the
#            bridge into a CUDA arena);
#   benches  the quantizer against a copy, the one-pass bucket kernel alone, and the bridge benchmark at TP1 at 88M
#            parameters and at the Qwen3-4B shape.
# Every figure is printed on one line and lands in OUT_DIR; each step has a time limit so that one hang cannot eat
# the lease: the cluster part stops within 8 minutes, the tests within 7, the benchmarks within 7½. The device tool
# allows 10 minutes a call and 15 a session, machine start included: run `DEVICE_CHECKS_PARTS=cluster` first, then
# the rest in what is left. Nothing is written outside OUT_DIR: temporary files, Triton's and torch's caches and
# the carried wheel go to OUT_DIR/.tmp, removed at exit.
#
#   bash tools/device_checks.sh [OUT_DIR]        # OUT_DIR defaults to $OUT (the device tool's), else /tmp/device-checks
#
# The image has torch, triton, transformers, pytest and hypothesis but not megatron-core: carry it as a wheel in
# .whl/ (python 3.12, see the device tool's notes); without it the megatron steps are skipped, the rest still run.
# DEVICE_CHECKS_PARTS="cluster tests benches" (the default) chooses parts; DEVICE_CHECKS_BRIDGE=0 skips the bridge
# test and benchmark.
set -uo pipefail
out=${1:-${OUT:-/tmp/device-checks}}
parts=" ${DEVICE_CHECKS_PARTS:-cluster tests benches} "
scratch=$out/.tmp
mkdir -p "$scratch"
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TMPDIR=$scratch \
    TRITON_CACHE_DIR=$scratch/triton TORCHINDUCTOR_CACHE_DIR=$scratch/inductor
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" \
        .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$scratch/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/gpu.txt"
status=0
run_tests() {  # run_tests SECONDS PYTEST_ARGS...: appends to the log, remembers a failure
    timeout "$1" python3 -m pytest -q -rs --tb=short -p no:cacheprovider "${@:2}" 2>&1 | tee -a "$out/gpu_tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
run_check() {  # run_check SECONDS LOG ARGS...: one tools/gpu_checks.py check, its figures appended to LOG
    timeout "$1" python3 tools/gpu_checks.py "${@:3}" 2>&1 | tee -a "$out/$2"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
megatron=0
python3 -c "import megatron.core" 2>/dev/null && megatron=1
bridge=$megatron
[ "${DEVICE_CHECKS_BRIDGE:-1}" = 1 ] || bridge=0
if [[ $parts == *" cluster "* ]]; then
    run_check 60 cluster_checks.txt ipc --arena-gib 1 --opens 50
    run_check 120 cluster_checks.txt kernels
    if [ "$megatron" = 1 ]; then
        run_check 300 cluster_checks.txt model --num-layers 2 4 --seq-length 4096 --tokens-per-microbatch 8192
    fi
fi
if [[ $parts == *" tests "* ]]; then
    run_tests 120 -m gpu tests/kernels/test_fp8_blockwise.py tests/kernels/test_bucket_pass.py \
        tests/bridge/test_cuda_arena.py
    [ "$megatron" = 1 ] && run_tests 180 -m gpu tests/grpo/test_grpo_step.py tests/model/test_moe_parity.py
    [ "$bridge" = 1 ] && run_tests 120 -m gpu tests/bridge/test_bridge_sync.py
fi
if [[ $parts == *" benches "* ]]; then
    { timeout 45 python3 tools/bench_fp8_quant.py --repeats 50
      timeout 45 python3 tools/bench_fp8_quant.py --rows 4096 --cols 14336 --repeats 50
    } 2>&1 | tee "$out/bench_fp8_quant.txt"
    # the one-pass bucket kernel alone at two Qwen3-4B layers, default tiles and warps (`--sweep` tunes them: ~2 min)
    timeout 60 python3 tools/bench_bucket_pass.py 2>&1 | tee "$out/bench_bucket_pass.txt"
    if [ "$bridge" = 1 ]; then
        timeout 120 python3 tools/bench_bridge.py --tensor-model-parallel-size 1 --repeats 5 2>&1 \
            | tee "$out/bench_bridge.txt"
        # issue 31's target shape (Qwen3-4B: BF16 sync <= 0.05 s, FP8 <= 1.1x BF16)
        timeout 180 python3 tools/bench_bridge.py --tensor-model-parallel-size 1 --hidden-size 2560 --num-layers 36 \
            --intermediate-size 9728 --vocab-size 151936 --repeats 3 2>&1 | tee "$out/bench_bridge_4b.txt"
    fi
fi
exit "$status"
