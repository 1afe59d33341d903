"""The fp32 vLLM engine against the trainer: greedy generation equals transformers', and sampled-token log-probs
(T = 1 and T = 0.7) equal the Megatron trainer's teacher-forced log-probs after each of three consecutive
in-place updates through the bridge, on a tied-embedding model (a stale lm_head would fail this); seeded sampling
of more prompt tokens than a step takes runs and repeats; each prompt of a call samples from its own stream."""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [120, 3, 44, 250, 61]]


def _worker(hf_dir, work):

    from distributed import start_trainer
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.forward import ParallelGroups, compute_logprobs, split_micro_batches
    from megatron_ais.training import load_policy_chunks
    from megatron_ais.rollout.batching import rollouts_to_batch
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
    from megatron_ais.engine.config import EngineConfig

    engine = RolloutEngine(EngineConfig(model_dir=hf_dir, precision="fp32", kv_cache_gb=0.25,
                                        placement="colocated"), work)
    import vllm.envs

    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is False  # the model runner every engine test runs, pinned for GPUs
    greedy = [r.token_ids for r in engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=12))]
    # seeded sampling of more prompt tokens than one step takes (24 x 200 > 4096): vLLM 0.32's CPU runner crashed
    # when such a prefill was split over steps ("CPU Generator does not use offset"); the same seed, the same samples
    long_prompts = [[(7 * i + j) % 300 + 1 for j in range(200)] for i in range(24)]
    long_samples = [[r.token_ids for r in engine.generate(long_prompts, SamplingConfig(n=2, max_new_tokens=4, seed=3))]
                    for _ in range(2)]
    # each prompt has its own random stream: the same prompt twice in a call samples differently, and a prompt's
    # samples do not depend on the rest of the batch
    seeded = SamplingConfig(n=2, max_new_tokens=8, seed=5)
    twins = [r.token_ids for r in engine.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], seeded)]
    other_batch = [r.token_ids for r in engine.generate([PROMPTS[0], PROMPTS[2]], seeded)]
    shard = [r.token_ids for r in engine.generate([PROMPTS[2]], seeded, first_index=1)]
    streams = (twins[:2], twins[2:4], other_batch[:2], other_batch[2:4], shard)
    # every in-place reload runs under vLLM's current config, as its worker's own reload_weights sets it (what the
    # reload calls may ask get_current_vllm_config(), which raises outside)
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    under_config, reload = [], GPUModelRunner.reload_weights

    def recording(self, *args, **kwargs):
        under_config.append(get_current_vllm_config_or_none() is not None)
        return reload(self, *args, **kwargs)

    GPUModelRunner.reload_weights = recording
    trainer, hf_config, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", "40")
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    layout, groups = BridgeLayout.from_parallel_state(), ParallelGroups.from_parallel_state()
    receiver = SyncReceiver(on_commit=engine.update_weights)
    config = BridgeConfig(bucket_size_mb=1.0, policy=QuantizationPolicy(precision="fp32"))
    generator = torch.Generator().manual_seed(0)
    diffs = []
    bridge = WeightBridge(chunks, build, config, layout, receiver)
    for update in range(1, 4):
        with torch.no_grad():
            for param in chunks[0].parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
        bridge.sync(update)
        for temperature in (1.0, 0.7):
            rollouts = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=temperature, max_new_tokens=16,
                                                               seed=update))
            batch = rollouts_to_batch(rollouts, [0.0] * len(rollouts), 2, 40, 0)
            rows = {"tokens": batch.tokens, "labels": batch.labels}
            trainer = compute_logprobs(chunks, split_micro_batches(rows, 2), 40, 2, groups, build.shape.vocab_size,
                                       temperature)
            diff = ((trainer - batch.rollout_logprobs).abs() * batch.mask).max().item()
            diffs.append((update, temperature, diff, int(batch.mask.sum()), engine.version))
    bridge.close()
    return greedy, diffs, long_samples, streams, under_config


@pytest.mark.slow
def test_fp32_engine_matches_transformers_and_trainer_across_updates(model_root, tmp_path):
    from transformers import AutoModelForCausalLM

    # vLLM's CPU attention needs head_dim >= 32
    hf_dir = make_model_dir(model_root, "qwen3", tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    ((greedy, diffs, long_samples, (first, twin, elsewhere, second, shard), under_config),) = spawn(
        1, _worker, hf_dir, str(tmp_path))
    assert under_config == [True] * 3
    assert len(long_samples[0]) == 48 and long_samples[0] == long_samples[1]
    assert first == elsewhere and first != twin
    assert shard == second  # a share of the prompts (first_index) samples what the whole call did
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for prompt, got in zip(PROMPTS, greedy):
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        # all 12 tokens, unless the engine stopped at the end token
        assert got == ref[:len(got)] and (len(got) == 12 or got[-1] == model.config.eos_token_id), (got, ref)
    assert [d[:2] for d in diffs] == [(u, t) for u in (1, 2, 3) for t in (1.0, 0.7)]
    for update, temperature, diff, tokens, version in diffs:
        assert tokens > 20 and version == update
        assert diff <= 1e-4, f"update {update}, T={temperature}: max |engine - trainer| log-prob {diff:.2e}"
