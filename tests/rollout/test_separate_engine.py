"""A separate-process vLLM engine: bridge sync with the workers mapping the shared staging arena, generation with
log-probs equal to the trainer's, a killed engine detected, restarted and re-synced over the broadcast feed group
(every worker verifies what it receives; a corrupted feed is refused and the weights stay), and no orphan
processes after shutdown."""
import dataclasses
import time

import pytest

from conftest import make_model_dir
from distributed import spawn

PROMPTS = [[5, 17, 42, 99], [7, 8, 9]]


def _max_diff(engine, chunks, build, groups):
    from megatron_ais.grpo.step import split_micro_batches, compute_logprobs
    from megatron_ais.rollout.batch import rollouts_to_batch
    from megatron_ais.rollout.engine import SamplingConfig

    rollouts = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=12, seed=3))
    batch = rollouts_to_batch(rollouts, [0.0] * len(rollouts), 2, 32, 0)
    trainer = compute_logprobs(chunks, split_micro_batches({"tokens": batch.tokens, "labels": batch.labels}, 2), 32, 2,
                               groups, build.shape.vocab_size)
    return ((trainer - batch.rollout_logprobs).abs() * batch.mask).max().item()


def _worker(old_dir, new_dir, work):
    import psutil

    from megatron_ais.arguments import build_parser, validate_args
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.sync import BridgeConfig, BridgeLayout, WeightBridge
    from megatron_ais.bridge.transport import SyncReceiver
    from megatron_ais.grpo.step import ParallelGroups
    from megatron_ais.initialize import initialize_megatron
    from megatron_ais.model import ModelBuildConfig
    from megatron_ais.training import build_loaded_chunks
    from megatron_ais.rollout.engine import EngineConfig, RolloutEngine

    args = build_parser("test").parse_args(["--hf-dir", new_dir, "--fp32", "--seq-length", "32"])
    hf_config = validate_args(args, 1)
    initialize_megatron(args)  # the trainer owns torch.distributed; the engine lives in its own processes
    build = ModelBuildConfig.from_args(args, hf_config)
    chunks, _, _ = build_loaded_chunks(args, build)
    layout, groups = BridgeLayout.from_parallel_state(), ParallelGroups.from_parallel_state()
    engine = RolloutEngine(EngineConfig(model_dir=old_dir, precision="fp32", kv_cache_gb=0.25), work,
                           placement="separate")
    config = BridgeConfig(bucket_size_mb=1.0, policy=QuantizationPolicy(precision="fp32"))
    fed = []

    def apply_shared(path, entries):
        fed.append((path, entries))
        return engine.update_weights(None, shared=(path, entries))

    receiver = SyncReceiver(apply=engine.update_weights, apply_shared=apply_shared)
    bridge = WeightBridge(chunks, build, config, layout, receiver)

    def sync(sync_id):
        bridge.sync(sync_id)

    before_sync = _max_diff(engine, chunks, build, groups)
    sync(1)
    after_sync = _max_diff(engine, chunks, build, groups)
    me = psutil.Process()

    def engine_processes():
        found = []
        for child in me.children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE and any(
                        "VLLM" in part or "EngineCore" in part for part in [child.name()] + child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    started = [p.name() for p in engine_processes()]
    for child in engine_processes():
        child.kill()
    time.sleep(1)
    alive_after_kill = engine.health_check()
    engine.restart()
    alive_after_restart = engine.health_check()
    after_restart = _max_diff(engine, chunks, build, groups)
    engine.config = dataclasses.replace(engine.config, weight_feed="broadcast")
    sync(2)
    after_resync = _max_diff(engine, chunks, build, groups)
    # a feed whose bytes do not match their entry is refused by the worker, before anything is applied
    path, entries = fed[-1]
    corrupted = [dataclasses.replace(e, checksum=e.checksum ^ 1) if e.name.endswith("mlp.up_proj.weight") else e
                 for e in entries]
    try:
        engine.update_weights(None, shared=(path, corrupted))
        refused = None
    except Exception as err:  # the worker's error comes back through collective_rpc
        refused = str(err)
    after_refused = _max_diff(engine, chunks, build, groups)
    engine.shutdown()
    bridge.close()
    receiver.close()
    time.sleep(2)
    orphans = [p.name() for p in engine_processes()]
    assert started, "the separate engine must run in its own processes"
    return (before_sync, after_sync, alive_after_kill, alive_after_restart, after_restart, after_resync, refused,
            after_refused, orphans)


@pytest.mark.slow
def test_separate_engine_sync_kill_restart_resync(model_root, tmp_path):
    shape = dict(hidden_size=128, intermediate_size=256)
    old_dir = make_model_dir(model_root, "qwen3", seed=1, **shape)
    new_dir = make_model_dir(model_root, "qwen3", seed=2, **shape)
    ((before, after, alive_killed, alive_restarted, restarted, resynced, refused, after_refused, orphans),) = spawn(
        1, _worker, old_dir, new_dir, str(tmp_path))
    assert before > 0.1 and after <= 1e-4
    assert not alive_killed and alive_restarted
    assert restarted > 0.1, "a restarted engine starts from its initial weights"
    assert resynced <= 1e-4, "the re-sync over the broadcast feed group must apply the trainer's weights"
    assert refused is not None and "up_proj.weight: checksum" in refused
    assert after_refused <= 1e-4
    assert orphans == []
