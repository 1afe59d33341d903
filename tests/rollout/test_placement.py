"""The placement planner (`--print-placement`): which GPUs each engine takes, which rank drives it, what one
weight sync moves into each node and across nodes, and the layouts it refuses naming the flag; checked against
closed forms on the Qwen3-8B and Qwen3-30B-A3B configs shipped with the examples."""
import dataclasses
import functools
import json
import os

import pytest

from conftest import ROOT
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.model import ModelShape
from megatron_ais.parallel import ParallelLayout
from megatron_ais.rollout.placement import CUDA_CONTEXT_GIB, GIB, ClusterConfig, ModelBytes, plan_placement

GB = 1e9


def _shape(name):
    with open(os.path.join(ROOT, "examples", "models", name, "config.json")) as f:
        return ModelShape.from_hf_config(json.load(f))


QWEN3_8B, QWEN3_30B_A3B = _shape("qwen3-8b"), _shape("qwen3-30b-a3b")


def test_sync_bytes_are_two_per_parameter_in_bf16_and_one_per_linear_weight_in_fp8():
    for shape in (QWEN3_8B, QWEN3_30B_A3B):
        assert ModelBytes.of(shape, "bf16").sync == 2 * shape.num_parameters()
    fp8 = ModelBytes.of(QWEN3_8B, "fp8")
    h, layers = 4096, 36
    linear = layers * (h * 128 * (2 * 32 + 2 * 8) + 3 * h * 12288)
    rest = QWEN3_8B.num_parameters() - linear
    assert fp8.sync == pytest.approx(linear * (1 + 4 / 128 ** 2) + 2 * rest, abs=2)
    assert fp8.expert_sync == 0 and fp8.dense_parameters == QWEN3_8B.num_parameters()
    moe = ModelBytes.of(QWEN3_30B_A3B, "fp8")
    assert moe.expert_parameters == 48 * 128 * 3 * 2048 * 768
    assert moe.expert_sync == pytest.approx(moe.expert_parameters * (1 + 4 / 128 ** 2), abs=1)


def test_four_nodes_of_eight_two_engines_each_qwen3_8b():
    cluster = ClusterConfig(nodes=4, gpus_per_node=8, engines_per_node=2)
    plan = plan_placement(cluster, ParallelLayout(tensor=4), QWEN3_8B, mode="separate", rollout_tp=1,
                          precision="fp8", kv_cache_gb=40, distributed_optimizer=True)
    assert plan.trainer_world == 24 and plan.data_parallel == 6 and len(plan.engines) == 8
    assert [(e.node, e.gpus, e.host_rank) for e in plan.engines[:2]] == [(0, (6,), 0), (0, (7,), 1)]
    assert [e.host_rank for e in plan.engines] == [0, 1, 6, 7, 12, 13, 18, 19]  # a trainer rank on the engine's node
    sync = plan.model.sync
    # DP replica 0 (ranks 0-3, node 0) writes every shard; each other node's arena receives the whole sync once
    assert [n.written_here for n in plan.nodes] == [pytest.approx(sync, abs=4), 0, 0, 0]
    assert [n.received for n in plan.nodes] == [pytest.approx(0, abs=4)] + [sync] * 3
    assert plan.cross_node_bytes == pytest.approx(3 * sync, abs=4)
    # forwarded as a ring 0 -> 1 -> 2 -> 3: every link carries the sync once, the last node sends nothing
    assert [n.sent for n in plan.nodes] == [pytest.approx(sync, abs=4)] * 3 + [0]
    assert plan.sync_seconds == pytest.approx(sync / 50e9, rel=1e-6)
    # 8B at 1 byte + BF16 embeddings and head (2 x 151936 x 4096 x 2 bytes): ~9.4 GB
    assert 9.3 * GB < sync < 9.6 * GB
    assert plan.engine_gpu_gib == pytest.approx(sync / 2 ** 30 + 40 + 2)
    # a delta sync: a 4-byte position and the element per changed element (FP8 codes and scales, BF16 tensors)
    linear = 36 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 12288)
    elements = linear * (1 + 1 / 128 ** 2) + QWEN3_8B.num_parameters() - linear
    assert plan.model.sync_elements == pytest.approx(elements, abs=2)
    assert plan.model.delta_sync(0.01) == pytest.approx(0.01 * (sync + 4 * elements), abs=4)
    assert ModelBytes.of(QWEN3_8B, "bf16").sync_elements == QWEN3_8B.num_parameters()


def test_sixteen_nodes_of_eight_colocated_moe_splits_the_writers_over_nodes():
    cluster = ClusterConfig(nodes=16, gpus_per_node=8)
    layout = ParallelLayout(tensor=2, pipeline=4, expert=8, expert_tensor=1)
    plan = plan_placement(cluster, layout, QWEN3_30B_A3B, mode="colocated", rollout_tp=4, precision="fp8",
                          kv_cache_gb=16, distributed_optimizer=True)
    assert plan.trainer_world == 128 and plan.data_parallel == 16 and len(plan.engines) == 32
    assert [(e.node, e.gpus, e.host_rank) for e in plan.engines[:3]] == [(0, (0, 1, 2, 3), 0), (0, (4, 5, 6, 7), 4),
                                                                        (1, (0, 1, 2, 3), 8)]
    # a stage spans TP 2 x DP 16 = 32 ranks = 4 nodes; its writers (TP ranks 0-1 for dense, the first 8 for experts)
    # sit on the stage's first node: nodes 0, 4, 8 and 12 write a quarter of the sync each
    writers = [n.node for n in plan.nodes if n.written_here]
    assert writers == [0, 4, 8, 12]
    quarter = plan.nodes[0].written_here
    for node in plan.nodes:
        assert node.written_here + node.received == pytest.approx(plan.model.sync, abs=64)
        # four rings (one per writing node) over the 16 nodes: each node forwards every ring but the one it ends
        ends = sum(1 for source in writers if (source - 1) % 16 == node.node)
        assert node.sent == pytest.approx((4 - ends) * quarter, rel=0.05)
    assert plan.cross_node_bytes == pytest.approx(15 * plan.model.sync, abs=1024)


@pytest.mark.parametrize("kwargs,cluster,message", [
    (dict(mode="separate", rollout_tp=4), dict(engines_per_node=2),
     "--rollout-engines-per-node 2 x --rollout-tensor-parallel-size 4 = 8 GPUs leaves no GPU"),
    (dict(mode="separate", rollout_tp=3), {}, "--rollout-tensor-parallel-size 3 does not split the model's 32 "
                                              "attention heads"),
    (dict(mode="colocated", rollout_tp=16), {}, "--rollout-tensor-parallel-size 16 does not divide "
                                                 "--cluster-gpus-per-node 8"),
    (dict(mode="separate", rollout_tp=1, kv_cache_gb=100), {}, "over --cluster-gpu-memory-gb 80; raise "
                                                               "--rollout-tensor-parallel-size or lower"),
    (dict(mode="colocated", rollout_tp=1, kv_cache_gb=60), {}, "and its colocated engine"),
])
def test_impossible_layouts_are_refused_naming_the_flag(kwargs, cluster, message):
    with pytest.raises(ArgumentValidationError) as err:
        plan_placement(ClusterConfig(nodes=1, gpus_per_node=8, **cluster), ParallelLayout(tensor=1), QWEN3_8B,
                       precision="fp8", **{"kv_cache_gb": 8, **kwargs})
    assert message in str(err.value), str(err.value)


def test_a_gpu_arena_counts_its_buffers_and_the_contexts_of_the_processes_that_map_it_on_gpu_0():
    cluster = ClusterConfig(nodes=2, gpus_per_node=8, engines_per_node=2, gpu_memory_gb=48)
    plan_of = functools.partial(plan_placement, cluster, ParallelLayout(tensor=4), QWEN3_8B, mode="separate",
                                rollout_tp=1, precision="fp8", kv_cache_gb=8)
    host = plan_of()  # trainer rank 0: 8.2 B parameters over TP 4 x 18 bytes, 34 GiB; the arena in host memory
    assert host.arena_gpu_gib(0) == host.arena_gpu_gib(1) == 0.0
    one = plan_of(arena_slots=1)
    sync = one.model.sync / GIB
    # node 0: the arena's buffer and the contexts of its two engines (GPUs 6 and 7); node 1: its copy, two contexts
    assert one.arena_gpu_gib(0) == one.arena_gpu_gib(1) == pytest.approx(sync + 2 * CUDA_CONTEXT_GIB)
    with pytest.raises(ArgumentValidationError, match="--bridge-arena host"):
        plan_of(arena_slots=2)  # double-buffered (η >= 1): 34 + 2 x 8.8 + 1 > 48 GiB
    # double-buffered, node 1's copies are too (`NodeCopies`): two there as on node 0
    two = plan_placement(dataclasses.replace(cluster, gpu_memory_gb=80), ParallelLayout(tensor=4), QWEN3_8B,
                         mode="separate", rollout_tp=1, precision="fp8", kv_cache_gb=8, arena_slots=2)
    assert two.arena_gpu_gib(0) == two.arena_gpu_gib(1) == pytest.approx(2 * sync + 2 * CUDA_CONTEXT_GIB)


def test_a_world_the_trainer_layout_does_not_fit_names_the_parallel_flags():
    with pytest.raises(ArgumentValidationError, match="--tensor-model-parallel-size 4"):
        plan_placement(ClusterConfig(nodes=1, gpus_per_node=8, engines_per_node=2), ParallelLayout(tensor=4),
                       QWEN3_8B, mode="separate", rollout_tp=1, precision="fp8", kv_cache_gb=8)


def test_print_placement_runs_without_torchrun_and_starts_nothing(monkeypatch, capsys, tmp_path):
    import pretrain_grpo_ais

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    code = pretrain_grpo_ais.main([
        "--print-placement", "--hf-dir", os.path.join(ROOT, "examples", "models", "qwen3-30b-a3b"),
        "--cluster-nodes", "4", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4",
        "--expert-tensor-parallel-size", "1", "--rollout-engines-per-node", "2", "--rollout-tensor-parallel-size", "2",
        "--use-distributed-optimizer", "--seq-length", "4096", "--max-new-tokens", "3072", "--prompts-per-step", "128",
        "--group-size", "8", "--rollout-kv-cache-gb", "32", "--bridge-delta", "on", "--bridge-arena", "host",
        "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "--bridge-delta on: each other node's copy of the arena receives" in printed
    assert "staging arena in host memory (--bridge-arena host)" in printed
    assert "16 ranks = TP 2 x PP 1 x DP 8 (EP 4, expert-TP 1)" in printed and "engines: 8 x rollout TP 2" in printed
    assert "e1 (GPU 6-7, rank 1)" in printed and "across nodes per sync" in printed
    assert not out.exists()


@pytest.mark.parametrize("world,extra,message", [
    (1, (), "--rollout-engines-per-node 2 exceeds the 1 trainer ranks of the node"),
    (1, ("--rollout-placement", "colocated"), "--rollout-engines-per-node 2 with --rollout-placement colocated"),
    (4, ("--rollout-engines-per-node", "4", "--prompts-per-step", "2", "--micro-batch-size", "2"),
     "--rollout-engines-per-node 4 exceeds --prompts-per-step 2"),
])
def test_a_fleet_the_run_cannot_drive_is_refused(monkeypatch, capsys, tmp_path, world, extra, message):
    import pretrain_grpo_ais

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_grpo_ais.main(["--hf-dir", os.path.join(ROOT, "examples", "models", "qwen3-8b"),
                                "--rollout-engines-per-node", "2", *extra, "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_engines_take_gpus_of_their_own_when_the_node_has_them_else_their_host_ranks():
    from megatron_ais.rollout.fleet_layout import check_engine_gpus, engine_gpus

    # 4 trainer ranks on 8 GPUs: the engines on GPUs 4-7, as the planner places them
    assert [engine_gpus(k, 1, 4, 8) for k in range(4)] == [(4,), (5,), (6,), (7,)]
    assert [engine_gpus(k, 2, 4, 8) for k in range(2)] == [(4, 5), (6, 7)]
    plan = plan_placement(ClusterConfig(nodes=1, gpus_per_node=8, engines_per_node=2), ParallelLayout(tensor=2),
                          QWEN3_8B, mode="separate", rollout_tp=2, precision="fp8", kv_cache_gb=8)
    assert [e.gpus for e in plan.engines] == [engine_gpus(k, 2, 4, 8) for k in range(2)]
    # as many trainer ranks as GPUs: engine k from its host rank k's GPU on (one engine: GPU 0, as always)
    assert engine_gpus(0, 1, 8, 8) == (0,) and engine_gpus(3, 2, 8, 8) == (6, 7)
    for fits in ((4, 1, 4, 8), (2, 2, 4, 8), (1, 1, 1, 1), (8, 1, 8, 8), (4, 2, 8, 8)):
        check_engine_gpus(*fits)
    for engines, tp, trainer, gpus, where in ((3, 2, 4, 8, "its 4 GPU(s) beyond the 4 trainer ranks"),
                                              (5, 2, 8, 8, "its 8 GPUs"), (1, 2, 1, 1, "its 1 GPUs")):
        with pytest.raises(ArgumentValidationError) as refused:
            check_engine_gpus(engines, tp, trainer, gpus)
        assert f"= {engines * tp} GPUs do not fit the node's engines into {where}" in str(refused.value)


def test_engines_beyond_the_nodes_gpus_are_refused_before_anything_starts(monkeypatch, capsys, tmp_path):
    import torch

    import pretrain_grpo_ais

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "6"), ("LOCAL_WORLD_SIZE", "6")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_grpo_ais.main(["--hf-dir", os.path.join(ROOT, "examples", "models", "qwen3-8b"),
                                "--rollout-engines-per-node", "2", "--rollout-tensor-parallel-size", "2",
                                "--prompts-per-step", "6", "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert ("--rollout-engines-per-node 2 x --rollout-tensor-parallel-size 2 = 4 GPUs do not fit the node's engines "
            "into its 2 GPU(s) beyond the 6 trainer ranks (--nproc-per-node)") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
