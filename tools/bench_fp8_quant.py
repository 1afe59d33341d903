"""Blockwise FP8 quantizer bandwidth against a plain copy on the same device, in one process: the Triton kernel on
CUDA (the bridge's GPU path), the C kernel on CPU (one thread, as each bridge rank runs).

    .venv/bin/python tools/bench_fp8_quant.py [--rows 8192 --cols 8192 --repeats 20]

Bandwidth counts bytes read plus bytes written: the quantizer reads the bf16 weight twice (the NaN/Inf check, then
the kernel) and writes one byte per element plus the scales; the copy reads and writes two bytes per element. Prints
a table and, as its last line, `fp8_quant_over_copy=<ratio> fp8_quant_gbps=<x> copy_gbps=<y>` (target on GPU: ratio
>= 0.8).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _seconds(work, repeats: int, cuda: bool) -> float:
    """Median seconds of `work()` after one warm-up call (CUDA events on GPU)."""
    work()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
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
    from kernels.fp8_blockwise import blockwise_fp8_quantize, scale_shape

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "CPU, 1 thread"
    w = torch.randn(args.rows, args.cols, device=device).to(torch.bfloat16)
    copy_dst = torch.empty_like(w)
    numel = w.numel()
    copy_s = _seconds(lambda: copy_dst.copy_(w), args.repeats, cuda)
    blocks = scale_shape(tuple(w.shape))
    if cuda:
        quant_s = _seconds(lambda: blockwise_fp8_quantize(w), args.repeats, cuda)
    else:  # as the bridge does on CPU: straight into preallocated outputs (the arena)
        from kernels.cpu_bridge import fp8_quantize_into

        q, s = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(blocks)
        quant_s = _seconds(lambda: fp8_quantize_into(w, q, s), args.repeats, cuda)
    # compulsory traffic only: the bf16 input read once (a kernel that reads a block twice for its amax and its codes
    # pays for that in time, not in credited bytes), the e4m3 codes and the fp32 scales written
    copy_bytes = 2 * numel * 2
    quant_bytes = numel * 2 + numel + blocks[0] * blocks[1] * 4
    copy_gbps, quant_gbps = copy_bytes / copy_s / 1e9, quant_bytes / quant_s / 1e9
    kernel = "Triton" if cuda else "C"
    print(f"| {name}, {args.rows}x{args.cols} bf16 | seconds (median of {args.repeats}) | GB/s (read + written) |")
    print("|---|---|---|")
    print(f"| plain copy | {copy_s:.6f} | {copy_gbps:.1f} |")
    print(f"| blockwise FP8 quantize ({kernel}, with the NaN/Inf check) | {quant_s:.6f} | {quant_gbps:.1f} |")
    print(f"fp8_quant_over_copy={quant_gbps / copy_gbps:.3f} fp8_quant_gbps={quant_gbps:.1f} copy_gbps={copy_gbps:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
