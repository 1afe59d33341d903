"""Bridge sync speed at TP2 (gloo, CPU): BF16 and FP8 syncs of a ~100M-parameter model into an in-process
receiver, against a plain copy of the same bytes measured in the same processes. On a CUDA machine the model, the
staging arena, the quantizer (Triton) and the baseline copy are on the GPU, one GPU per rank
(`--tensor-model-parallel-size 1` on a one-GPU machine).

    .venv/bin/python tools/bench_bridge.py [--hidden-size 768 --num-layers 10 --vocab-size 16384] [--repeats 5]

Prints a table and, as its last line,
`bridge_sync_ratio=<x> fp8_quant_gbps=<x> bf16_sync_s=<y> fp8_sync_s=<z>` (ratio = BF16 sync seconds ÷ seconds of
a plain copy of the same bytes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _wall(cuda: bool) -> float:
    """perf_counter after the GPU's queued work is done (CUDA), so that wall times cover device work."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def _bench_worker(hf_dir: str, repeats: int, bucket_mb: float, transport: str, parallel: list[str]) -> dict:
    import torch.distributed as dist

    from kernels.cpu_library import library
    from kernels.fp8.cpu import fp8_blockwise_quantize_cpu
    from kernels.fp8.reference import blockwise_fp8_quantize_reference
    from kernels.fp8.triton import blockwise_fp8_quantize_triton
    from megatron_ais.arguments import TrainerConfig, build_parser
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.platform import device, is_cuda
    from megatron_ais.training import initialize_trainer, load_policy_chunks

    args = build_parser("bench").parse_args(["--hf-dir", hf_dir, "--bf16", "--seq-length", "64", *parallel])
    trainer = TrainerConfig.from_args(args, int(os.environ["WORLD_SIZE"]))
    _, build = initialize_trainer(trainer)
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    layout = BridgeLayout.from_parallel_state()
    cuda = is_cuda()
    result = {}
    for precision in ("bf16", "fp8"):
        config = BridgeConfig(bucket_size_mb=bucket_mb, policy=QuantizationPolicy(precision=precision),
                              transport=transport)
        receiver = SyncReceiver(apply=lambda tensors: None) if layout.rank == 0 else None
        bridge = WeightBridge(chunks, build, config, layout, receiver)
        times, moved = [], 0
        for sync_id in range(repeats + 1):  # the first sync maps the shared buffers
            dist.barrier()
            t0 = _wall(cuda)
            stats = bridge.sync(sync_id)
            dist.barrier()
            if sync_id:
                times.append(_wall(cuda) - t0)
            moved = stats.bytes or moved
        result[precision] = {"seconds": statistics.median(times), "bytes": moved}
        bridge.close()
        if receiver is not None:
            receiver.close()
    # baseline: a plain copy of the BF16 sync's bytes, in buffers the size of one bucket
    total = result["bf16"]["bytes"] if layout.rank == 0 else 0
    src = torch.empty(int(bucket_mb * (1 << 20)), dtype=torch.uint8, device=device()).random_()
    dst = torch.empty_like(src)
    copies = []
    for _ in range(repeats):
        t0 = _wall(cuda)
        left = total
        while left > 0:
            n = min(left, src.numel())
            dst[:n].copy_(src[:n])
            left -= n
        copies.append(_wall(cuda) - t0)
    result["copy_seconds"] = statistics.median(copies)
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device())
    quantizers = {"torch reference": blockwise_fp8_quantize_reference}
    if cuda:
        quantizers["Triton"] = blockwise_fp8_quantize_triton
    elif library() is not None:
        quantizers["C kernel"] = fp8_blockwise_quantize_cpu
    result["quant_gbps"] = {}
    for name, quantize in quantizers.items():
        quantize(weight)  # warm-up: Triton compiles on the first call
        quant = []
        for _ in range(repeats):
            t0 = _wall(cuda)
            quantize(weight)
            quant.append(_wall(cuda) - t0)
        result["quant_gbps"][name] = weight.numel() * weight.element_size() / statistics.median(quant) / 1e9
    result["device"] = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} thread/rank"
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("qwen3", "qwen3_moe"), default="qwen3",
                        help="qwen3: dense, TP2. qwen3_moe: experts spread by EP2 (TP1), each rank writing its own.")
    parser.add_argument("--num-experts", type=int, default=16, help="qwen3_moe: experts per layer.")
    parser.add_argument("--moe-intermediate-size", type=int, default=256, help="qwen3_moe: each expert's FFN size.")
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=10)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--bucket-size-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=15,
                        help="Measured syncs per precision (the median is reported).")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2,
                        help="qwen3: TP size = number of ranks (on CUDA one GPU per rank).")
    parser.add_argument("--transport", choices=("auto", "shm", "distributed"), default="auto",
                        help="--bridge-transport of the measured syncs (auto = shm on one machine)")
    args = parser.parse_args(argv)
    import make_tiny_model
    from megatron_ais.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        moe = ["--num-experts", str(args.num_experts), "--moe-intermediate-size", str(args.moe_intermediate_size)]
        hf_dir = make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args([
            "--arch", args.arch, "--out", os.path.join(tmp, "model"), "--hidden-size", str(args.hidden_size),
            "--num-layers", str(args.num_layers), "--intermediate-size", str(args.intermediate_size),
            "--vocab-size", str(args.vocab_size), "--num-attention-heads", "6", "--num-key-value-heads", "2",
            "--head-dim", "128", *(moe if args.arch == "qwen3_moe" else [])]))
        tp = args.tensor_model_parallel_size
        parallel = (["--expert-model-parallel-size", "2"] if args.arch == "qwen3_moe" else
                    ["--tensor-model-parallel-size", str(tp)])
        world = 2 if args.arch == "qwen3_moe" else tp
        results = spawn(world, _bench_worker, hf_dir, args.repeats, args.bucket_size_mb, args.transport, parallel)
    r = results[0]
    bf16, fp8 = r["bf16"], r["fp8"]
    layout = "EP2 (MoE)" if args.arch == "qwen3_moe" else f"TP{tp}"
    # a BF16 sync moves every parameter once, in 2 bytes
    print(f"| {layout}, {args.transport}, {r['device']}, {bf16['bytes'] / 2e6:.0f}M params | "
          "bytes moved | seconds "
          "(median) | GB/s |")
    print("|---|---|---|---|")
    for name, row in (("BF16 sync", bf16), ("FP8 sync", fp8)):
        print(f"| {name} | {row['bytes'] / 1e6:.1f} MB | {row['seconds']:.3f} | {row['bytes'] / row['seconds'] / 1e9:.3f} |")
    print(f"| plain copy of the BF16 bytes | {bf16['bytes'] / 1e6:.1f} MB | {r['copy_seconds']:.4f} | "
          f"{bf16['bytes'] / r['copy_seconds'] / 1e9:.3f} |")
    for name, gbps in r["quant_gbps"].items():
        print(f"| FP8 quantize (4096x4096 bf16, {name}) | | | {gbps:.3f} |")
    quant = max(r["quant_gbps"].values())
    print(f"bridge_sync_ratio={bf16['seconds'] / r['copy_seconds']:.2f} fp8_quant_gbps={quant:.3f} "
          f"bf16_sync_s={bf16['seconds']:.3f} fp8_sync_s={fp8['seconds']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
