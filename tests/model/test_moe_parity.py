"""Qwen3-MoE in megatron-core (local spec, SequentialMLP experts, alltoall dispatcher): logits after loading the HF
weights equal transformers' fp32 forward at EP1, EP2 and EP2xTP2; experts numbered by their local index instead of
their global one (the classic expert-parallel loading bug) are caught."""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from test_hf_parity import TOLERANCE, _pipeline_logits


def _moe_worker(hf_dir, tp, ep, local_numbering=False):
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from distributed import start_trainer
    from megatron_ais.mapping.distributed import load_hf_weights
    from megatron_ais.model import build_model_chunks, unwrap_model

    _, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", tp,
                                "--expert-model-parallel-size", ep, "--seq-length", 16, "--transformer-impl", "local",
                                *(["--sequence-parallel"] if tp > 1 else []))
    chunks = build_model_chunks(build)
    layers = unwrap_model(chunks[0]).decoder.layers
    experts = [list(layer.mlp.local_expert_indices) for layer in layers]
    if local_numbering:
        for layer in layers:
            layer.mlp.local_expert_indices = list(range(len(layer.mlp.local_expert_indices)))
    load_hf_weights(chunks, hf_dir, build, ps.get_tensor_model_parallel_rank())
    tokens = torch.randint(0, build.shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = _pipeline_logits(chunks, tokens)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(tokens).logits
    diff = (logits[..., : build.shape.vocab_size] - ref).abs().max().item()
    on = next(chunks[0].parameters()).device.type
    ps.destroy_model_parallel()
    return diff, experts[0], type(layers[0].mlp.experts).__name__, on


@pytest.fixture(scope="module")
def moe_dir(model_root):
    # std 0.1 so that router logits are far from ties (exact parity needs the same top-k on both sides)
    return make_model_dir(model_root, "qwen3_moe", num_layers=2, initializer_range=0.1)


def test_moe_logits_equal_hf_at_ep1(moe_dir):
    ((diff, experts, kind, on),) = spawn(1, _moe_worker, moe_dir, 1, 1)
    assert kind == "SequentialMLP" and experts == list(range(8)) and on == "cpu"
    assert diff <= TOLERANCE


@pytest.mark.gpu
def test_moe_logits_equal_hf_on_the_gpu(moe_dir):
    """On a CUDA machine megatron builds and runs the model on the GPU (local spec, no Transformer Engine)."""
    ((diff, experts, kind, on),) = spawn(1, _moe_worker, moe_dir, 1, 1)
    assert kind == "SequentialMLP" and experts == list(range(8)) and on == "cuda"
    assert diff <= TOLERANCE


@pytest.mark.slow
def test_moe_logits_equal_hf_at_ep2_and_local_numbering_is_caught(moe_dir):
    results = spawn(2, _moe_worker, moe_dir, 1, 2)
    assert sorted(e for _, e, _, _ in results) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each rank holds its own experts
    assert all(diff <= TOLERANCE for diff, *_ in results)
    wrong = spawn(2, _moe_worker, moe_dir, 1, 2, True)
    assert all(diff > 100 * TOLERANCE for diff, *_ in wrong)


@pytest.mark.slow
def test_moe_logits_equal_hf_at_ep2_tp2(moe_dir):
    results = spawn(4, _moe_worker, moe_dir, 2, 2)
    assert all(diff <= TOLERANCE for diff, *_ in results)
