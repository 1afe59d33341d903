"""The torch_dist format through the store: a model saved at TP2 loads at TP1 x PP2 (megatron-core reshards) with
the log-probs of the same weights built directly at that layout; every .distcp file is checksummed, and a damaged
one is refused and the previous iteration loaded."""
import contextlib
import io
import json
import os

import pytest

from conftest import make_model_dir
from distributed import spawn

SEQ = 16


def _worker(hf_dir, root, flags, save):
    import contextlib
    import io

    import torch

    from distributed import start_trainer
    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.formats import torch_dist
    from megatron_ais.checkpointing.ranks import CheckpointRanks
    from megatron_ais.forward import ParallelGroups, compute_logprobs, split_micro_batches
    from megatron_ais.training import setup_model_and_optimizer

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--seq-length", str(SEQ), "--fp32", *flags)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, run_kind="test")
    tokens = torch.randint(0, build.shape.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(0))
    rows = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}

    def logprobs():
        return compute_logprobs(setup.ddp_chunks, split_micro_batches(rows, 2), SEQ, 2,
                                ParallelGroups.from_parallel_state(), build.shape.vocab_size)

    ranks = CheckpointRanks.from_parallel_state()
    if save:
        for iteration in (1, 2):
            store.save_checkpoint(root, iteration, setup.chunks, {"hf_config": {}}, None, ranks,
                                  run_state={"kind": "test", "step": iteration}, fmt=torch_dist)
        return None
    direct = logprobs()  # the HF weights built at this layout: the independent reference
    with torch.no_grad():
        for chunk in setup.chunks:
            for p in chunk.parameters():
                p.zero_()
    warnings = io.StringIO()  # the rank's own stderr: a forkserver started by an earlier test escapes capfd
    with contextlib.redirect_stderr(warnings):
        loaded = store.load_checkpoint(root, ranks, fmt=torch_dist)
    torch_dist.load_model_state(setup.chunks, loaded.directory)
    return loaded.iteration, loaded.run_state, direct, logprobs(), warnings.getvalue()


@pytest.mark.slow
def test_saved_at_tp2_loads_at_pp2_and_a_damaged_shard_falls_back(model_root, tmp_path):
    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.formats import torch_dist

    hf_dir = make_model_dir(model_root, "qwen3")
    root = str(tmp_path / "ckpt")
    spawn(2, _worker, hf_dir, root, ("--tensor-model-parallel-size", "2"), True)
    newest = store.iteration_dir(root, 2)
    listed = sorted(json.load(open(os.path.join(newest, store.CHECKSUMS))))
    assert listed == torch_dist.rank_files(newest) and sum(n.endswith(".distcp") for n in listed) >= 2
    shard = os.path.join(newest, "model", "__1_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    results = spawn(2, _worker, hf_dir, root, ("--pipeline-model-parallel-size", "2"), False)
    iteration, run_state, direct, resharded, _ = results[1]  # the last pipeline stage holds the log-probs
    assert iteration == 1 and run_state == {"kind": "test", "step": 1}
    assert f"refusing checkpoint iteration 2: {shard} does not match its sha256" in results[0][-1]  # rank 0 warns
    assert (direct - resharded).abs().max().item() <= 1e-6 and direct.abs().min() > 0
