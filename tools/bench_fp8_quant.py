"""Blockwise FP8 quantizer bandwidth against a plain copy on the same device, in one process: the Triton kernel on
CUDA (the bridge's GPU path), the C kernel on CPU (one thread, as each bridge rank runs).

    .venv/bin/python tools/bench_fp8_quant.py [--rows 8192 --cols 8192 --repeats 20]

Bandwidth counts compulsory bytes: the quantizer reads the bf16 weight once and writes one byte per element plus the
scales (the NaN/Inf check rides on the kernel's own pass); the copy reads and writes two bytes per element. On CUDA
the table has the kernel alone into preallocated outputs at several warp counts (the default is
`TRITON_NUM_WARPS`) and the whole `blockwise_fp8_quantize` call (allocation, launch, the scale check's host sync).
Last line: `fp8_quant_over_copy=<kernel at the default warps ÷ copy> fp8_quant_gbps=<x> copy_gbps=<y>
api_over_copy=<the whole call ÷ copy>` (target on GPU: fp8_quant_over_copy >= 0.8).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# on CUDA each timing covers this many back-to-back calls: a lone launch of a ~100 us kernel also times Python's
# launch latency (tens of us), which the GPU spends idle
LAUNCHES_PER_TIMING = 10


def _seconds(work, repeats: int, cuda: bool) -> float:
    """Median seconds of `work()` after one warm-up call (CUDA events on GPU, per call of a batch of calls)."""
    work()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(LAUNCHES_PER_TIMING):
                work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000 / LAUNCHES_PER_TIMING)
        else:
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    from kernels.fp8.dispatch import blockwise_fp8_quantize
    from kernels.fp8.format import scale_shape
    from kernels.fp8.triton import TRITON_NUM_WARPS, blockwise_fp8_quantize_triton_into, fp8_kernels_available

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "CPU, 1 thread"
    if cuda and not fp8_kernels_available(torch.device("cuda")):
        print(f"error: {name}: Triton compiles no e4m3 for this GPU (sm_89 or later: Ada, Hopper); nothing to measure",
              file=sys.stderr)
        return 1
    w = torch.randn(args.rows, args.cols, device=device).to(torch.bfloat16)
    copy_dst = torch.empty_like(w)
    numel = w.numel()
    copy_s = _seconds(lambda: copy_dst.copy_(w), args.repeats, cuda)
    blocks = scale_shape(tuple(w.shape))
    # compulsory traffic only: the bf16 input read once, the e4m3 codes and the fp32 scales written
    copy_bytes = 2 * numel * 2
    quant_bytes = numel * 2 + numel + blocks[0] * blocks[1] * 4
    q, s = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=device), torch.empty(blocks, device=device)
    rows = []  # (label, seconds)
    if cuda:
        for warps in sorted({4, 8, 16, TRITON_NUM_WARPS}):
            seconds = _seconds(lambda: blockwise_fp8_quantize_triton_into(w, q, s, num_warps=warps), args.repeats,
                               cuda)
            rows.append((f"Triton kernel, {warps} warps, into preallocated outputs", seconds))
            if warps == TRITON_NUM_WARPS:
                kernel_s = seconds
        api_s = _seconds(lambda: blockwise_fp8_quantize(w), args.repeats, cuda)
        rows.append(("blockwise_fp8_quantize (allocation, kernel, scale check)", api_s))
    else:  # as the bridge does on CPU: straight into preallocated outputs (the arena), NaN/Inf check included
        from kernels.fp8.cpu import fp8_quantize_into

        kernel_s = api_s = _seconds(lambda: fp8_quantize_into(w, q, s), args.repeats, cuda)
        rows.append(("C kernel into preallocated outputs, with the NaN/Inf check", kernel_s))
    copy_gbps = copy_bytes / copy_s / 1e9
    print(f"| {name}, {args.rows}x{args.cols} bf16 | seconds (median of {args.repeats}) | GB/s (compulsory bytes) |")
    print("|---|---|---|")
    print(f"| plain copy | {copy_s:.6f} | {copy_gbps:.1f} |")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.6f} | {quant_bytes / seconds / 1e9:.1f} |")
    quant_gbps, api_gbps = quant_bytes / kernel_s / 1e9, quant_bytes / api_s / 1e9
    print(f"fp8_quant_over_copy={quant_gbps / copy_gbps:.3f} fp8_quant_gbps={quant_gbps:.1f} copy_gbps={copy_gbps:.1f} "
          f"api_over_copy={api_gbps / copy_gbps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
