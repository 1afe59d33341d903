"""The bridge at TP1/TP2/PP2/TP2xPP2 (KV heads < TP, tied embeddings, padded vocab): BF16 output equals the HF
tensors bit for bit, FP8 output dequantizes within the e4m3 bound, senders stay within one bucket."""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from kernels.fp8_blockwise import blockwise_fp8_dequantize
from megatron_ais.mapping.hf_io import HFCheckpointReader

BUCKET_MB = 0.05


def _bridge_worker(cases):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import build_parser, validate_args
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.sync import BridgeConfig, BridgeLayout, sync_weights_to_engine
    from megatron_ais.bridge.transport import SyncReceiver
    from megatron_ais.initialize import initialize_distributed, initialize_model_parallel, set_random_seed
    from megatron_ais.initialize import ParallelSizes
    from megatron_ais.model import ModelBuildConfig
    from megatron_ais.training import build_loaded_chunks
    from megatron_ais.platform import apply_cpu_compat

    apply_cpu_compat()
    initialize_distributed()
    out = []
    for hf_dir, tp, pp in cases:
        args = build_parser("test").parse_args(["--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", str(tp),
                                                "--pipeline-model-parallel-size", str(pp), "--seq-length", "16"])
        hf_config = validate_args(args, dist.get_world_size())
        initialize_model_parallel(ParallelSizes.from_args(args))
        set_random_seed(0)
        build = ModelBuildConfig.from_args(args, hf_config)
        chunks, _, _ = build_loaded_chunks(args, build)
        layout = BridgeLayout.from_parallel_state()
        for sync_id, precision in enumerate(("bf16", "fp8")):
            applied = []
            receiver = SyncReceiver(apply=applied.append) if layout.rank == 0 else None
            config = BridgeConfig(bucket_size_mb=BUCKET_MB, policy=QuantizationPolicy(precision=precision))
            stats = sync_weights_to_engine(chunks, build, config, ps.get_tensor_model_parallel_group(), layout,
                                           sync_id, receiver)
            if layout.rank == 0:
                assert len(applied) == 1
                out.append((hf_dir, tp, pp, precision, dict(applied[0]), len(layout.stage_senders)))
            if layout.is_sender:
                out.append(("sender", stats.max_bucket_bytes, stats.buckets))
        ps.destroy_model_parallel()
    return out


def _check(results, expected_cases):
    seen = set()
    largest = {}
    senders = []
    for rank_result in results:
        for item in rank_result:
            if item[0] == "sender":
                senders.append(item)
                continue
            hf_dir, tp, pp, precision, tensors, stage_senders = item
            assert stage_senders == pp
            seen.add((hf_dir, tp, pp))
            source = HFCheckpointReader(hf_dir)
            assert sorted(n for n in tensors if not n.endswith("_scale_inv")) == sorted(source.names())
            for name in source.names():
                ref = source.get(name)
                got = tensors[name]
                if precision == "bf16" or got.dtype != torch.float8_e4m3fn:
                    assert got.dtype == torch.bfloat16 and torch.equal(got, ref), (name, tp, pp)
                else:
                    scale = tensors[name + "_scale_inv"]
                    deq = blockwise_fp8_dequantize(got, scale, 128, torch.float32)
                    block_amax = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[
                        : ref.shape[0], : ref.shape[1]] * 448
                    assert bool(((deq - ref.float()).abs() <= 2 ** -4 * block_amax).all()), name
                largest[name] = got.numel() * got.element_size()
    assert seen == set(expected_cases)
    bound = max(BUCKET_MB * (1 << 20), max(largest.values()))
    assert all(max_bucket <= bound for _, max_bucket, _ in senders), (senders, bound)
    assert any(buckets > 1 for _, _, buckets in senders)
    return largest


@pytest.mark.slow
def test_bridge_two_ranks(model_root):
    llama = make_model_dir(model_root, "llama")
    kv1 = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    tied = make_model_dir(model_root, "llama", tie_word_embeddings=True)
    qwen2 = make_model_dir(model_root, "qwen2")
    cases = [(llama, 1, 1), (kv1, 2, 1), (qwen2, 2, 1), (tied, 1, 2)]
    _check(spawn(2, _bridge_worker, cases), cases)


@pytest.mark.slow
def test_bridge_tp2_pp2(model_root):
    cases = [(make_model_dir(model_root, "qwen3", num_key_value_heads=1, tie_word_embeddings=True), 2, 2)]
    _check(spawn(4, _bridge_worker, cases), cases)


def _memory_worker(hf_dir):
    import weakref

    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import build_parser, validate_args
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.sync import BridgeConfig, send_stage_weights
    from megatron_ais.initialize import initialize_megatron
    from megatron_ais.model import ModelBuildConfig
    from megatron_ais.training import build_loaded_chunks

    args = build_parser("test").parse_args(["--hf-dir", hf_dir, "--seq-length", "16"])
    hf_config = validate_args(args, 1)
    initialize_megatron(args)
    build = ModelBuildConfig.from_args(args, hf_config)
    chunks, _, _ = build_loaded_chunks(args, build)

    class DroppingTransport:
        """Records, at every send, the bytes of earlier buckets still alive anywhere in the process."""

        def __init__(self):
            self.refs, self.live_at_send, self.bucket_bytes = [], [], []

        def begin(self, sync_id):
            pass

        def send(self, sync_id, bucket, manifest):
            import gc
            gc.collect()
            self.live_at_send.append(sum(n for r, n in self.refs if r() is not None))
            self.bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in bucket))
            self.refs += [(weakref.ref(t), t.numel() * t.element_size()) for _, t in bucket]

        def finish(self, sync_id, num_buckets):
            pass

    transport = DroppingTransport()
    config = BridgeConfig(bucket_size_mb=BUCKET_MB, policy=QuantizationPolicy(precision="fp8"))
    stats = send_stage_weights(chunks, build, config, ps.get_tensor_model_parallel_group(), 0, transport)
    total = sum(p.numel() * 2 for p in chunks[0].parameters())
    return transport.live_at_send, transport.bucket_bytes, stats.bytes, total


def test_sender_keeps_one_bucket_alive_at_a_time(model_root):
    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=128, intermediate_size=256)
    ((live, buckets, sent, model_bytes),) = spawn(1, _memory_worker, hf_dir)
    assert len(buckets) > 3 and sent < model_bytes  # FP8 halves the linear layers
    # when a bucket is handed over, nothing of the earlier buckets is still referenced by the sender
    assert max(live) == 0, live
