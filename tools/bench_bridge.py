"""Bridge sync speed at TP2 (gloo, CPU): BF16, FP8 and 4-bit (NVFP4, MXFP4) syncs of a ~100M-parameter model into an
in-process receiver, against a plain copy of the same bytes measured in the same processes. On a CUDA machine the
model, the staging arena, the quantizer (Triton) and the baseline copy are on the GPU, one GPU per rank
(`--tensor-model-parallel-size 1` on a one-GPU machine).

    .venv/bin/python tools/bench_bridge.py [--hidden-size 768 --num-layers 10 --vocab-size 16384] [--repeats 5]

Prints a table and, as its last line,
`bridge_sync_ratio=<x> over_whole_copy=<x> fp8_quant_gbps=<x> bf16_sync_s=<y> fp8_sync_s=<z> ops_per_sync=<n>
host_syncs_per_sync=<n> nvfp4_over_fp8_bytes=<x> mxfp4_over_fp8_bytes=<x> nvfp4_sync_s=<y> mxfp4_sync_s=<z>`
(ratio = BF16 sync seconds ÷ seconds of a plain copy of the same bytes, bucket by bucket
through buffers the size of one bucket; over_whole_copy: ÷ one copy of them all, buffers the size of the sync; ops
and host synchronisations of one FP8 sync on the engine's rank along the path a GPU takes — torch ops where the
tensors live, here run on CPU tensors — counted with a TorchDispatchMode and a TorchFunctionMode, the receiver's
verifier threads included), with
`--delta`, `delta_bytes_fraction=<x> nvfp4_delta_bytes_fraction=<x> mxfp4_delta_bytes_fraction=<x>`: a delta
sync's bytes (`bridge.delta`: every tensor element-sparse) over a full sync's after one Megatron Adam step at lr 1e-6,
and with `--one-pass`, `one_pass_ops_per_sync=<n> one_pass_host_syncs_per_sync=<n>`: the same counts along the path
a GPU with Triton takes (`kernels.bucket_pass`, one launch per dtype group per bucket, here run by Triton's
interpreter on CPU tensors; a launch counts as one op).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

READ_BACKS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}
# where the bridge reads figures computed where the tensors live back to the host (on a GPU, a synchronisation);
# every other read-back is of a host tensor there too (the manifest's all-reduced sums, the writers' agreement)
DEVICE_READ_BACK_SITES = (os.path.join("kernels", "integrity.py"),)


class SyncCounts:
    """What one sync costs in torch: aten ops, host synchronisations a GPU would make (read-backs of figures
    computed where the tensors live, waits for the device's writes) and the bytes of the tensors those ops allocated
    (temporaries: neither views nor in-place results), over every thread that `counting` is entered on. A one-pass
    kernel launch counts as one op (what the interpreter does inside it is not counted: a GPU runs it as one)."""

    def __init__(self):
        self.ops, self.read_backs, self.new_bytes = 0, 0, 0
        self.inside_launch = threading.local()


class _CountOps(TorchDispatchMode):
    def __init__(self, counts: SyncCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(self.counts.inside_launch, "value", False):
            return out
        self.counts.ops += 1
        schema = func._schema
        if not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns):
            self.counts.new_bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class _CountReadBacks(TorchFunctionMode):
    def __init__(self, counts: SyncCounts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READ_BACKS and not getattr(self.counts.inside_launch, "value", False):
            caller = sys._getframe(1).f_code.co_filename
            self.counts.read_backs += caller.endswith(DEVICE_READ_BACK_SITES)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(counts: SyncCounts):
    with _CountReadBacks(counts), _CountOps(counts):
        yield


@contextlib.contextmanager
def one_pass_on_cpu(counts: SyncCounts):
    """Bridges built inside take the GPU's one-pass path (`kernels.bucket_pass`) on CPU tensors, under Triton's
    interpreter (TRITON_INTERPRET=1 before triton is imported); each launch counts as one op, and the writer's and
    the verifier's launches take turns (the interpreter's state is global)."""
    from kernels import bucket_pass
    from megatron_ais.bridge import buckets, pieces

    saved = pieces.supports_pass, buckets.supports_pass, bucket_pass._launch
    lock, launch = threading.Lock(), bucket_pass._launch

    def counted_launch(*args):
        with lock:
            counts.ops += 1
            counts.inside_launch.value = True
            try:
                return launch(*args)
            finally:
                counts.inside_launch.value = False

    pieces.supports_pass = buckets.supports_pass = lambda tensors, sums_only=False: bool(tensors)
    bucket_pass._launch = counted_launch
    try:
        yield
    finally:
        pieces.supports_pass, buckets.supports_pass, bucket_pass._launch = saved


@contextlib.contextmanager
def device_path(counts: SyncCounts):
    """Run the bridge's GPU path (torch ops where the tensors live, figures read back) on CPU tensors, counting into
    `counts`, the receiver's verifier thread included."""
    from kernels import integrity
    from megatron_ais.bridge import pieces, receiver, sync

    saved = integrity.summed_where_it_lives, pieces._on_host, receiver._start_checksums, sync.wait_for_device_writes
    start = receiver._start_checksums

    def counted_start(checks, passes, stream):
        with counting(counts):
            return start(checks, passes, stream)

    def counted_wait(buffer):  # on a GPU it waits for the device's queued writes
        counts.read_backs += buffer is not None

    integrity.summed_where_it_lives = lambda t: t.element_size() in (1, 2, 4, 8)
    pieces._on_host = lambda *tensors: False
    receiver._start_checksums = counted_start
    sync.wait_for_device_writes = counted_wait
    try:
        with counting(counts):
            yield
    finally:
        integrity.summed_where_it_lives, pieces._on_host, receiver._start_checksums, sync.wait_for_device_writes = saved


def _adam_step(setup, trainer) -> None:
    """One Megatron training step (Adam, fp32 main weights) on random tokens."""
    from megatron_ais.training import lm_forward_step, train_step

    seq = trainer.model.seq_length
    tokens = torch.randint(0, setup.build.shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).to(
        next(setup.chunks[0].parameters()).device)
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones_like(tokens),
             "position_ids": torch.arange(seq, device=tokens.device).unsqueeze(0)}
    train_step(setup.ddp_chunks, setup.optimizer, lm_forward_step, iter([batch]), 1, seq, 1)


def _delta_fractions(bridge, receiver, setup, trainer, sync_id: int) -> dict | None:
    """A delta sync's bytes after one Adam step (lr 1e-6) over a full sync's, and the fraction of the linear
    weights' code bytes that changed (on the engine's rank; None elsewhere)."""
    from megatron_ais.bridge import delta

    weights = bridge.sync(sync_id).committed
    plan = delta.DeltaPlan.of(weights.entries)
    base = delta.snapshot(receiver.arena.data, plan) if receiver is not None else None
    _adam_step(setup, trainer)
    bridge.sync(sync_id + 1)
    if receiver is None:
        return None
    header, payload = delta.encode(receiver.arena.data, plan, base)
    codes = [(e, n) for e, n in zip(plan.sparse, header.changed)
             if e.dtype in ("float8_e4m3fn", "uint8") and e.name.endswith((".weight", ".weight_packed"))]
    return {"bytes_fraction": payload.numel() / sum(e.nbytes for e in weights.entries),
            "codes_fraction": sum(e.nbytes if n == delta.FULL else n for e, n in codes)
            / sum(e.nbytes for e, _ in codes)}


def _wall(cuda: bool) -> float:
    """perf_counter after the GPU's queued work is done (CUDA), so that wall times cover device work."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def _median_seconds(work, repeats: int, cuda: bool) -> float:
    """Median wall seconds of `work()` over `repeats` calls (device work included)."""
    times = []
    for _ in range(repeats):
        t0 = _wall(cuda)
        work()
        times.append(_wall(cuda) - t0)
    return statistics.median(times)


def _one_pass_counts(chunks, build, config, layout, sync_id: int) -> dict:
    """The counts of one sync along the one-pass path (a bridge of its own, its first sync not counted: it builds
    the tables)."""
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge

    counts = SyncCounts()
    receiver = SyncReceiver() if layout.rank == 0 else None
    with one_pass_on_cpu(counts), WeightBridge(chunks, build, config, layout, receiver) as bridge:
        with device_path(SyncCounts()):
            bridge.sync(sync_id)
        with device_path(counts):
            bridge.sync(sync_id + 1)
    if receiver is not None:
        receiver.close()
    return vars(counts) | {"inside_launch": None}


def _bench_worker(hf_dir: str, repeats: int, bucket_mb: float, transport: str, parallel: list[str],
                  measure_delta: bool, one_pass: bool) -> dict:
    import torch.distributed as dist

    from kernels.cpu_library import library
    from kernels.fp8.cpu import fp8_blockwise_quantize_cpu
    from kernels.fp8.reference import blockwise_fp8_quantize_reference
    from kernels.fp8.triton import blockwise_fp8_quantize_triton, fp8_kernels_available
    from megatron_ais.arguments import TrainerConfig, build_parser
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.platform import device, is_cuda
    from megatron_ais.training import initialize_trainer, setup_model_and_optimizer

    args = build_parser("bench").parse_args(["--hf-dir", hf_dir, "--bf16", "--seq-length", "64", "--lr", "1e-6",
                                             *parallel])
    trainer = TrainerConfig.from_args(args, int(os.environ["WORLD_SIZE"]))
    _, build = initialize_trainer(trainer)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    chunks = setup.chunks
    layout = BridgeLayout.from_parallel_state()
    cuda = is_cuda()
    result = {}
    for precision in ("bf16", "fp8", "nvfp4", "mxfp4"):
        config = BridgeConfig(bucket_size_mb=bucket_mb, policy=QuantizationPolicy(precision=precision),
                              transport=transport)
        receiver = SyncReceiver() if layout.rank == 0 else None
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
        result[precision] = {"seconds": statistics.median(times), "bytes": moved, "buckets": stats.buckets}
        if precision in ("bf16", "fp8"):  # 4-bit: bytes and seconds only
            counts = SyncCounts()
            with device_path(counts):
                bridge.sync(repeats + 1)
            result[precision]["counts"] = vars(counts) | {"inside_launch": None}
            if one_pass:
                result[precision]["one_pass_counts"] = _one_pass_counts(chunks, build, config, layout,
                                                                        repeats + 10)
        if precision != "bf16" and measure_delta:
            result[precision]["delta"] = _delta_fractions(bridge, receiver, setup, trainer, repeats + 2)
        bridge.close()
        if receiver is not None:
            receiver.close()
    # baseline: a plain copy of the BF16 sync's bytes, in buffers the size of one bucket
    total = result["bf16"]["bytes"] if layout.rank == 0 else 0
    src = torch.empty(int(bucket_mb * (1 << 20)), dtype=torch.uint8, device=device()).random_()
    dst = torch.empty_like(src)

    def copy_by_buckets():
        left = total
        while left > 0:
            n = min(left, src.numel())
            dst[:n].copy_(src[:n])
            left -= n

    result["copy_seconds"] = _median_seconds(copy_by_buckets, repeats, cuda)
    # the same bytes copied at once, buffers the size of the sync: where the caches hold a bucket but not the sync
    # (a large last-level cache), this copy runs at memory speed as the sync does, the bucket-sized one does not
    whole_src = torch.empty(max(total, 1), dtype=torch.uint8, device=device()).random_()
    whole_dst = torch.empty_like(whole_src)
    result["whole_copy_seconds"] = _median_seconds(lambda: whole_dst.copy_(whole_src), repeats, cuda)
    del whole_src, whole_dst
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device())
    quantizers = {"torch reference": blockwise_fp8_quantize_reference}
    if fp8_kernels_available(weight.device):
        quantizers["Triton"] = blockwise_fp8_quantize_triton
    elif library() is not None:
        quantizers["C kernel"] = fp8_blockwise_quantize_cpu
    result["quant_gbps"] = {}
    for name, quantize in quantizers.items():
        quantize(weight)  # warm-up: Triton compiles on the first call
        seconds = _median_seconds(lambda: quantize(weight), repeats, cuda)
        result["quant_gbps"][name] = weight.numel() * weight.element_size() / seconds / 1e9
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
    parser.add_argument("--delta", action="store_true",
                        help="Also measure a delta sync's bytes (FP8, NVFP4, MXFP4) after one Adam step at lr 1e-6.")
    parser.add_argument("--one-pass", action="store_true",
                        help="On CPU: also count the GPU's one-pass path (Triton bucket kernels), run by Triton's "
                             "interpreter (slow: use a small model).")
    args = parser.parse_args(argv)
    if args.one_pass:  # before any rank imports triton
        os.environ["TRITON_INTERPRET"] = "1"
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
        results = spawn(world, _bench_worker, hf_dir, args.repeats, args.bucket_size_mb, args.transport, parallel,
                        args.delta, args.one_pass)
    r = results[0]
    bf16, fp8 = r["bf16"], r["fp8"]
    layout = "EP2 (MoE)" if args.arch == "qwen3_moe" else f"TP{tp}"
    # a BF16 sync moves every parameter once, in 2 bytes
    print(f"| {layout}, {args.transport}, {r['device']}, {bf16['bytes'] / 2e6:.0f}M params | "
          "bytes moved | seconds "
          "(median) | GB/s |")
    print("|---|---|---|---|")
    for name, row in (("BF16 sync", bf16), ("FP8 sync", fp8), ("NVFP4 sync", r["nvfp4"]), ("MXFP4 sync", r["mxfp4"])):
        print(f"| {name} | {row['bytes'] / 1e6:.1f} MB | {row['seconds']:.3f} | {row['bytes'] / row['seconds'] / 1e9:.3f} |")
    print(f"| plain copy of the BF16 bytes | {bf16['bytes'] / 1e6:.1f} MB | {r['copy_seconds']:.4f} | "
          f"{bf16['bytes'] / r['copy_seconds'] / 1e9:.3f} |")
    print(f"| the same, at once (buffers the size of the sync) | {bf16['bytes'] / 1e6:.1f} MB | "
          f"{r['whole_copy_seconds']:.4f} | {bf16['bytes'] / r['whole_copy_seconds'] / 1e9:.3f} |")
    for name, gbps in r["quant_gbps"].items():
        print(f"| FP8 quantize (4096x4096 bf16, {name}) | | | {gbps:.3f} |")
    print("\n| one sync on the engine's rank, the GPU's path on CPU tensors | buckets | aten ops | per bucket | host "
          "synchronisations (GPU) | per bucket | new tensor bytes per synced byte |\n|---|---|---|---|---|---|---|")
    paths = [("", "counts")] + ([(", one pass", "one_pass_counts")] if args.one_pass else [])
    for (path, key), (name, row) in itertools.product(paths, (("BF16 sync", bf16), ("FP8 sync", fp8))):
        c, buckets = row[key], max(row["buckets"], 1)
        print(f"| {name}{path} | {row['buckets']} | {c['ops']} | {c['ops'] / buckets:.0f} | {c['read_backs']} | "
              f"{c['read_backs'] / buckets:.1f} | {c['new_bytes'] / row['bytes']:.2f} |")
    quant = max(r["quant_gbps"].values())
    figures = (f"bridge_sync_ratio={bf16['seconds'] / r['copy_seconds']:.2f} "
               f"over_whole_copy={bf16['seconds'] / r['whole_copy_seconds']:.2f} fp8_quant_gbps={quant:.3f} "
               f"bf16_sync_s={bf16['seconds']:.3f} fp8_sync_s={fp8['seconds']:.3f} ops_per_sync={fp8['counts']['ops']} "
               f"host_syncs_per_sync={fp8['counts']['read_backs']} "
               f"nvfp4_over_fp8_bytes={r['nvfp4']['bytes'] / fp8['bytes']:.3f} "
               f"mxfp4_over_fp8_bytes={r['mxfp4']['bytes'] / fp8['bytes']:.3f} "
               f"nvfp4_sync_s={r['nvfp4']['seconds']:.3f} mxfp4_sync_s={r['mxfp4']['seconds']:.3f}")
    if args.one_pass:
        figures += (f" one_pass_ops_per_sync={fp8['one_pass_counts']['ops']} "
                    f"one_pass_host_syncs_per_sync={fp8['one_pass_counts']['read_backs']}")
    if args.delta:
        print()
        for precision in ("fp8", "nvfp4", "mxfp4"):
            measured = r[precision]["delta"]
            print(f"{precision.upper()} delta after one Adam step at lr 1e-6: {measured['codes_fraction']:.4%} of the "
                  f"linear weights' code bytes changed, {measured['bytes_fraction']:.4%} of a full sync's bytes")
            prefix = "" if precision == "fp8" else precision + "_"
            figures += f" {prefix}delta_bytes_fraction={measured['bytes_fraction']:.5f}"
    print(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
