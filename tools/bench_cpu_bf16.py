"""BF16 matrix products on this CPU: torch's own BF16 kernels against the FP32 path (`platform.install_bf16_matmul`:
FP32 products rounded to BF16 once), in one process, one thread (as each trainer rank runs).

    .venv/bin/python tools/bench_cpu_bf16.py [--rows 512 --cols 1024 --repeats 5]

Rows: a product [rows, cols] @ [cols, cols] and a linear layer's forward + backward on [rows, cols] inputs, each
timed both ways (median seconds, GFLOP/s). Last line: `bf16_fp32_path_speedup=<native ÷ fp32 path, linear
forward + backward> native_gflops=<x> fp32_path_gflops=<y> cpu=<torch's capability> native_bf16=<AVX512-BF16 or AMX>`.
On a CPU with BF16 hardware the native kernels are the fast ones (the auto choice keeps them); without it, the FP32
path is what `make run` uses.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ais import platform  # noqa: E402


def _seconds(work, repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timings(rows: int, cols: int, repeats: int) -> tuple[float, float]:
    """(product seconds, linear forward + backward seconds) with whatever BF16 path is installed."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, cols, generator=g).bfloat16(), torch.randn(cols, cols, generator=g).bfloat16()
    weight = torch.randn(cols, cols, generator=g).bfloat16().requires_grad_()
    inputs = torch.randn(rows, cols, generator=g).bfloat16().requires_grad_()

    def linear():
        torch.nn.functional.linear(inputs, weight).sum().backward()

    return _seconds(lambda: a @ b, repeats), _seconds(linear, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    flops = 2 * args.rows * args.cols * args.cols
    results = {}
    for path in ("native", "fp32"):
        os.environ[platform.CPU_BF16_ENV] = path
        platform.install_bf16_matmul()
        results[path] = _timings(args.rows, args.cols, args.repeats)
        platform.uninstall_bf16_matmul()
    print(f"{'path':8s} {'product s':>10s} {'GFLOP/s':>8s} {'linear fwd+bwd s':>17s} {'GFLOP/s':>8s}")
    for path, (product, linear) in results.items():
        print(f"{path:8s} {product:10.4f} {flops / product / 1e9:8.2f} {linear:17.4f} {3 * flops / linear / 1e9:8.2f}")
    native, fp32 = results["native"][1], results["fp32"][1]
    print(f"bf16_fp32_path_speedup={native / fp32:.2f} native_gflops={3 * flops / native / 1e9:.2f} "
          f"fp32_path_gflops={3 * flops / fp32 / 1e9:.2f} cpu={torch.backends.cpu.get_cpu_capability()} "
          f"native_bf16={platform.cpu_has_native_bf16()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
