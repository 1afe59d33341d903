"""QaRL's rollout-aligned forward (`bridge.aligned_forward`): the trainer computes with exactly the weights a sync
sends the engine — checked against the codes and scales `quantize_for_engine` writes, dequantized by vLLM's own
references — its FP8 activations are the GPU's dynamic quantizer's (vLLM's CUDA kernel, written out), the gradient
is the one at the quantized weights (straight through to masters that come back bit for bit), and TP2 / PP2 score
like transformers on the engine's weights. (That the trainer–engine k3 drops: test_bridge_into_vllm.py.)"""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from quantized_references import group_round_trip, reference_dequantized

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
PROBE = list(range(5, 45))


def _hf_layer(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512)}
    named = [(f"model.layers.0.{m}.weight", (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16))
             for m, s in shapes.items()]
    return named + [("model.layers.0.input_layernorm.weight", torch.ones(256, dtype=torch.bfloat16))]


@pytest.mark.parametrize("precision", ["fp8", "nvfp4", "mxfp4"])
def test_engine_weights_are_the_sent_codes_dequantized(precision):
    from megatron_ais.bridge.aligned_forward import engine_weights
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine

    policy = QuantizationPolicy(precision=precision)
    named = _hf_layer(3)
    reference = reference_dequantized(dict(quantize_for_engine(named, policy)), precision)
    aligned = dict(engine_weights(named, policy))
    assert list(aligned) == [name for name, _ in named]
    for name, tensor in named:
        assert aligned[name].dtype == tensor.dtype
        assert torch.equal(aligned[name], reference[name]), name
        if "layernorm" not in name:  # a quantized weight moved, by at most a rounding step (4-bit: amax / 6)
            error = (aligned[name].float() - tensor.float()).abs().max().item()
            assert 0 < error < 0.2 * tensor.float().abs().max().item(), (name, error)
    fp32 = dict(engine_weights([(n, t.float()) for n, t in named], policy))
    assert all(t.dtype == torch.float32 for t in fp32.values())


def test_activation_round_trip_is_the_gpus_dynamic_fp8_quantizer():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from kernels.fp8.format import per_token_group_fp8_round_trip

    with set_current_vllm_config(VllmConfig()):
        native = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=False)
    g = torch.Generator().manual_seed(0)
    for k in (256, 200):
        x = (torch.randn(3, 5, k, generator=g) * torch.logspace(-4, 2, 5)[:, None]).to(torch.bfloat16)
        x[1, 2] = 0
        assert torch.equal(per_token_group_fp8_round_trip(x), group_round_trip(x)), k
        # vLLM's own native path agrees on the rows whose groups' amax is at least 1/512 (its scale floor)
        codes, scales = native.forward_native(x[:, 2:].reshape(-1, k))
        expanded = scales.float().repeat_interleave(128, dim=-1)[:, :k]
        native_rows = (codes.float() * expanded).to(torch.bfloat16).reshape(x[:, 2:].shape)
        assert torch.equal(per_token_group_fp8_round_trip(x[:, 2:]), native_rows), k


def _gradients_worker(hf_dir, precision, activations):
    """Model A under the aligned forward, model B holding the reference engine weights (and the GPU's quantizer on
    the same layers' inputs): the loss and every gradient, and A's weights after the context."""
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.bridge.aligned_forward import RolloutAlignedForward
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.mapping.distributed import export_hf_weights, shard_context
    from megatron_ais.mapping.hf_io import global_parameters, megatron_shard_from_hf
    from megatron_ais.model import unwrap_model
    from megatron_ais.training import load_policy_chunks

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--seq-length", "64")
    policy = QuantizationPolicy(precision=precision)
    (a,), _, _ = load_policy_chunks(build, trainer.weights)
    (b,), _, _ = load_policy_chunks(build, trainer.weights)
    tp = ps.get_tensor_model_parallel_group()
    sent = dict(quantize_for_engine(list(export_hf_weights([b], build, tp)), policy))
    engine = reference_dequantized(sent, precision)
    with torch.no_grad():
        for name, layer, param in global_parameters(unwrap_model(b)):
            param.copy_(megatron_shard_from_hf(name, layer, build.shape.model_type, shard_context(build, 0),
                                               engine.__getitem__, build.shape.tie_word_embeddings))
    if activations:
        def round_input(module, inputs):
            x, *rest = inputs
            return (x + (group_round_trip(x) - x).detach(), *rest)

        for name, module in b.named_modules():
            if name.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
                module.register_forward_pre_hook(round_input)
    tokens = torch.tensor([PROBE[:-1], PROBE[1:]])
    labels = torch.tensor([PROBE[1:], PROBE[:-1]])

    def loss_and_grads(model):
        model.zero_grad()
        logits = unwrap_model(model)(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)
        loss = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    masters = {n: p.detach().clone() for n, p in a.named_parameters()}
    standard_loss, standard = loss_and_grads(a)
    aligned = RolloutAlignedForward.from_parallel_state([a], build, policy, activations)
    with aligned():
        aligned_loss, aligned_grads = loss_and_grads(a)
    reference_loss, reference = loss_and_grads(b)
    restored = all(torch.equal(p, masters[n]) for n, p in a.named_parameters())
    same = [n for n in reference if torch.equal(aligned_grads[n], reference[n])]
    moved = [n for n in reference if not torch.equal(standard[n], aligned_grads[n])]
    return (aligned_loss.item(), reference_loss.item(), standard_loss.item(), restored, same, moved,
            sorted(reference))


@pytest.mark.parametrize("precision,activations", [("fp8", True), ("nvfp4", False)])
def test_gradient_is_the_one_at_the_engines_weights_and_masters_come_back(model_root, precision, activations):
    hf_dir = make_model_dir(model_root, "qwen3", seed=4, **SHAPE)
    ((aligned, reference, standard, restored, same, moved, names),) = spawn(1, _gradients_worker, hf_dir, precision,
                                                                            activations)
    assert aligned == reference and aligned != standard, (aligned, reference, standard)
    assert sorted(same) == names, sorted(set(names) - set(same))
    assert any("linear_qkv" in n for n in moved) and any("linear_fc2" in n for n in moved)
    assert restored, "the master weights must come back bit for bit"


def _parity_worker(hf_dir, tp, pp, *flags):
    from distributed import start_trainer
    from megatron_ais.bridge.aligned_forward import RolloutAlignedForward
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.refit_probe import trainer_probe_logprobs
    from megatron_ais.training import load_policy_chunks

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", "64",
                                      "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp, *flags)
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    groups = ParallelGroups.from_parallel_state()
    aligned = RolloutAlignedForward.from_parallel_state(chunks, build, QuantizationPolicy(precision="mxfp4"), False)
    with aligned():
        logprobs = trainer_probe_logprobs(chunks, PROBE, groups, build.shape.vocab_size)
    return None if logprobs is None else logprobs.numpy()


@pytest.mark.slow
def test_tp2_and_pp2_score_like_transformers_on_the_engines_weights(model_root):
    from transformers import AutoModelForCausalLM

    from megatron_ais.bridge.aligned_forward import engine_weights
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.mapping.hf_io import HFCheckpointReader

    hf_dir = make_model_dir(model_root, "qwen3", seed=5, **SHAPE)
    source = HFCheckpointReader(hf_dir)
    policy = QuantizationPolicy(precision="mxfp4")
    weights = [(n, source.get(n).float()) for n in source.names()]
    engine = reference_dequantized(dict(quantize_for_engine(weights, policy)), "mxfp4")
    assert all(torch.equal(engine[n].float(), t) for n, t in engine_weights(weights, policy) if policy.quantizes(n))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({n: t.float() for n, t in engine.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # the engine's weights, all
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].double(), -1)
    reference = logp[:-1].gather(-1, torch.tensor(PROBE[1:])[:, None])[:, 0].float()
    # TP2 with sequence parallelism, whose split of the positions over TP needs the odd-length probe padded
    for tp, pp, *flags in ((2, 1, "--sequence-parallel"), (1, 2)):
        logprobs = [torch.from_numpy(r) for r in spawn(2, _parity_worker, hf_dir, tp, pp, *flags) if r is not None]
        assert logprobs and all((lp - reference).abs().max() < 2e-4 for lp in logprobs), (tp, pp)
