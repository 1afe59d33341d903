"""What one GPU without vLLM or Transformer Engine can tell about the first cluster run (issue 49), one figure per
line as `name=value`:

    python3 tools/gpu_checks.py ipc [--arena-gib 1 --opens 50]
        the GPU memory a second process pays to map the bridge's CUDA-IPC arena (its CUDA context: what the placement
        plan counts as `CUDA_CONTEXT_BYTES` per engine process) and whether opening it `--opens` times more leaks;
    python3 tools/gpu_checks.py kernels [--shapes 12288x4096 4096x12288 --experts 8 --expert-shape 768x2048]
        the Triton quantizer and the one-pass bucket kernel at production shapes (Qwen3-8B's MLP, Qwen3-30B-A3B's
        experts) bit for bit against the CPU reference (`kernels.fp8.reference`, `bucket_pass.run_reference`), and
        the quantizer's speed;
    python3 tools/gpu_checks.py model [--num-layers 2 4 --seq-length 4096 --tokens-per-microbatch 8192]
        a Qwen3-8B-width model of a few layers on one rank: the FP8 bridge into a double-buffered arena on the GPU
        (arena bytes, peak memory above the trainer's, sync time per GB and its verification tail), then rank 0's
        activation peak in a GRPO step (old log-probs and the PPO-clip update over token-budget micro-batches of
        sequences at --seq-length) above the model, gradients and Adam states, and its per-layer slope.

Needs a CUDA GPU; `kernels` also runs on CPU tensors under `TRITON_INTERPRET=1` and `model` on a CPU (memory figures
then `unmeasured`): the tests run both at tiny shapes. Exits 1 when a figure that must be exact is not, 2 when the
machine cannot run the check. Writes nothing but a temporary model under --work-dir (removed).
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_bucket_pass import arena_bytes, build_pieces, triton_fp8_device  # noqa: E402
from bench_fp8_quant import _seconds  # noqa: E402

from kernels.bucket_pass import BucketPass, run_reference  # noqa: E402
from kernels.fp8.reference import blockwise_fp8_quantize_reference  # noqa: E402
from kernels.fp8.triton import blockwise_fp8_quantize_triton  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
IPC_TIMEOUT_S = 120
BLOCK = 128
# Qwen3-8B: hidden 4096, 32 heads / 8 KV heads of 128, MLP 12288, vocabulary 151936, untied embeddings
QWEN3_8B = {"hidden-size": 4096, "num-attention-heads": 32, "num-key-value-heads": 8, "head-dim": 128,
            "intermediate-size": 12288, "vocab-size": 151936}
QWEN3_8B_LAYERS = 36


def figure(name: str, value) -> None:
    """One figure, one line."""
    print(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}", flush=True)


# ---------------------------------------------------------------------------------------------------------- ipc


def _ipc_consumer(ref_text: str, nbytes: int, opens: int, conn) -> None:
    """An engine process's side: map the arena once and hold it (the parent reads the GPU's free memory), then open
    it `opens` times more, reading a byte each time, and report the seconds per open."""
    from megatron_ais.bridge.arena import CudaBuffer, decode_ref

    ref = decode_ref(ref_text)
    held = CudaBuffer.open(ref, nbytes)
    held.data[-1:].float().sum().item()
    conn.send("opened")
    conn.recv()
    start = time.perf_counter()
    for _ in range(opens):
        again = CudaBuffer.open(ref, nbytes)
        again.data[-1:].float().sum().item()
        del again
    torch.cuda.synchronize()
    conn.send((time.perf_counter() - start) / opens)
    conn.recv()


def ipc_check(args) -> int:
    from megatron_ais.bridge.arena import CUDA_CONTEXT_BYTES, CudaBuffer, encode_ref

    if not torch.cuda.is_available():
        print("gpu_checks.py ipc: needs a CUDA GPU", file=sys.stderr)
        return 2
    buffer = CudaBuffer.create(int(args.arena_gib * GIB))
    buffer.data.fill_(7)
    torch.cuda.synchronize()

    def free() -> int:
        return torch.cuda.mem_get_info()[0]

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    consumer = context.Process(target=_ipc_consumer, args=(encode_ref(buffer.ref), buffer.nbytes, args.opens, there))
    before = free()
    consumer.start()
    there.close()  # the consumer's end lives in the consumer only: if it dies, receiving here fails, not waits

    def answer():
        if not here.poll(IPC_TIMEOUT_S):
            raise TimeoutError(f"the IPC consumer gave no answer in {IPC_TIMEOUT_S} s")
        return here.recv()

    answer()
    opened = free()
    here.send("go")
    seconds_per_open = answer()
    after_opens = free()
    here.send("exit")
    consumer.join(60)
    released = free()
    figure("ipc_arena_gib", args.arena_gib)
    figure("ipc_consumer_gpu_mib", (before - opened) / MIB)
    figure("ipc_consumer_estimate_mib", CUDA_CONTEXT_BYTES / MIB)
    figure(f"ipc_growth_after_{args.opens}_opens_mib", (opened - after_opens) / MIB)
    figure("ipc_open_ms", seconds_per_open * 1e3)
    figure("ipc_released_at_exit_mib", (released - after_opens) / MIB)
    return 0 if consumer.exitcode == 0 else 1


# ------------------------------------------------------------------------------------------------------ kernels


def _shape(text: str) -> tuple[int, int]:
    rows, cols = (int(v) for v in text.lower().split("x"))
    return rows, cols


def weights(shapes: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    """BF16 weights on the CPU at initialisation scale, every fourth 128-row band 64× larger (scales that differ)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols in shapes:
        w = torch.randn(rows, cols, generator=g) * 0.02
        w[::4 * BLOCK] *= 64.0
        out.append(w.bfloat16())
    return out


def quantizer_mismatches(cpu: list[torch.Tensor], device: torch.device) -> int:
    """Tensors whose Triton codes or scales differ from the CPU reference's, with and without power-of-two scales."""
    bad = 0
    for w in cpu:
        on_device = w.to(device)
        for pow2 in (False, True):
            q, s = blockwise_fp8_quantize_triton(on_device, BLOCK, pow2)
            q_ref, s_ref = blockwise_fp8_quantize_reference(w, BLOCK, pow2)
            bad += not (torch.equal(s.cpu(), s_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)))
    return bad


def bucket_pass_mismatches(cpu: list[torch.Tensor], device: torch.device) -> list[str]:
    """The passes (copy, quantize, both sums) whose figures differ from the reference's, and `arena` when any byte
    the kernel wrote differs from what the reference wrote."""
    arena = torch.zeros(arena_bytes(cpu, BLOCK), dtype=torch.uint8, device=device)
    reference_arena = torch.zeros_like(arena, device="cpu")
    got = build_pieces([w.to(device) for w in cpu], arena, BLOCK)
    want = build_pieces(cpu, reference_arena, BLOCK)
    bad = []
    for kind, (pieces, rows) in got.items():  # copy and quantize first: the sums read what they wrote
        figures = BucketPass(pieces, rows, BLOCK).run().cpu()
        if not torch.equal(figures, run_reference(want[kind][0], want[kind][1], BLOCK)):
            bad.append(kind)
    if not torch.equal(arena.cpu(), reference_arena):
        bad.append("arena")
    return bad


def kernels_check(args) -> int:
    device = triton_fp8_device("gpu_checks.py kernels")
    if device is None:
        return 2
    cuda = device.type == "cuda"
    rows, cols = _shape(args.expert_shape)
    cases = {text: [_shape(text)] for text in args.shapes}
    if args.experts:  # each expert's gate and up projections (rows x cols) and its down projection
        cases[f"experts{args.experts}x{args.expert_shape}"] = [(rows, cols), (rows, cols), (cols, rows)] * args.experts
    failed = 0
    for seed, (name, shapes) in enumerate(cases.items()):
        cpu = weights(shapes, seed)
        bad_quantized = quantizer_mismatches(cpu, device)
        bad_passes = bucket_pass_mismatches(cpu, device)
        figure(f"triton_quantizer_mismatched_tensors_{name}", bad_quantized)
        figure(f"bucket_pass_mismatches_{name}", ",".join(bad_passes) or "none")
        on_device = cpu[0].to(device)
        seconds = _seconds(lambda: blockwise_fp8_quantize_triton(on_device), args.repeats, cuda)
        figure(f"triton_quantize_gbps_{name}", on_device.numel() * 2 / seconds / 1e9)
        failed += bad_quantized + len(bad_passes)
    return 1 if failed else 0


# -------------------------------------------------------------------------------------------------------- model


def _allocated() -> int | None:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


def _peak_since(base: int | None) -> int | None:
    return None if base is None else torch.cuda.max_memory_allocated() - base


def _reset_peak() -> int | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _wall() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _arena_figures(setup, build, syncs: int) -> dict:
    """FP8 syncs of the model into a double-buffered arena where the platform puts it (GPU memory on CUDA): its
    bytes, the peak above the trainer's memory, seconds per sync and the verification tail (`commit` waiting for
    the receiver's checksums after the last bucket was written)."""
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge

    receiver = SyncReceiver(slots=2)
    commit, tails = receiver.commit, []

    def timed_commit(sync_id):
        start = _wall()
        committed = commit(sync_id)
        tails.append(_wall() - start)
        return committed

    receiver.commit = timed_commit
    bridge = WeightBridge(setup.chunks, build, BridgeConfig(policy=QuantizationPolicy(precision="fp8")),
                          BridgeLayout.from_parallel_state(), receiver)
    base, seconds, moved = _reset_peak(), [], 0
    for sync_id in range(syncs + 1):  # the first sync maps the buffers and builds the plan
        start = _wall()
        moved = bridge.sync(sync_id).bytes or moved
        if sync_id:
            seconds.append(_wall() - start)
    peak, arena = _peak_since(base), sum(a.nbytes for a in receiver.arenas)
    on_gpu = receiver.arenas[0].data.is_cuda
    bridge.close()
    receiver.close()
    return {"arena_on_gpu": on_gpu, "arena_gib": arena / GIB, "synced_gb": moved / 1e9,
            "sync_s": statistics.median(seconds), "verify_tail_s": statistics.median(tails[1:]),
            "peak_gib": None if peak is None else peak / GIB}


def _activation_figures(setup, build, groups, seq_length: int, tokens: int, sequences: int) -> dict:
    """Rank 0's memory peak in one GRPO step above what it holds between steps (the second step: the first
    creates Adam's states), the step's seconds, and its loss."""
    from bench_train import rollout_batch

    from megatron_ais.ais import AISConfig, AISState
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch

    batch = rollout_batch([seq_length] * sequences, seq_length, build.shape.vocab_size, group_size=sequences)
    config = GRPOConfig(loss=PolicyLossConfig(), correction=AISConfig(), vocab_size=build.shape.vocab_size,
                        micro_batch_size=1, max_tokens_per_microbatch=tokens)

    def step():
        return grpo_train_step(setup.ddp_chunks, setup.optimizer, rows_of_whole_batch(batch, config, groups), config,
                               AISState(), groups)

    step()
    base = _reset_peak()
    start = _wall()
    metrics = step().metrics
    seconds, peak = _wall() - start, _peak_since(base)
    return {"held_gib": None if base is None else base / GIB, "step_s": seconds,
            "activation_peak_gib": None if peak is None else peak / GIB, "loss": metrics["train/policy_loss"]}


def _model_worker(hf_dir: str, seq_length: int, tokens: int, sequences: int, syncs: int) -> dict:
    from megatron_ais.arguments import TrainerConfig, build_parser
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.training import initialize_trainer, setup_model_and_optimizer

    args = build_parser("gpu-checks").parse_args(["--hf-dir", hf_dir, "--bf16", "--seq-length", str(seq_length),
                                                  "--max-tokens-per-microbatch", str(tokens), "--lr", "1e-6"])
    trainer = TrainerConfig.from_args(args, 1)
    _, build = initialize_trainer(trainer)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    arena = _arena_figures(setup, build, syncs)
    activation = _activation_figures(setup, build, ParallelGroups.from_parallel_state(), seq_length, tokens,
                                     sequences)
    return {"arena": arena, "activation": activation}


def _unmeasured(value) -> str | float:
    return "unmeasured" if value is None else value


def model_check(args) -> int:
    import make_tiny_model
    from megatron_ais.launch import spawn

    width = dict(QWEN3_8B)
    if args.hidden_size:  # a small model for the tests
        width.update({"hidden-size": args.hidden_size, "intermediate-size": args.intermediate_size or
                      4 * args.hidden_size, "vocab-size": args.vocab_size or 512, "num-attention-heads": 2,
                      "num-key-value-heads": 1, "head-dim": args.hidden_size // 2})
    peaks = {}
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for layers in args.num_layers:
            hf_dir = make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args(
                ["--arch", "qwen3", "--out", os.path.join(tmp, f"layers{layers}"), "--num-layers", str(layers),
                 "--max-position-embeddings", str(args.seq_length),
                 *(x for k, v in width.items() for x in (f"--{k}", str(v)))]))
            (result,) = spawn(1, _model_worker, hf_dir, args.seq_length, args.tokens_per_microbatch, args.sequences,
                              args.syncs, timeout=args.timeout)
            arena, activation = result["arena"], result["activation"]
            at = f"layers{layers}"
            figure(f"arena_on_gpu_{at}", int(arena["arena_on_gpu"]))
            figure(f"arena_double_buffered_gib_{at}", arena["arena_gib"])
            figure(f"arena_peak_above_trainer_gib_{at}", _unmeasured(arena["peak_gib"]))
            figure(f"fp8_sync_s_per_gb_{at}", arena["sync_s"] / arena["synced_gb"])
            figure(f"verify_tail_s_per_gb_{at}", arena["verify_tail_s"] / arena["synced_gb"])
            figure(f"trainer_held_gib_{at}", _unmeasured(activation["held_gib"]))
            figure(f"activation_peak_gib_{at}_seq{args.seq_length}_mb{args.tokens_per_microbatch}",
                   _unmeasured(activation["activation_peak_gib"]))
            figure(f"grpo_step_s_{at}", activation["step_s"])
            if not math.isfinite(activation["loss"]):
                print(f"gpu_checks.py model: the GRPO step's loss is {activation['loss']}", file=sys.stderr)
                return 1
            peaks[layers] = activation["activation_peak_gib"]
    if len(peaks) > 1 and None not in peaks.values():  # linear in the layers: the logits' share is in the intercept
        low, high = min(peaks), max(peaks)
        per_layer = (peaks[high] - peaks[low]) / (high - low)
        figure("activation_peak_gib_per_layer", per_layer)
        figure(f"activation_peak_gib_{QWEN3_8B_LAYERS}_layers_extrapolated",
               peaks[low] + per_layer * (QWEN3_8B_LAYERS - low))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checks = parser.add_subparsers(dest="check", required=True)
    ipc = checks.add_parser("ipc", help="What a process pays to map the CUDA-IPC arena, and whether reopening leaks.")
    ipc.add_argument("--arena-gib", type=float, default=1.0)
    ipc.add_argument("--opens", type=int, default=50)
    kernels = checks.add_parser("kernels", help="Triton quantizer and one-pass kernel against the CPU reference.")
    kernels.add_argument("--shapes", nargs="*", default=["12288x4096", "4096x12288"], help="ROWSxCOLS weights.")
    kernels.add_argument("--experts", type=int, default=8, help="Experts in the MoE bucket (0: none).")
    kernels.add_argument("--expert-shape", default="768x2048", help="An expert's gate/up projection, ROWSxCOLS.")
    kernels.add_argument("--repeats", type=int, default=20)
    model = checks.add_parser("model", help="Arena and activation peak of a Qwen3-8B-width model of a few layers.")
    model.add_argument("--num-layers", type=int, nargs="+", default=[2, 4])
    model.add_argument("--seq-length", type=int, default=4096)
    model.add_argument("--tokens-per-microbatch", type=int, default=8192)
    model.add_argument("--sequences", type=int, default=4, help="Sequences of --seq-length in the GRPO step.")
    model.add_argument("--syncs", type=int, default=3, help="Timed syncs (after one that maps the arena).")
    model.add_argument("--hidden-size", type=int, default=0, help="Override Qwen3-8B's width (2 heads): tests.")
    model.add_argument("--intermediate-size", type=int, default=0, help="With --hidden-size (default 4x).")
    model.add_argument("--vocab-size", type=int, default=0, help="With --hidden-size (default 512).")
    model.add_argument("--work-dir", default=None, help="Where the temporary model goes (default: the system's).")
    model.add_argument("--timeout", type=float, default=600.0)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    at_least_one = {"ipc": ("opens",), "kernels": ("repeats",), "model": ("seq_length", "sequences", "syncs",
                                                                        "tokens_per_microbatch")}[args.check]
    for name in at_least_one:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.check == "kernels" and args.experts < 0:
        parser.error("--experts must be at least 0 (0: no MoE bucket)")
    if args.check == "ipc" and not args.arena_gib > 0:
        parser.error("--arena-gib must be positive")
    if args.check == "kernels":
        try:
            for text in [*args.shapes, args.expert_shape]:
                _shape(text)
        except ValueError:
            parser.error("--shapes and --expert-shape take ROWSxCOLS, e.g. 12288x4096")
    return {"ipc": ipc_check, "kernels": kernels_check, "model": model_check}[args.check](args)


if __name__ == "__main__":
    sys.exit(main())
