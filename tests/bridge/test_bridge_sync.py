"""The bridge at TP1/TP2/PP2/TP2xPP2 (KV heads < TP, tied embeddings, padded vocab): BF16 output equals the HF
tensors bit for bit, FP8 codes and scales equal the reference quantizer's of the whole tensor bit for bit (on shapes
with several 128 x 128 blocks per rank, so that each rank's scales must land in their place), senders stay within one
bucket."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from kernels.fp8.reference import blockwise_fp8_quantize_reference
from megatron_ais.mapping.hf_io import HFCheckpointReader

BUCKET_MB = 0.05


def _bridge_worker(cases):
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.engine.feeds.base import named_tensors
    from megatron_ais.training import load_policy_chunks

    out = []
    for hf_dir, tp, pp, transport, *ep in cases:
        moe = ["--expert-model-parallel-size", str(ep[0])] + (["--sequence-parallel"] if tp > 1 else []) if ep else []
        trainer, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", tp,
                                          "--pipeline-model-parallel-size", pp, "--seq-length", 16, *moe)
        chunks, _, _ = load_policy_chunks(build, trainer.weights)
        layout = BridgeLayout.from_parallel_state()
        for sync_id, precision in enumerate(("bf16", "fp8")):
            applied = []
            receiver = SyncReceiver(
                on_commit=lambda w: applied.append({n: t.cpu().clone() for n, t in named_tensors(w)})) \
                if layout.rank == 0 else None
            config = BridgeConfig(bucket_size_mb=BUCKET_MB, policy=QuantizationPolicy(precision=precision),
                                  transport=transport)
            with WeightBridge(chunks, build, config, layout, receiver) as bridge:
                stats = bridge.sync(sync_id)
            if layout.rank == 0:
                assert len(applied) == 1
                out.append((hf_dir, tp, pp, precision, applied[0], len(layout.stage_senders)))
                receiver.close()
            if layout.is_sender:
                out.append(("sender", stats.max_bucket_bytes, stats.buckets, stats.transport))
            out.append(("written", hf_dir, tp, pp, precision, transport, stats.written_bytes))
        ps.destroy_model_parallel()
    return out


def _check(results, expected_cases):
    seen = set()
    largest = {}
    senders = []
    written, total_bytes = {}, {}
    for rank_result in results:
        for item in rank_result:
            if item[0] == "sender":
                senders.append(item)
                continue
            if item[0] == "written":
                written.setdefault(item[1:6], []).append(item[6])
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
                else:  # the trainer's whole tensor (fp32, loaded from these BF16 values) quantized in one piece
                    codes, scales = blockwise_fp8_quantize_reference(ref.float(), 128)
                    assert torch.equal(tensors[name + "_scale_inv"], scales), (name, tp, pp)
                    assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8)), (name, tp, pp)
                largest[name] = max(largest.get(name, 0), got.numel() * got.element_size())  # BF16 or FP8
            if precision == "bf16":
                total_bytes[hf_dir] = sum(t.numel() * t.element_size() for t in tensors.values())
    for (hf_dir, tp, pp, precision, _), per_rank in written.items():
        if precision == "bf16":
            assert sum(per_rank) == total_bytes[hf_dir]  # every byte is written once, by one rank
            if len(per_rank) // (tp * pp) > 1:  # data-parallel replicas share the writing
                assert all(0 < w for w in per_rank) and max(per_rank) <= 0.75 * sum(per_rank), per_rank
    assert seen == {case[:3] for case in expected_cases}
    assert {s[3] for s in senders} == {case[3] for case in expected_cases}
    bound = max(BUCKET_MB * (1 << 20), max(largest.values()))
    assert all(max_bucket <= bound for _, max_bucket, _, _ in senders), (senders, bound)
    assert any(buckets > 1 for _, _, buckets, _ in senders)
    return largest


@pytest.mark.slow
def test_bridge_two_ranks(model_root):
    llama = make_model_dir(model_root, "llama")
    kv1 = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    tied = make_model_dir(model_root, "llama", tie_word_embeddings=True)
    # at TP2 its q/o shards hold 2 blocks, its gate/up/down shards 4: each rank quantizes its own and places the scales
    qwen2 = make_model_dir(model_root, "qwen2", hidden_size=256, intermediate_size=512)
    cases = [(llama, 1, 1, "shm"), (kv1, 2, 1, "shm"), (qwen2, 2, 1, "shm"), (tied, 1, 2, "distributed")]
    _check(spawn(2, _bridge_worker, cases), cases)


@pytest.mark.slow
def test_bridge_tp2_pp2(model_root):
    model = make_model_dir(model_root, "qwen3", num_key_value_heads=1, tie_word_embeddings=True, hidden_size=256,
                           intermediate_size=512)
    cases = [(model, 2, 2, "shm"), (model, 2, 2, "distributed")]
    _check(spawn(4, _bridge_worker, cases), cases)


@pytest.mark.slow
def test_bridge_moe_expert_parallel(model_root):
    """Every expert-parallel rank writes its own experts (no rank gathers them): the engine receives all experts,
    BF16 and FP8 bit for bit, at EP2 and EP2 x TP2 (expert-TP 2)."""
    moe = make_model_dir(model_root, "qwen3_moe", num_layers=2, hidden_size=256, initializer_range=0.1)
    _check(spawn(2, _bridge_worker, [(moe, 1, 1, "shm", 2)]), [(moe, 1, 1, "shm", 2)])
    _check(spawn(4, _bridge_worker, [(moe, 2, 1, "shm", 2)]), [(moe, 2, 1, "shm", 2)])


@pytest.mark.gpu
def test_bridge_into_a_cuda_arena(model_root):
    """On a CUDA node the staging arena is GPU memory: the trainer's GPU shards are copied and quantized (Triton)
    into it device to device, checksummed there in torch ops and verified by the receiver, bit-exact in BF16."""
    import torch

    assert torch.cuda.is_available()
    model = make_model_dir(model_root, "qwen3", tie_word_embeddings=True)
    cases = [(model, 1, 1, "shm")]
    _check(spawn(1, _bridge_worker, cases), cases)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _bf16_model(hf_dir, parallel_flag, size=2):
    """Megatron initialised for `size` ranks split by `parallel_flag` (TP or PP), the model loaded from `hf_dir`."""
    from distributed import start_trainer
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.training import load_policy_chunks

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--bf16", "--seq-length", 16, parallel_flag, size)
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    return chunks, build, BridgeLayout.from_parallel_state()


def _memory_worker(hf_dir, bucket_mb):
    import ctypes

    import torch.distributed as dist

    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.bridge.receiver import SyncReceiver

    chunks, build, layout = _bf16_model(hf_dir, "--pipeline-model-parallel-size")
    receiver = SyncReceiver(on_commit=lambda tensors: None) if layout.rank == 0 else None
    config = BridgeConfig(bucket_size_mb=bucket_mb, policy=QuantizationPolicy(precision="fp8"),
                          transport="distributed")
    bridge = WeightBridge(chunks, build, config, layout, receiver)
    stage_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    from kernels.cpu_library import library

    library()

    def peak_rise(work) -> int:
        dist.barrier()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory would hide new allocations from the RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set size to the current one
        before = _rss_kib("VmRSS")
        result = work()
        return (_rss_kib("VmHWM") - before) * 1024, result

    # the first sync maps and fills the stage's buffer: it is counted
    first_peak, stats = peak_rise(lambda: bridge.sync(0))
    later_peak, _ = peak_rise(lambda: bridge.sync(1))
    # negative control: the measurement sees a copy of the stage's weights
    copy_peak, _ = peak_rise(lambda: [p.detach().clone() for p in chunks[0].parameters()])
    peak = max(first_peak, later_peak)
    largest = max(t.nbytes for t in bridge.plan.tensors)
    bridge.close()
    if receiver is not None:
        receiver.close()
    return layout.rank, stats.transport, peak, stats.max_bucket_bytes, largest, stage_bytes, copy_peak


def test_shipping_sender_peak_memory_is_one_bucket(model_root):
    """The stage that ships its buckets (rank 1, PP2) holds about one bucket plus the largest tensor extra at
    its peak, measured as the rise of its peak resident set size during a sync, never a copy of its weights."""
    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=512, intermediate_size=2048, num_layers=8,
                            num_attention_heads=8, num_key_value_heads=2)
    results = {r[0]: r for r in spawn(2, _memory_worker, hf_dir, 1.0)}
    _, transport, peak, max_bucket, largest, stage_bytes, copy_peak = results[1]
    assert transport == "distributed" and max_bucket <= (1 << 20) + largest
    slack = 2 << 20  # interpreter, pickled manifests, page granularity
    assert copy_peak > 0.9 * stage_bytes > 4 * (max_bucket + largest + slack)  # a copy would be visible
    assert peak <= max_bucket + largest + slack, (peak, max_bucket, largest)


def test_dense_writers_share_out_by_size_and_never_add_a_node():
    import dataclasses

    from megatron_ais.bridge.layout import RankPosition, dense_writer_replicas
    from megatron_ais.bridge.plan import dense_owners

    assert dense_owners([10, 3, 3, 3, 2, 1], 2) == [0, 1, 1, 1, 1, 0]
    assert dense_owners([5, 5], 1) == [0, 0]
    # TP2 x DP3 of one stage, replica 2 on another node
    ranks = [RankPosition(rank=r, pp_rank=0, dp_rank=r // 2, cp0=True, writes_experts=False, tp_rank=r % 2,
                          host="b" if r >= 4 else "a") for r in range(6)]
    assert dense_writer_replicas(ranks) == [0, 1]
    # a replica half on another node is left out; expert writers on node b bring b in
    split = ranks[:5] + [dataclasses.replace(ranks[5], host="a")]
    assert dense_writer_replicas(split) == [0, 1]
    experts_on_b = [dataclasses.replace(p, writes_experts=p.host == "b") for p in ranks]
    assert dense_writer_replicas(experts_on_b) == [0, 1, 2]
    # context-parallel ranks other than 0 never write
    assert dense_writer_replicas([dataclasses.replace(p, cp0=p.dp_rank == 0) for p in ranks]) == [0]


@pytest.mark.parametrize("transport,hosts,expected", [
    ("auto", (("a",), ("a",)), ["shm", "shm"]),
    ("auto", (("a",), ("b",)), ["shm", "distributed"]),
    ("distributed", (("a",), ("a",)), ["shm", "distributed"]),  # the engine's own stage writes in process
    ("shm", (("a",), ("b",)), "--bridge-transport shm: pipeline stage 1 runs on \\['b'\\]"),
    ("auto", (("a", "b"), ("a",)), "the engine's own stage must"),
    ("auto", (("a",), ("b", "c")), "pipeline stage 1's writers run on \\['b', 'c'\\]: a shipped stage"),
])
def test_stage_transports_follow_the_hosts(transport, hosts, expected):
    from megatron_ais.bridge.layout import stage_transports

    if isinstance(expected, list):
        assert stage_transports(hosts, transport, "a", 0) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            stage_transports(hosts, transport, "a", 0)


def _flipping_a_down_proj_byte(receiver):
    """`receiver.receive` that first flips one byte of layer 1's down_proj in the arena, after its writers wrote it
    and before the receiver verifies it."""
    receive = receiver.receive

    def flip_then_receive(sync_id, stage, manifest):
        entry = next((e for e in manifest if e.name.endswith("layers.1.mlp.down_proj.weight")), None)
        if entry is not None:
            receiver.window(stage, entry.offset, entry.offset + entry.nbytes)[7] ^= 0x10
        return receive(sync_id, stage, manifest)
    return flip_then_receive


def _written_by_worker(hf_dir, paths, tp=2):
    """Syncs at TP `tp` through each of `paths`: "host" (the host kernels), "torch" (the torch path of GPU ranks
    without Triton: figures kept where they are computed and read back once per bucket), "one-pass" (the Triton
    bucket pass of GPU ranks, here under the interpreter on CPU tensors; the receiver's checksums too) or "mixed"
    (one pass on rank 0 only, the torch path elsewhere, as on a GPU node where only the engine's rank writes its own
    GPU's arena). Per path: the applied tensors, then the errors of syncs with a NaN in the last rank's shard of a
    down_proj (BF16, FP8) and of an FP8 sync whose down_proj has a byte flipped in the arena after it was written."""
    from kernels import bucket_pass
    from megatron_ais.bridge import buckets as bridge_buckets
    from megatron_ais.bridge import pieces as bridge_pieces
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.errors import SyncError
    from megatron_ais.engine.feeds.base import named_tensors

    chunks, build, layout = _bf16_model(hf_dir, "--tensor-model-parallel-size", tp)
    fc2 = next(p for n, p in chunks[0].named_parameters() if n.endswith("decoder.layers.1.mlp.linear_fc2.weight"))
    on_host, one_pass, sync_id, results = bridge_pieces._on_host, bridge_pieces.supports_pass, 0, {}
    passes = {"host": one_pass, "torch": lambda tensors, sums_only=False: False,
              "one-pass": one_pass if torch.cuda.is_available() else
              (lambda tensors, sums_only=False: bucket_pass.triton_available() and bool(tensors))}
    # a GPU node at TP > 1: the engine's rank writes its own GPU's arena in one pass (and lags), the others not
    passes["mixed"] = passes["one-pass"] if layout.rank == 0 else passes["torch"]
    for path in paths:
        bridge_pieces._on_host = on_host if path == "host" else (lambda *tensors: False)
        bridge_pieces.supports_pass = bridge_buckets.supports_pass = passes[path]
        applied, errors = results.setdefault(path, ([], []))
        receiver = SyncReceiver(on_commit=lambda w: applied.append({n: t.cpu().clone() for n, t in named_tensors(w)})) \
            if layout.rank == 0 else None
        for precision, corrupt in [("bf16", None), ("fp8", None), ("bf16", "nan"), ("fp8", "nan"), ("fp8", "flip")]:
            config = BridgeConfig(bucket_size_mb=BUCKET_MB, policy=QuantizationPolicy(precision=precision))
            original = fc2.detach().clone()
            if corrupt == "nan" and layout.rank == tp - 1:
                with torch.no_grad():
                    fc2[3, 5] = float("nan")
            if corrupt == "flip" and receiver is not None:
                receiver.receive = _flipping_a_down_proj_byte(receiver)
            try:
                with WeightBridge(chunks, build, config, layout, receiver) as bridge:
                    bridge.sync(sync_id)
            except SyncError as err:
                errors.append(str(err))
            with torch.no_grad():
                fc2.copy_(original)
            if receiver is not None:
                vars(receiver).pop("receive", None)
            sync_id += 1
        if receiver is not None:
            receiver.close()
    return layout.rank, results


def _assert_refused(errors, rank, path):
    """Both NaN syncs and the flipped byte were refused on this rank, naming the tensor."""
    assert len(errors) == 3, (rank, path, errors)
    assert all("model.layers.1.mlp.down_proj.weight: " in e and "NaN/Inf" in e for e in errors[:2]), errors
    assert "model.layers.1.mlp.down_proj.weight: checksum" in errors[2], errors


@pytest.mark.slow
def test_torch_path_writes_what_the_host_kernels_write_and_refuses_nan(model_root):
    """The path GPU ranks take (torch ops where the shard lives, NaN counts and checksum sums read back once per
    bucket, the torch reference quantizer) writes exactly the host kernels' bytes and the same manifests, here at TP2
    with one KV head (pieces assembled in the scratch area) on CPU; a NaN in one rank's shard, or a byte flipped in
    the arena, refuses the sync on every rank, naming the tensor, and nothing is applied."""
    model = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    results = dict(spawn(2, _written_by_worker, model, ("host", "torch")))
    host, torch_path = results[0]["host"][0], results[0]["torch"][0]
    assert len(host) == len(torch_path) == 2  # bf16 then fp8; the corrupt syncs applied nothing
    for expected, got in zip(host, torch_path):
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[n].view(torch.uint8), got[n].view(torch.uint8)) for n in expected)
    assert any(t.dtype == torch.float8_e4m3fn for t in torch_path[1].values())
    for rank, per_path in results.items():
        for path, (_, errors) in per_path.items():
            _assert_refused(errors, rank, path)


@pytest.mark.slow
def test_one_pass_under_the_interpreter_syncs_and_refuses_nan(model_root, tmp_path):
    """The GPU's one-pass path (`kernels.bucket_pass`: one Triton launch per dtype group per bucket, figures in one
    device array read back once; the receiver's checksums one `sums` pass per bucket), run by Triton's interpreter
    on CPU tensors at TP2 with one KV head: BF16 and FP8 syncs write the host kernels' bytes bit for bit and commit
    (the fused sums agree end to end with the receiver's `sums` pass); a NaN in one rank's shard, or a byte flipped
    in the arena, is refused on every rank by name. The same with one pass on rank 0 only (it finishes buckets one
    late, the other rank at once: their collectives still match)."""
    pytest.importorskip("triton.language")
    model = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    # a fresh interpreter whose forkserver imports triton under TRITON_INTERPRET (this one's imported it without)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(here)), os.path.dirname(here), here])}
    out = tmp_path / "results.pt"
    script = ("import sys, torch; from distributed import spawn; from test_bridge_sync import _written_by_worker; "
              "torch.save(dict(spawn(2, _written_by_worker, sys.argv[1], ('host', 'one-pass', 'mixed'))), "
              "sys.argv[2])")
    run = subprocess.run([sys.executable, "-c", script, model, str(out)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = torch.load(out)
    host = results[0]["host"][0]
    assert any(t.dtype == torch.float8_e4m3fn for t in host[1].values())
    for path in ("one-pass", "mixed"):
        for expected, got in zip(host, results[0][path][0], strict=True):  # BF16, FP8
            assert expected.keys() == got.keys()
            assert all(torch.equal(expected[n].view(torch.uint8), got[n].view(torch.uint8)) for n in expected), path
    for rank, per_path in results.items():
        for path in ("one-pass", "mixed"):
            _assert_refused(per_path[path][1], rank, path)


@pytest.mark.gpu
def test_nan_on_a_gpu_rank_is_refused_by_name(model_root):
    """On a GPU rank the NaN count travels with the bucket's other figures (one read-back per bucket): the sync is
    still refused with the tensor's name and nothing is applied, while clean syncs go through."""
    assert torch.cuda.is_available()
    model = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    ((_, results),) = spawn(1, _written_by_worker, model, ("torch", "one-pass"), 1)
    (applied, errors), (one_pass, one_pass_errors) = results["torch"], results["one-pass"]
    for expected, got in zip(applied, one_pass):  # the kernel writes the torch path's bits on a GPU
        assert all(torch.equal(expected[n].view(torch.uint8), got[n].view(torch.uint8)) for n in expected)
    assert len(one_pass) == 2 and len(one_pass_errors) == 2
    assert len(applied) == 2 and any(t.dtype == torch.float8_e4m3fn for t in applied[1].values())
    assert len(errors) == 2 and all("model.layers.1.mlp.down_proj.weight: " in e and "NaN/Inf" in e for e in errors)


def _double_buffered_worker(hf_dir, parallel_flag, transport):
    """Four syncs into a double-buffered arena, the weights doubled before each later one; the second refused (a NaN
    in the other rank's shard). On the engine's rank: each committed sync's buffer ref and tensors, what the
    previous committed sync's buffer holds once the next one committed, and the refusals."""
    import torch.distributed as dist

    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.errors import SyncError
    from megatron_ais.engine.feeds.base import named_tensors

    chunks, build, layout = _bf16_model(hf_dir, parallel_flag)
    receiver = SyncReceiver(slots=2) if layout.rank == 0 else None
    config = BridgeConfig(bucket_size_mb=BUCKET_MB, policy=QuantizationPolicy(precision="bf16"), transport=transport)
    poisoned = next(p for p in chunks[0].parameters() if p.dim() == 2)
    synced, previous_after, refused = [], [], []
    with WeightBridge(chunks, build, config, layout, receiver) as bridge:
        for sync_id in range(4):
            with torch.no_grad():
                for chunk in chunks:
                    for parameter in chunk.parameters():
                        parameter.mul_(2 if sync_id else 1)  # exact in BF16
                original = poisoned.detach().clone()
                if sync_id == 1 and layout.rank == 1:
                    poisoned[0, 0] = float("nan")
            try:
                weights = bridge.sync(sync_id).committed
            except SyncError as err:
                refused.append((sync_id, str(err)))
                continue
            finally:
                with torch.no_grad():
                    poisoned.copy_(original)
            if receiver is not None:
                if synced:
                    previous_after.append({n: t.clone() for n, t in named_tensors(synced[-1][1])})
                synced.append((sync_id, weights, {n: t.clone() for n, t in named_tensors(weights)}))
            dist.barrier()  # the other ranks write the next sync once the engine's rank has read this one
    if receiver is None:
        return None
    result = ([(sync_id, weights.ref) for sync_id, weights, _ in synced],
              [(sync_id, tensors) for sync_id, _, tensors in synced], previous_after, refused)
    receiver.close()
    return result


@pytest.mark.parametrize("parallel_flag,transport", [("--tensor-model-parallel-size", "shm"),
                                                     ("--pipeline-model-parallel-size", "distributed")])
def test_double_buffered_syncs_never_write_the_committed_buffer(model_root, parallel_flag, transport):
    """With two slots (the asynchronous loop's arena) committed syncs alternate buffers, a refused sync (a NaN)
    between them too: each committed sync's tensors equal the weights it was given (HF tensors x 2^k, bit for bit),
    and once the next sync has committed, the buffer of the one before it (what the engines hold while it is
    written, and what an engine restarted meanwhile reloads) still holds exactly its weights."""
    model = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    refs, synced, previous_after, refused = spawn(2, _double_buffered_worker, model, parallel_flag, transport)[0]
    assert [sync_id for sync_id, _ in refused] == [1] and "NaN" in refused[0][1]
    assert [sync_id for sync_id, _ in refs] == [0, 2, 3]
    assert refs[0][1] != refs[1][1] and refs[2][1] == refs[0][1]
    source = HFCheckpointReader(model)
    for k, tensors in synced:
        assert sorted(tensors) == sorted(source.names())
        for name in source.names():
            assert torch.equal(tensors[name], source.get(name) * 2 ** k), (k, name)
    assert len(previous_after) == 2
    for (k, tensors), held in zip(synced, previous_after):
        assert all(torch.equal(held[name], tensors[name]) for name in held), k


def _four_bit_worker(hf_dir, tp, pp, transport):
    """What the bridge delivers under NVFP4 and MXFP4 from a BF16 model at TP x PP, buckets small enough to split
    the stage, and the buckets' first tensors."""
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.engine.feeds.base import named_tensors
    from megatron_ais.training import load_policy_chunks

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--tensor-model-parallel-size", tp,
                                      "--pipeline-model-parallel-size", pp, "--seq-length", 16)
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    layout = BridgeLayout.from_parallel_state()
    out = {}
    for sync_id, precision in enumerate(("nvfp4", "mxfp4")):
        applied = []
        receiver = SyncReceiver(on_commit=lambda w: applied.append({n: t.cpu().clone() for n, t in named_tensors(w)})) \
            if layout.rank == 0 else None
        config = BridgeConfig(bucket_size_mb=0.2, policy=QuantizationPolicy(precision=precision), transport=transport)
        with WeightBridge(chunks, build, config, layout, receiver) as bridge:
            bridge.sync(sync_id)
            firsts = [bridge.plan.tensors[b.first].name for b in bridge.plan.buckets]
            quantized = [name for writes in bridge.scratch_writes[0] if writes is not None
                         for piece in writes.pieces for name, _ in piece.sources]
        if receiver is not None:
            out[precision] = applied[0]
            receiver.close()
        out[precision + " buckets"], out[precision + " quantized"] = firsts, quantized
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, transport", [(2, 1, "shm"), (1, 2, "distributed")])
def test_4bit_syncs_deliver_the_engines_tensors_bit_for_bit(model_root, tp, pp, transport):
    """Each rank copies its pieces into the scratch region, then the stage's writers quantize whole tensors, each
    its share — an NVFP4 fused group (q/k/v, gate/up) with its one global scale, its members in one bucket — and the
    engine receives exactly `quantize_for_engine`'s tensors of the HF model."""
    from megatron_ais.bridge.quantization import QuantizationPolicy, fused_group, quantize_for_engine

    hf_dir = make_model_dir(model_root, "qwen3", num_key_value_heads=1, hidden_size=256, intermediate_size=512)
    results = spawn(2, _four_bit_worker, hf_dir, tp, pp, transport)
    source = HFCheckpointReader(hf_dir)
    for precision in ("nvfp4", "mxfp4"):
        expected = dict(quantize_for_engine(((n, source.get(n)) for n in source.names()),
                                            QuantizationPolicy(precision=precision)))
        got = results[0][precision]
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), \
                (precision, name)
        # several buckets, and none starts inside an NVFP4 fused group
        firsts = [name for result in results for name in result[precision + " buckets"]]
        assert len(firsts) > 2 * pp
        assert precision == "mxfp4" or all(fused_group(name)[0] == name for name in firsts), firsts
        # every 4-bit weight quantized once, at TP2 by both writers of the stage
        shares = [result[precision + " quantized"] for result in results]
        policy = QuantizationPolicy(precision=precision)
        assert sorted(sum(shares, [])) == sorted(n for n in source.names() if policy.quantizes(n))
        assert tp == 1 or all(shares), [len(share) for share in shares]
