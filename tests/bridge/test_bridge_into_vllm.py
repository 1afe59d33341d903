"""The bridge's tensors load through the real vLLM loader: an FP8 engine keeps float8 linear weights and, after a
sync of new weights, scores like transformers on the dequantized new weights, several times closer than on the
unquantized ones, and the trainer under QaRL's rollout-aligned forward scores like those too (its k3 against the
engine falls tenfold); a tampered sync is refused and the engine keeps its weights. (An fp32 engine fed by the bridge
scores exactly like transformers and the trainer: tests/rollout/test_engine.py.)"""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

PROBE = list(range(5, 45))


def _hf_logprobs(state_dict, hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].double(), -1)
    return logp[:-1].gather(-1, torch.tensor(PROBE[1:])[:, None])[:, 0].float()


def _k3(trainer, engine):
    """Schulman's k3 estimate of KL(engine ‖ trainer) on the probe's tokens: mean of r − 1 − log r, r = π/μ."""
    log_ratio = (trainer - engine).double()
    return (log_ratio.exp() - 1 - log_ratio).mean().item()


def _engine_worker(old_dir, new_dir, work):

    from kernels.fp8.format import blockwise_fp8_dequantize
    from distributed import start_trainer
    from megatron_ais.bridge.aligned_forward import RolloutAlignedForward
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.refit_probe import trainer_probe_logprobs
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.errors import SyncError
    from megatron_ais.training import load_policy_chunks
    from megatron_ais.engine.vllm_engine import RolloutEngine
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.engine.feeds.base import named_tensors

    engine = RolloutEngine(EngineConfig(model_dir=old_dir, precision="fp8", kv_cache_gb=0.25,
                                        placement="colocated"), work)
    float8_layers = sorted({n.rsplit(".", 1)[0] for n, p in engine.model.named_parameters()
                            if p.dtype == torch.float8_e4m3fn})
    before = engine.prompt_logprobs(PROBE)
    trainer, hf_config, build = start_trainer("--hf-dir", new_dir, "--fp32", "--seq-length", "64")
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    layout = BridgeLayout.from_parallel_state()
    applied = []

    def apply(weights):
        applied.append({n: t.clone() for n, t in named_tensors(weights)})
        engine.update_weights(weights)

    receiver = SyncReceiver(on_commit=apply)
    config = BridgeConfig(bucket_size_mb=0.5, policy=QuantizationPolicy(precision="fp8"))
    bridge = WeightBridge(chunks, build, config, layout, receiver)
    bridge.sync(1)
    after = engine.prompt_logprobs(PROBE)
    # the trainer's log-probs on the probe, with its own weights and with the engine's (QaRL's aligned forward)
    groups = ParallelGroups.from_parallel_state()
    standard = trainer_probe_logprobs(chunks, PROBE, groups, build.shape.vocab_size)
    with RolloutAlignedForward.from_parallel_state(chunks, build, config.policy, activations=False)():
        aligned = trainer_probe_logprobs(chunks, PROBE, groups, build.shape.vocab_size)
    sent = applied[0]
    reference_weights = {n: blockwise_fp8_dequantize(t, sent[n + "_scale_inv"], 128, torch.float32)
                         if t.dtype == torch.float8_e4m3fn else t.float()
                         for n, t in sent.items() if not n.endswith("_scale_inv")}

    # a bucket altered after its manifest was made, or announced with a wrong shape, is refused and nothing is
    # applied
    import dataclasses

    original = SyncReceiver.receive
    refused = []

    def flip_byte(self, sync_id, stage, manifest):
        entry = next((e for e in manifest if e.name.endswith("mlp.down_proj.weight")), None)
        if entry is not None:
            self.window(stage, entry.offset, entry.offset + entry.nbytes)[7] ^= 0x10
        return original(self, sync_id, stage, manifest)

    def wrong_shape(self, sync_id, stage, manifest):
        manifest = [dataclasses.replace(e, shape=e.shape[::-1]) if e.name.endswith("mlp.down_proj.weight")
                    else e for e in manifest]
        return original(self, sync_id, stage, manifest)

    for sync_id, tamper in ((2, flip_byte), (3, wrong_shape)):
        SyncReceiver.receive = tamper
        try:
            bridge.sync(sync_id)
            refused.append(None)
        except SyncError as err:
            refused.append(str(err))
        finally:
            SyncReceiver.receive = original
    bridge.close()
    still = engine.prompt_logprobs(PROBE)
    # plain arrays: tensors shared through the result queue would need this process alive to be read
    arrays = {n: t.numpy() for n, t in reference_weights.items()}
    return (float8_layers, before.numpy(), after.numpy(), still.numpy(), arrays, refused, len(applied),
            standard.numpy(), aligned.numpy())


@pytest.mark.slow
def test_bridge_into_real_vllm_engine(model_root, tmp_path, cpu_fp8_path):
    from megatron_ais.mapping.hf_io import HFCheckpointReader
    from megatron_ais.rollout.verify import RefitVerificationError, verify_refit

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512)
    old_dir = make_model_dir(model_root, "qwen3", seed=1, **shape)
    new_dir = make_model_dir(model_root, "qwen3", seed=2, **shape)
    ((float8_layers, before, after, still, weights, refused, applied, standard, aligned),) = spawn(
        1, _engine_worker, old_dir, new_dir, str(tmp_path))
    before, after, still = torch.from_numpy(before), torch.from_numpy(after), torch.from_numpy(still)
    reference = _hf_logprobs({n: torch.from_numpy(a) for n, a in weights.items()}, new_dir)
    source = HFCheckpointReader(new_dir)
    unquantized = _hf_logprobs({n: source.get(n) for n in source.names()}, new_dir)
    assert any("qkv_proj" in n for n in float8_layers) and any("down_proj" in n for n in float8_layers)
    # bf16 activations on fp8 weights vs fp32 on the same dequantized weights (docs/rollout.md; 0.033 measured); the
    # unquantized new weights explain the engine six times worse (0.207): the reference sees the sent codes and scales
    diff, unquantized_diff = (after - reference).abs().mean().item(), (after - unquantized).abs().mean().item()
    assert diff <= 0.1 and diff < unquantized_diff / 3, (diff, unquantized_diff)
    assert (before - reference).abs().mean() > 10 * diff, "the sync was not applied"
    flipped, reshaped = refused
    assert "down_proj.weight: checksum" in flipped and "down_proj.weight: manifest says" in reshaped and applied == 1
    assert verify_refit(after, reference, "fp8").passed
    with pytest.raises(RefitVerificationError, match="stale or corrupt"):
        verify_refit(before, reference, "fp8")
    assert torch.equal(still, after), "a refused sync must leave the engine's weights untouched"
    # QaRL's rollout-aligned forward scores like transformers on the sent weights (each code x scale rounded to BF16,
    # as the engine's W8A16 layers hold them), and the trainer-engine k3 drops
    standard, aligned = torch.from_numpy(standard), torch.from_numpy(aligned)
    engine_weights = _hf_logprobs({n: torch.from_numpy(a).bfloat16() for n, a in weights.items()}, new_dir)
    assert (aligned - engine_weights).abs().max() < 1e-3 and (standard - unquantized).abs().max() < 1e-3
    k3_standard, k3_aligned = _k3(standard, after), _k3(aligned, after)
    assert k3_aligned < k3_standard / 10, (k3_aligned, k3_standard)
