"""Rollout throughput of the FP8 engine against the BF16 engine on the same prompts, and in-place weight-update
latency, measured in one run (colocated engines, one at a time, in a fresh process each); a third row adds an FP8
KV cache (scales as the trainer would install them: max |K|, |V| x 2 / 448, measured with transformers here).

    .venv/bin/python tools/bench_rollout.py [--prompts 32 --n 4 --max-new-tokens 64 --repeats 3]

Prints a table and, as its last line, `fp8_over_bf16_tokens_per_s=<ratio> weight_update_ms=<median>`.

`--fleet`: the run's fleet on 2 gloo ranks (DP2), FP8 engines in separate processes, each bound to one CPU core:
total tokens/s of 2 engines (one per rank, each generating its share of the prompts with the prompts' own seeds)
against 1 engine (rank 0's, all the prompts), and the bytes of rollout rows each rank is sent and holds against the
whole batch (`rollout.rows.exchange_rows`); a third row runs 2 colocated engines (one inside each rank, vLLM's
external_launcher). Last line: `engines_2_over_1_tokens_per_s=<ratio> colocated_2_over_1_tokens_per_s=<ratio>
rank_bytes_fraction=<largest share of the batch a rank holds> ...`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _kv_amax(hf_dir: str, batch: list[list[int]]):
    """[layers, 3] max |q|, |k|, |v| of the prompts through transformers (k and v as cached: after k_norm and
    RoPE for k), what the trainer's calibration measures."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    amax = torch.zeros(len(model.model.layers), 3)
    original = modeling_qwen3.apply_rotary_pos_emb

    def recording(q, k, cos, sin, *rest, **kw):
        q, k = original(q, k, cos, sin, *rest, **kw)
        recording.last = (q, k)
        return q, k

    modeling_qwen3.apply_rotary_pos_emb = recording
    try:
        for index, layer in enumerate(model.model.layers):
            def hook(module, args, output, index=index):
                q, k = recording.last
                amax[index, 0] = max(amax[index, 0], q.abs().max())
                amax[index, 1] = max(amax[index, 1], k.abs().max())
            layer.self_attn.register_forward_hook(hook)
            layer.self_attn.v_proj.register_forward_hook(
                lambda m, i, o, index=index: amax.__setitem__((index, 2), max(amax[index, 2], o.abs().max())))
        with torch.no_grad():
            for ids in batch:
                model(torch.tensor([ids]))
    finally:
        modeling_qwen3.apply_rotary_pos_emb = original
    return amax


def _engine_worker(hf_dir: str, precision: str, work: str, prompts: int, n: int, max_new: int, repeats: int,
                   kv_cache_dtype: str = "auto") -> dict:
    import torch

    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.mapping.hf_io import HFCheckpointReader
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.kv_calibration import KVCacheScales

    engine = RolloutEngine(EngineConfig(model_dir=hf_dir, precision=precision, kv_cache_gb=1.0,
                                        max_num_seqs=prompts * n, kv_cache_dtype=kv_cache_dtype,
                                        placement="colocated"), work)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(10, 400, (16,), generator=g).tolist() for _ in range(prompts)]
    if kv_cache_dtype == "fp8":
        engine.set_kv_cache_scales(KVCacheScales.from_amax(_kv_amax(hf_dir, batch), margin=2.0))
    sampling = SamplingConfig(n=n, max_new_tokens=max_new, seed=0)
    engine.generate(batch, sampling, progress=False)  # warm up the batch shapes
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rollouts = engine.generate(batch, sampling, progress=False)
        rates.append(sum(r.length for r in rollouts) / (time.perf_counter() - t0))
    reader = HFCheckpointReader(hf_dir)
    tensors = list(quantize_for_engine(((k, reader.get(k)) for k in reader.names()),
                                       QuantizationPolicy(precision=precision)))
    updates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.update_weights(tensors)
        updates.append(time.perf_counter() - t0)
    return {"tokens_per_s": statistics.median(rates), "update_ms": 1000 * statistics.median(updates),
            "tokens": sum(r.length for r in rollouts), "threads": torch.get_num_threads()}


def _fleet_worker(hf_dir: str, work: str, engines: int, placement: str, prompts: int, n: int, max_new: int,
                  repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_ais.grpo.advantages import AdvantageConfig
    from megatron_ais.grpo.advantages import with_advantages
    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.rollout.batching import rollouts_to_batch
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.rollout.fleet_layout import FleetLayout, cpu_core_of
    from megatron_ais.rollout.rows import exchange_rows, make_rows

    initialize_distributed()
    layout = FleetLayout.first_ranks(engines, dist.get_rank())
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(10, 400, (16,), generator=g).tolist() for _ in range(prompts)]
    sampling = SamplingConfig(n=n, max_new_tokens=max_new, seed=0)
    engine = share = None
    if layout.engine_here is not None:
        engine = RolloutEngine(EngineConfig(model_dir=hf_dir, precision="fp8", kv_cache_gb=0.5, max_num_seqs=prompts * n,
                                            placement=placement, cpu_core=cpu_core_of(layout.engine_here)),
                               os.path.join(work, f"engine-{layout.engine_here}"))
        share = layout.share(range(prompts), layout.engine_here)
        engine.generate(batch[share.start:share.stop], sampling, progress=False, first_index=share.start)  # warm up
    rates = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        tokens = torch.zeros(1)
        if engine is not None:
            rollouts = engine.generate(batch[share.start:share.stop], sampling, progress=False, first_index=share.start)
            tokens += sum(r.length for r in rollouts)
        dist.all_reduce(tokens)
        rates.append(float(tokens) / (time.perf_counter() - t0))

    def made_rows(_: range):
        return with_advantages(rollouts_to_batch(rollouts, [0.0] * len(rollouts), n, 16 + max_new, 0),
                               AdvantageConfig())

    got = exchange_rows(make_rows(made_rows, layout, prompts, 1), [0, 1], dist.get_rank(), balanced=False)
    if engine is not None:
        engine.shutdown()
    return {"tokens_per_s": statistics.median(rates), "received": got.received_bytes, "held": got.held_bytes,
            "batch": got.batch_bytes}


def _fleet(hf_dir: str, tmp: str, args) -> None:
    from megatron_ais.launch import spawn

    fleets = {"1 engine": (1, "separate"), "2 engines": (2, "separate"), "2 colocated engines": (2, "colocated")}
    results = {name: spawn(2, _fleet_worker, hf_dir, os.path.join(tmp, f"fleet{engines}{placement}"), engines,
                           placement, args.prompts, args.n, args.max_new_tokens, args.repeats)
               for name, (engines, placement) in fleets.items()}
    print(f"| fleet (DP2, FP8 engines, one core each, {args.prompts} prompts x {args.n}) | tokens/s | rank 0 received "
          "/ holds (bytes) | rank 1 received / holds (bytes) | whole batch (bytes) |")
    print("|---|---|---|---|---|")
    for name, ranks in results.items():
        print(f"| {name} | {ranks[0]['tokens_per_s']:.0f} | "
              + " | ".join(f"{r['received']} / {r['held']}" for r in ranks) + f" | {ranks[0]['batch']} |")
    one, two = results["1 engine"][0]["tokens_per_s"], results["2 engines"]
    print(f"engines_2_over_1_tokens_per_s={two[0]['tokens_per_s'] / one:.3f} "
          f"colocated_2_over_1_tokens_per_s={results['2 colocated engines'][0]['tokens_per_s'] / one:.3f} "
          f"rank_bytes_fraction={max(r['held'] for r in two) / two[0]['batch']:.3f} "
          f"rank_received_fraction={max(r['received'] for r in two) / two[0]['batch']:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--fleet", action="store_true", help="2 engines against 1 on 2 ranks (see above)")
    args = parser.parse_args(argv)
    import make_tiny_model
    from megatron_ais.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args([
            "--arch", "qwen3", "--out", os.path.join(tmp, "model"), "--hidden-size", str(args.hidden_size),
            "--num-layers", str(args.num_layers), "--intermediate-size", str(4 * args.hidden_size),
            "--num-attention-heads", str(args.hidden_size // 64), "--num-key-value-heads", "2",
            "--head-dim", "64", "--vocab-size", "1024"]))
        if args.fleet:
            _fleet(hf_dir, tmp, args)
            return 0
        results = {(p, kv): spawn(1, _engine_worker, hf_dir, p, os.path.join(tmp, p + kv), args.prompts, args.n,
                                  args.max_new_tokens, args.repeats, kv)[0]
                   for p, kv in (("bf16", "auto"), ("fp8", "auto"), ("fp8", "fp8"))}
    bf16, fp8 = results["bf16", "auto"], results["fp8", "auto"]
    print(f"| engine (colocated, {bf16['threads']} threads, hidden {args.hidden_size} x {args.num_layers} layers, "
          f"{args.prompts} prompts x {args.n}) | tokens/s | weight update ms |")
    print("|---|---|---|")
    for name, row in (("BF16", bf16), ("FP8 blockwise", fp8), ("FP8 blockwise + FP8 KV cache", results["fp8", "fp8"])):
        print(f"| {name} | {row['tokens_per_s']:.0f} | {row['update_ms']:.1f} |")
    print(f"fp8_over_bf16_tokens_per_s={fp8['tokens_per_s'] / bf16['tokens_per_s']:.3f} "
          f"weight_update_ms={fp8['update_ms']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
