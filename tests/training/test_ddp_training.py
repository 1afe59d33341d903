"""Three optimizer steps at DP2 through megatron DDP + optimizer: the first loss equals transformers' loss on
the same global batch, the loss decreases, and both replicas end bit-identical."""
import hashlib

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 48


def _global_batch(hf_dir, step):
    from megatron_ais.data.tasks import arithmetic_task
    from megatron_ais.sft import encode_sft_example, load_tokenizer, micro_batches

    tokenizer = load_tokenizer(hf_dir)
    examples = arithmetic_task(11, 99, train_size=GLOBAL_BATCH * 3, eval_size=8).train[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
    encoded = [encode_sft_example(tokenizer, e, SEQ) for e in examples]
    return micro_batches(encoded, list(range(GLOBAL_BATCH)), GLOBAL_BATCH)[0]


def _train_worker(hf_dir, precision, distributed_optimizer):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import build_parser, validate_args
    from megatron_ais.initialize import initialize_megatron
    from megatron_ais.sft import micro_batches
    from megatron_ais.training import lm_forward_step, reduce_lm_loss, setup_model_and_optimizer, train_step

    argv = ["--hf-dir", hf_dir, f"--{precision}", "--seq-length", str(SEQ), "--lr", "3e-3",
            "--micro-batch-size", str(MICRO_BATCH)]
    argv += ["--use-distributed-optimizer"] if distributed_optimizer else []
    args = build_parser("test").parse_args(argv)
    hf_config = validate_args(args, dist.get_world_size() if dist.is_initialized() else 2)
    initialize_megatron(args)
    setup = setup_model_and_optimizer(args, hf_config)
    chunks, ddp, optimizer = setup.chunks, setup.ddp_chunks, setup.optimizer
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(3):
        batch = _global_batch(hf_dir, step)
        rows = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
        encoded = [{k: v[i] for k, v in rows.items() if k != "position_ids"} for i in range(per_rank)]
        mbs = micro_batches(encoded, list(range(per_rank)), MICRO_BATCH)
        result = train_step(ddp, optimizer, lm_forward_step, iter(mbs), len(mbs), SEQ, MICRO_BATCH)
        assert result.update_successful
        losses.append(reduce_lm_loss(result.losses, ps.get_data_parallel_group()))
    digest = hashlib.sha1()
    for _, p in chunks[0].named_parameters():
        digest.update(p.detach().float().numpy().tobytes())
    return losses, digest.hexdigest(), type(optimizer).__name__


def _hf_token_mean_loss(hf_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                            reduction="none").view_as(batch["loss_mask"])
    return ((nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).item()


@pytest.mark.slow
@pytest.mark.parametrize("precision,distributed_optimizer", [("fp32", False), ("bf16", True)])
def test_three_steps_dp2(model_root, precision, distributed_optimizer):
    hf_dir = make_model_dir(model_root, "qwen2")
    (losses0, digest0, opt_name), (losses1, digest1, _) = spawn(2, _train_worker, hf_dir, precision,
                                                                distributed_optimizer)
    assert losses0 == losses1
    assert digest0 == digest1, "DP replicas diverged"
    assert losses0[2] < losses0[0] - 0.1, losses0
    reference = _hf_token_mean_loss(hf_dir, _global_batch(hf_dir, 0))
    tolerance = 1e-4 if precision == "fp32" else 5e-2
    assert abs(losses0[0] - reference) <= tolerance * max(1.0, abs(reference)), (losses0[0], reference)
