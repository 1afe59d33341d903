"""Resuming from a checkpoint continues training exactly: at DP2, in both formats (torch, torch_dist), with
megatron's plain optimizer (fp32) and the distributed optimizer (bf16), two steps after a save-and-resume equal the
same two steps of an uninterrupted run bit for bit (losses and every parameter), so the optimizer moments, Adam's
step count and RNG all came back. The same for a Qwen3-MoE model at EP2, whose checkpoint has one directory per
expert-parallel rank (each with its own experts: `mp_rank_00_000`, `mp_rank_00_001`)."""
import hashlib
import os

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 48


def _worker(hf_dir, precision, distributed_optimizer, save_dir, resume, extra=(), export_dir=None, fmt="torch"):
    import random

    import torch
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.checkpointing.config import checkpoint_metadata
    from megatron_ais.checkpointing.ranks import CheckpointRanks
    from megatron_ais.checkpointing.store import FORMATS, save_checkpoint
    from megatron_ais.data.tasks import arithmetic_task
    from megatron_ais.hf_assets import load_tokenizer
    from megatron_ais.sft import encode_sft_example, example_micro_batches
    from megatron_ais.training import lm_forward_step, reduce_lm_loss, setup_model_and_optimizer, train_step

    argv = ["--hf-dir", hf_dir, f"--{precision}", "--seq-length", str(SEQ), "--lr", "3e-3",
            "--micro-batch-size", str(MICRO_BATCH)]
    argv += ["--use-distributed-optimizer"] if distributed_optimizer else []
    argv += ["--load", save_dir] if resume else []
    argv += list(extra)
    trainer, hf_config, build = start_trainer(*argv)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, run_kind="test")
    start = setup.run_state["step"] if resume else 0
    if export_dir:  # the trainer's own HF export of what it loaded: the reference for the offline converter
        from megatron_ais.mapping.distributed import save_hf_checkpoint

        save_hf_checkpoint(setup.chunks, setup.build, hf_config, export_dir, ps.get_tensor_model_parallel_group(),
                           ps.get_pipeline_model_parallel_group(),
                           ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0,
                           assets_from=hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    examples = arithmetic_task(11, 99, train_size=GLOBAL_BATCH * 4, eval_size=8).train
    dp_rank = ps.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // ps.get_data_parallel_world_size()
    losses, draws = [], []
    for step in range(start, 4):
        rows = examples[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH][dp_rank * per_rank:(dp_rank + 1) * per_rank]
        encoded = [encode_sft_example(tokenizer, e, SEQ) for e in rows]
        mbs = example_micro_batches(encoded, list(range(per_rank)), MICRO_BATCH)
        result = train_step(setup.ddp_chunks, setup.optimizer, lm_forward_step, iter(mbs), len(mbs), SEQ, MICRO_BATCH)
        losses.append(reduce_lm_loss(result.losses, ps.get_data_parallel_group()))
        draws.append((random.random(), torch.rand(1).item()))  # RNG streams must continue across the resume
        if step == 1 and not resume:
            metadata = checkpoint_metadata(build, hf_config, 2, ps.get_data_parallel_world_size(),
                                           distributed_optimizer)
            save_checkpoint(save_dir, 2, setup.chunks, metadata,
                            hf_dir, CheckpointRanks.from_parallel_state(), optimizer=setup.optimizer,
                            run_state={"kind": "test", "step": 2}, dp_group=ps.get_data_parallel_group(),
                            fmt=FORMATS[fmt])
    digest = hashlib.sha1()
    for _, p in setup.chunks[0].named_parameters():
        digest.update(p.detach().float().numpy().tobytes())
    return losses[-2:], draws[-2:], digest.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("precision,distributed_optimizer", [("fp32", False), ("bf16", True)])
def test_resume_is_bit_exact_dp2(model_root, tmp_path, precision, distributed_optimizer, fmt):
    hf_dir = make_model_dir(model_root, "qwen2")
    save_dir = str(tmp_path / "ckpt")
    uninterrupted = spawn(2, _worker, hf_dir, precision, distributed_optimizer, save_dir, False, (), None, fmt)
    if fmt == "torch_dist":  # the two data-parallel replicas shared the writing (fully parallel save)
        written = os.listdir(os.path.join(save_dir, "iter_0000002", "model"))
        assert {name[:3] for name in written if name.endswith(".distcp")} == {"__0", "__1"}, written
    resumed = spawn(2, _worker, hf_dir, precision, distributed_optimizer, save_dir, True, (), None, fmt)
    for rank in range(2):
        assert resumed[rank][0] == uninterrupted[rank][0], "losses after the resume differ"
        assert resumed[rank][1] == uninterrupted[rank][1], "RNG streams were not restored"
        assert resumed[rank][2] == uninterrupted[rank][2], "parameters after the resume differ"


@pytest.mark.slow
def test_torch_dist_resume_at_pp2_restores_each_stage_random_state(model_root, tmp_path):
    """Each pipeline stage draws from its own random streams (megatron seeds them apart): a torch_dist checkpoint
    keeps every rank's, and a resume at the saved layout continues each stage's."""
    hf_dir = make_model_dir(model_root, "qwen2")
    save_dir, pp2 = str(tmp_path / "ckpt"), ("--pipeline-model-parallel-size", "2")
    uninterrupted = spawn(2, _worker, hf_dir, "fp32", True, save_dir, False, pp2, None, "torch_dist")
    assert uninterrupted[0][1] != uninterrupted[1][1], "the stages' random streams were not apart"
    resumed = spawn(2, _worker, hf_dir, "fp32", True, save_dir, True, pp2, None, "torch_dist")
    for rank in range(2):
        assert resumed[rank] == uninterrupted[rank]


@pytest.mark.slow
@pytest.mark.parametrize("precision,distributed_optimizer", [("fp32", False), ("bf16", True)])
def test_resume_is_bit_exact_moe_ep2(model_root, tmp_path, precision, distributed_optimizer):
    hf_dir = make_model_dir(model_root, "qwen3_moe", initializer_range=0.1)
    save_dir = str(tmp_path / "ckpt")
    ep2 = ("--expert-model-parallel-size", "2")
    uninterrupted = spawn(2, _worker, hf_dir, precision, distributed_optimizer, save_dir, False, ep2)
    assert sorted(d for d in os.listdir(os.path.join(save_dir, "iter_0000002")) if d.startswith("mp_rank")) == [
        "mp_rank_00_000", "mp_rank_00_001"]
    resumed = spawn(2, _worker, hf_dir, precision, distributed_optimizer, save_dir, True, ep2)
    for rank in range(2):
        assert resumed[rank][0] == uninterrupted[rank][0], "losses after the resume differ"
        assert resumed[rank][1] == uninterrupted[rank][1], "RNG streams were not restored"
        assert resumed[rank][2] == uninterrupted[rank][2], "parameters after the resume differ"


@pytest.mark.slow
@pytest.mark.parametrize("tp,directories", [
    (2, ["mp_rank_00_000", "mp_rank_01_001"]),
    # expert-TP x EP < TP: expert-data-parallel rank 0 holds TP ranks 0 and 1 only; ranks 2 and 3 write theirs
    (4, ["mp_rank_00_000", "mp_rank_01_001", "mp_rank_02_000", "mp_rank_03_001"])])
def test_resume_is_bit_exact_moe_ep2_expert_tp1(model_root, tmp_path, tp, directories):
    """Expert-TP 1 under TP2 and TP4 at EP2 on four ranks (the production recipe's shape): whole experts per rank,
    dense weights split over TP; every TP rank's dense shard is saved, the resumed run continues bit for bit on all
    four ranks, and the offline converter reads that checkpoint into exactly the trainer's own HF export."""
    from safetensors.torch import load_file

    import convert_checkpoint

    hf_dir = make_model_dir(model_root, "qwen3_moe", initializer_range=0.1)
    save_dir, export_dir = str(tmp_path / "ckpt"), str(tmp_path / "live_export")
    flags = ("--tensor-model-parallel-size", str(tp), "--sequence-parallel", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1")
    uninterrupted = spawn(4, _worker, hf_dir, "fp32", False, save_dir, False, flags)
    assert sorted(d for d in os.listdir(os.path.join(save_dir, "iter_0000002")) if d.startswith("mp_rank")) == \
        directories
    resumed = spawn(4, _worker, hf_dir, "fp32", False, save_dir, True, flags, export_dir)
    for rank in range(4):
        assert resumed[rank][0] == uninterrupted[rank][0], "losses after the resume differ"
        assert resumed[rank][2] == uninterrupted[rank][2], "parameters after the resume differ"
    converted = convert_checkpoint.megatron_to_hf(save_dir, str(tmp_path / "converted"))

    def tensors(directory):
        out = {}
        for name in os.listdir(directory):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(directory, name)))
        return out

    live, offline = tensors(export_dir), tensors(converted)
    assert sorted(live) == sorted(offline) and any(".experts.7." in n for n in live)
    for name, tensor in live.items():
        assert torch.equal(offline[name], tensor), name
