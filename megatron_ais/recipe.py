"""The GRPO + AIS training loop behind pretrain_grpo_ais.py: rollouts on vLLM, rewards, the megatron update with
the mismatch correction, the bridge sync into the engine, refit verification, evaluation and logging."""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time

import torch.distributed as dist


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the RL loop."""
    g = parser.add_argument_group("grpo loop")
    g.add_argument("--grpo-steps", type=int, default=10, help="Rollout batches (GRPO steps) to train on.")
    g.add_argument("--prompts-per-step", type=int, default=16, help="Prompts per rollout batch.")
    g.add_argument("--group-size", type=int, default=4, help="Responses sampled per prompt (the GRPO group).")
    g.add_argument("--max-new-tokens", type=int, default=16, help="Longest response.")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="Rollout sampling temperature (> 0); the trainer's log-probs use the same.")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="Rollout nucleus sampling. Below 1 only with --is-correction none: the engine's log-probs are "
                        "renormalised over the nucleus and the trainer's are not, so every importance ratio would "
                        "measure the truncation rather than the FP8 mismatch.")
    g.add_argument("--num-minibatches", type=int, default=1, help="Optimizer steps per rollout batch.")
    g.add_argument("--ppo-epochs", type=int, default=1, help="Passes over each rollout batch.")
    g.add_argument("--rollout-seed", type=int, default=None,
                   help="Seed of the rollout sampling (per step: derived from it and the step; default --seed). "
                        "Saved in checkpoints, so a resumed run samples what the uninterrupted run would have.")
    g.add_argument("--ref-load", default=None,
                   help="Checkpoint of the frozen reference policy for --kl-coef (default: the initial --load or "
                        "--hf-dir; a resumed run keeps the reference of its first start).")
    g.add_argument("--eval-interval", type=int, default=5, help="Evaluate held-out accuracy every this many steps.")
    g.add_argument("--eval-samples", type=int, default=8,
                   help="Samples per held-out prompt at the rollout temperature: eval/accuracy is their mean reward "
                        "(avg@k, what the policy actually does); eval/greedy_accuracy is reported beside it.")


def _prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _mean_reward(engine, tokenizer, examples, task, sampling) -> float:
    rollouts = engine.generate(_prompt_ids(tokenizer, [e.prompt for e in examples]), sampling, progress=False)
    rewards = [task.reward(tokenizer.decode(r.token_ids, skip_special_tokens=True), examples[r.prompt_index].answer)
               for r in rollouts]
    return sum(rewards) / len(rewards)


def evaluate(engine, tokenizer, task, args) -> dict[str, float]:
    """Held-out accuracy: mean reward of --eval-samples samples per prompt at the rollout temperature (fixed
    seed, so evaluations are comparable across steps), and greedy accuracy."""
    from megatron_ais.rollout.engine import SamplingConfig

    stop = (tokenizer.eos_token_id,)
    sampled = SamplingConfig(n=args.eval_samples, temperature=args.temperature, top_p=args.top_p,
                             max_new_tokens=args.max_new_tokens, stop_token_ids=stop, seed=args.seed)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
    return {"eval/accuracy": _mean_reward(engine, tokenizer, task.eval, task, sampled),
            "eval/greedy_accuracy": _mean_reward(engine, tokenizer, task.eval, task, greedy)}


# flags that may change between a run and its resumption without changing what it computes
RESUME_FREE_FLAGS = ("load", "save", "grpo_steps", "output_dir", "tensorboard_dir", "save_interval", "log_interval",
                     "keep_checkpoints", "eval_interval")
# flags whose saved values a resumed run keeps: its data order, sampling seeds and KL reference, and the optimizer's
# hyper-parameters (restored with its state, as there is no learning-rate schedule to override them)
RESUME_KEPT_FLAGS = ("seed", "rollout_seed", "ref_load", "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps")


def saved_flags(args) -> dict:
    """The flags a checkpoint records (every plain value, unset ones as None)."""
    return {k: v for k, v in vars(args).items() if v is None or isinstance(v, (int, float, str, bool))}


def changed_flags(saved: dict, args) -> list[str]:
    """Return `--flag saved -> now` for every flag that differs from the saved run (resume-free flags aside, and
    flags this entry point does not have); those whose saved value is kept say so."""
    current = vars(args)
    return [f"--{k.replace('_', '-')} {v!r} -> {current[k]!r}"
            + (" (ignored: the saved run's value is kept)" if k in RESUME_KEPT_FLAGS else "")
            for k, v in sorted(saved.items()) if k in current and k not in RESUME_FREE_FLAGS and current[k] != v]


def step_examples(task, args, data_seed: int, step: int) -> list:
    """The prompts of a step: they depend only on the data seed and the step."""
    return random.Random(data_seed * 100003 + step).sample(task.train, args.prompts_per_step)


def collect_rollouts(engine, tokenizer, task, sampling, args, step: int, data_seed: int, rollout_seed: int):
    """Sample this step's prompts, generate the group of responses per prompt and score them; return the
    RolloutBatch. Prompts and sampling depend only on the seeds and the step, so a resumed (or restarted) run
    continues the same stream."""
    from megatron_ais.rollout.batch import rollouts_to_batch

    examples = step_examples(task, args, data_seed, step)
    rollouts = engine.generate(_prompt_ids(tokenizer, [e.prompt for e in examples]),
                               dataclasses.replace(sampling, seed=rollout_seed * 100003 + step))
    rewards = [task.reward(tokenizer.decode(r.token_ids, skip_special_tokens=True), examples[r.prompt_index].answer)
               for r in rollouts]
    return rollouts_to_batch(rollouts, rewards, args.group_size, args.seq_length, tokenizer.pad_token_id)


def from_last_stage(obj):
    """Return the last pipeline stage's `obj` on every stage (log-probs, λ and losses exist only there; the
    logging rank is on the first stage)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    payload = [obj if ps.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(payload, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return payload[0]


def refit_precision(args) -> str:
    """Which tolerance row of the refit check applies: an FP8 KV cache rounds K and V like FP8 weights round the
    linear layers, so any engine with one is held to the FP8 engine's bound; an fp32 engine is compared with a BF16
    trainer's log-probs to the BF16 bound (the trainer's own rounding)."""
    if args.rollout_kv_cache_dtype == "fp8":
        return "fp8"
    if args.rollout_precision == "fp32" and args.precision == "bf16":
        return "bf16"
    return args.rollout_precision


def verify_refit_on_all_ranks(engine, ddp_chunks: list, probe: list[int], groups, vocab_size: int, precision: str,
                              engine_rank: int, moe: bool = False) -> float | None:
    """Score the probe on the trainer (every stage runs the pipeline schedule; the last stage's log-probs go to
    the first) and on the engine; a failed check names the first decoder layer whose output differs and raises
    on every rank, so no rank waits in the next collective. For MoE models, return (on the engine's rank) the
    fraction of probe (token, layer) pairs whose top-k experts differ between engine and trainer."""
    from megatron_ais.rollout.verify import (RefitVerificationError, layer_diagnosis, layer_errors, routing_mismatch,
                                             trainer_layer_states, trainer_probe_logprobs, trainer_routing,
                                             verify_refit)

    trainer = from_last_stage(trainer_probe_logprobs(ddp_chunks, probe, groups, vocab_size))
    error = [None]
    if engine is not None:
        try:
            verify_refit(engine.prompt_logprobs(probe), trainer, precision)
        except RefitVerificationError as err:
            error = [str(err)]
    dist.broadcast_object_list(error, src=engine_rank)
    if error[0]:
        # where does the engine's forward leave the trainer's? every rank takes part, the engine rank compares
        parts = [None] * dist.get_world_size() if dist.get_rank() == engine_rank else None
        dist.gather_object(trainer_layer_states(ddp_chunks, probe, groups, vocab_size), parts, dst=engine_rank)
        if engine is not None:
            trainer_states = {i: state for part in parts for i, state in part.items()}
            errors = layer_errors(engine.probe_layer_states(probe), [trainer_states[i] for i in sorted(trainer_states)])
            error = [error[0] + layer_diagnosis(errors, precision)]
        dist.broadcast_object_list(error, src=engine_rank)
        raise RefitVerificationError(error[0] + "; stopping")
    if not moe:
        return None
    parts = [None] * dist.get_world_size() if dist.get_rank() == engine_rank else None
    dist.gather_object(trainer_routing(ddp_chunks, probe, groups, vocab_size), parts, dst=engine_rank)
    if engine is None:
        return None
    maps = {i: routing_map for part in parts for i, routing_map in part.items()}
    return routing_mismatch(engine.probe_routing(probe), [maps[i] for i in sorted(maps)])


def validate_grpo_args(args, world_size: int) -> None:
    """Check the loop's flags before anything heavy starts (after `validate_args`): counts, the rollout batch's
    split into data-parallel shares, mini-batches and micro-batches, and every config the flags build."""
    from megatron_ais.ais import AISConfig
    from megatron_ais.arguments import ArgumentValidationError, model_parallel_size
    from megatron_ais.bridge.sync import BridgeConfig
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.rollout.engine import engine_config_from_args

    for name in ("grpo-steps", "prompts-per-step", "num-minibatches", "ppo-epochs", "max-new-tokens", "eval-interval",
                 "eval-samples", "eval-prompts", "num-examples"):
        value = getattr(args, name.replace("-", "_"))
        if value < 1:
            raise ArgumentValidationError(f"--{name} {value} must be at least 1")
    if args.temperature <= 0:
        raise ArgumentValidationError(f"--temperature {args.temperature} must be > 0 (the trainer's log-probs are "
                                      "log_softmax(logits / temperature))")
    if not 0 < args.top_p <= 1:
        raise ArgumentValidationError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.top_p < 1 and args.is_correction != "none":
        raise ArgumentValidationError(
            f"--top-p {args.top_p} with --is-correction {args.is_correction}: the engine's log-probs are renormalised "
            "over the nucleus and the trainer's are not, so the importance ratios would measure the truncation; use "
            "--top-p 1 or --is-correction none")
    if args.group_size < 2:
        raise ArgumentValidationError(f"--group-size {args.group_size}: GRPO's advantages compare the responses to "
                                      "one prompt, so a group needs at least 2")
    if args.max_new_tokens >= args.seq_length:
        raise ArgumentValidationError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the prompt in "
                                      f"--seq-length {args.seq_length}; raise --seq-length or lower --max-new-tokens")
    dp = world_size // model_parallel_size(args)
    sequences = args.prompts_per_step * args.group_size
    if sequences % dp:
        raise ArgumentValidationError(
            f"a rollout batch of --prompts-per-step {args.prompts_per_step} x --group-size {args.group_size} = "
            f"{sequences} sequences does not split over {dp} data-parallel ranks; use a multiple of {dp}")
    per_rank = sequences // dp
    if per_rank % args.num_minibatches:
        raise ArgumentValidationError(
            f"{per_rank} sequences per data-parallel rank do not split into --num-minibatches {args.num_minibatches} "
            "equal mini-batches; change --num-minibatches or --prompts-per-step")
    if (per_rank // args.num_minibatches) % args.micro_batch_size:
        raise ArgumentValidationError(
            f"mini-batches of {per_rank // args.num_minibatches} sequences per data-parallel rank are not a multiple "
            f"of --micro-batch-size {args.micro_batch_size} (every micro-batch must be full: pipeline stages "
            "exchange fixed shapes); change --micro-batch-size or the batch flags")
    if args.rollout_placement == "colocated" and world_size > 1:
        raise ArgumentValidationError("--rollout-placement colocated needs a single-rank trainer (an in-process vLLM "
                                      "engine owns torch.distributed); use --rollout-placement separate")
    if args.rollout_tensor_parallel_size > 1 and args.rollout_placement == "colocated":
        raise ArgumentValidationError("--rollout-tensor-parallel-size > 1 needs --rollout-placement separate (vLLM's "
                                      "own worker processes form the engine's tensor-parallel group)")
    if args.rollout_weight_feed == "broadcast" and args.rollout_placement == "colocated":
        raise ArgumentValidationError("--rollout-weight-feed broadcast feeds a separate engine's workers; a colocated "
                                      "engine takes the arena's tensors in process: drop the flag or use "
                                      "--rollout-placement separate")
    try:
        PolicyLossConfig.from_args(args)
        AISConfig.from_args(args)
        BridgeConfig.from_args(args)
        engine_config_from_args(args, args.hf_dir or "")
    except ValueError as err:
        raise ArgumentValidationError(str(err)) from err


def _reference_source(args, loaded) -> dict:
    """Where the frozen KL reference comes from: --ref-load, else what this run started from; a checkpoint with the
    iteration it had then, so that a resumed run (whose --load has newer iterations, perhaps its own) keeps it."""
    from megatron_ais.checkpointing import usable_iterations

    if args.ref_load:
        return {"load": args.ref_load, "iteration": usable_iterations(args.ref_load)[0]}
    return {"load": args.load, "iteration": loaded.iteration} if args.load else {"hf_dir": args.hf_dir}


def _protected_iterations(reference_source: dict, save: str | None) -> tuple[int, ...]:
    """The iterations of --save that pruning must keep: the KL reference's, when it lives there."""
    load, iteration = reference_source.get("load"), reference_source.get("iteration")
    if save and load and iteration is not None and os.path.realpath(load) == os.path.realpath(save):
        return (iteration,)
    return ()


def run_grpo(args) -> dict:
    """Run the loop; return the summary (written by the logging rank)."""
    from megatron.core import parallel_state as ps

    from megatron_ais.ais import AISConfig, AISState
    from megatron_ais.arguments import validate_args
    from megatron_ais.bridge.sync import BridgeConfig, BridgeLayout, WeightBridge
    from megatron_ais.bridge.transport import SyncReceiver
    from megatron_ais.checkpointing import CheckpointRanks, checkpoint_metadata, save_checkpoint
    from megatron_ais.data.tasks import build_task
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.grpo.step import GRPOConfig, ParallelGroups, grpo_train_step
    from megatron_ais.initialize import initialize_megatron
    from megatron_ais.logging import RunLogger, grpo_console_line
    from megatron_ais.mapping.distributed import save_hf_checkpoint
    from megatron_ais.rollout.engine import RolloutEngine, SamplingConfig, engine_config_from_args
    from megatron_ais.rollout.kv_scales import KVCacheScales, calibrate_kv_cache_scales, rollout_sequences
    from megatron_ais.rollout.verify import probe_tokens
    from megatron_ais.sft import load_tokenizer
    from megatron_ais.training import build_reference_chunks, setup_model_and_optimizer

    start = time.time()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    hf_config = validate_args(args, world_size)
    validate_grpo_args(args, world_size)
    task = build_task(args)  # bad task flags or prompt files fail before anything heavy starts
    if len(task.train) < args.prompts_per_step:
        from megatron_ais.data.tasks import TaskError
        raise TaskError(f"--prompts-per-step {args.prompts_per_step} exceeds the {len(task.train)} training "
                        "examples of the task; lower it or raise --num-examples")
    initialize_megatron(args)
    setup = setup_model_and_optimizer(args, hf_config, run_kind="grpo")
    resumed = setup.run_state or {}
    start_step = resumed.get("step", 0)
    data_seed = resumed.get("data_seed", args.seed)
    rollout_seed = resumed.get("rollout_seed", args.seed if args.rollout_seed is None else args.rollout_seed)
    reference_source = resumed.get("reference_source") or _reference_source(args, setup.loaded)
    build, groups = setup.build, ParallelGroups.from_parallel_state()
    ranks = CheckpointRanks.from_parallel_state()
    layout = BridgeLayout.from_parallel_state()
    is_engine_rank = layout.rank == layout.engine_rank
    tp_group = ps.get_tensor_model_parallel_group()
    reference = build_reference_chunks(args, build, reference_source) if args.kl_coef else None
    tokenizer = load_tokenizer(setup.assets_dir)
    if data_seed != args.seed:
        task = build_task(argparse.Namespace(**{**vars(args), "seed": data_seed}))
    # a resumed run's logs continue from the checkpoint: later steps logged before the crash are dropped
    log = RunLogger(args.output_dir, args.tensorboard_dir, is_engine_rank,
                    resume_step=start_step if setup.run_state is not None else None)
    # the engine starts from an HF export of the initial policy, written one file per pipeline stage
    init_dir = os.path.join(args.output_dir, "engine_init")
    save_hf_checkpoint(setup.chunks, build, hf_config, init_dir, tp_group, ps.get_pipeline_model_parallel_group(),
                       is_stage_writer=layout.is_sender, assets_from=setup.assets_dir)
    engine = None
    if is_engine_rank:
        engine = RolloutEngine(engine_config_from_args(args, init_dir), os.path.join(args.output_dir, "engine"),
                               placement=args.rollout_placement)
    dist.barrier()
    grpo = GRPOConfig(loss=PolicyLossConfig.from_args(args), correction=AISConfig.from_args(args),
                      vocab_size=build.shape.vocab_size, micro_batch_size=args.micro_batch_size,
                      num_minibatches=args.num_minibatches, ppo_epochs=args.ppo_epochs,
                      advantage_normalize_std=not args.advantage_no_std,
                      advantage_leave_one_out=args.advantage_leave_one_out, temperature=args.temperature)
    state = AISState()
    state.load_state_dict(resumed.get("ais_state", {}))
    probe = probe_tokens(build.shape.vocab_size)
    sampling = SamplingConfig(n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    history = list(resumed.get("history", []))

    receiver = None
    if is_engine_rank:
        def apply(named_tensors, shared=None):
            # an engine that died meanwhile is restarted and given the same complete set of weights
            def restarting(err):
                log.info(f"the rollout engine died during a weight sync ({type(err).__name__}: {err}); restarting "
                         "it and re-syncing the current weights")
            return engine.update_weights_or_restart(named_tensors, on_restart=restarting, shared=shared)
        receiver = SyncReceiver(apply=apply, apply_shared=(lambda path, entries: apply(None, (path, entries)))
                                if engine.placement == "separate" else None)
    weight_bridge = WeightBridge(setup.chunks, build, BridgeConfig.from_args(args), layout, receiver)

    def sync_engine(sync_id: int) -> None:
        """Bridge the current policy into the engine (collective on every rank)."""
        stats = weight_bridge.sync(sync_id)
        if layout.is_sender and weight_bridge.completed == 1:
            log.info(f"bridge: {stats.tensors} tensors in {stats.buckets} buckets, {stats.bytes / 1e6:.1f} MB from "
                     f"this stage by {stats.transport}, {stats.seconds:.2f} s")

    def recalibrate_kv_cache(sequences: list[list[int]]) -> KVCacheScales | None:
        """FP8 KV cache: measure the synced policy's K/V scales on `sequences` (split over DP ranks; collective on
        every rank) and install them in the engine."""
        if args.rollout_kv_cache_dtype != "fp8":
            return None
        scales = calibrate_kv_cache_scales(setup.ddp_chunks, sequences[:args.rollout_kv_cache_calibration_sequences],
                                           args.seq_length, args.micro_batch_size, groups, build.shape.vocab_size,
                                           build.shape.num_layers, args.rollout_kv_cache_scale_margin)
        if engine is not None:
            engine.set_kv_cache_scales(scales)
        return scales

    def step_prompts(step: int) -> list[list[int]]:
        return _prompt_ids(tokenizer, [e.prompt for e in step_examples(task, args, data_seed, step)])

    if setup.run_state is not None:
        log.info(f"resuming GRPO at step {start_step + 1} from {args.load} (iteration {setup.loaded.iteration})")
        changed = changed_flags(resumed.get("args", {}), args)
        if changed:
            log.info("flags that differ from the saved run: " + ", ".join(changed))
        before = resumed.get("eval_before", {})
        # the engine holds what the bridge would have sent after the saved step, with the KV-cache scales the
        # uninterrupted run measured then (on that step's rollouts)
        sync_engine(start_step)
        saved_scales = resumed.get("kv_cache_scales")
        if saved_scales is not None and args.rollout_kv_cache_dtype == "fp8":
            kv_cache_scales = KVCacheScales(tuple(tuple(row) for row in saved_scales))
            if engine is not None:
                engine.set_kv_cache_scales(kv_cache_scales)
        else:
            kv_cache_scales = recalibrate_kv_cache(step_prompts(start_step + 1))
    else:
        kv_cache_scales = recalibrate_kv_cache(step_prompts(start_step + 1))
        before = evaluate(engine, tokenizer, task, args) if is_engine_rank else {}
    accuracy_before = before.get("eval/accuracy")
    for step in range(start_step + 1, args.grpo_steps + 1):
        t0 = time.time()
        batch = None
        for attempt in range(2):
            outcome, failure = [None], None
            if is_engine_rank:
                try:
                    outcome = [collect_rollouts(engine, tokenizer, task, sampling, args, step, data_seed,
                                                rollout_seed)]
                except Exception as err:  # vLLM raises many kinds of errors when its engine core dies
                    failure = err
                    if attempt == 0 and not engine.health_check():
                        log.info(f"step {step}: the rollout engine died ({type(err).__name__}: {err}); restarting "
                                 "it and re-syncing the current weights")
                        engine.restart()
                        outcome = ["restarted"]
                    else:
                        outcome = [f"step {step}: rollout generation failed: {type(err).__name__}: {err}"]
            # every rank learns the outcome, so a failure stops all of them instead of leaving them in a collective
            dist.broadcast_object_list(outcome, src=layout.engine_rank)
            if not isinstance(outcome[0], str):
                batch = outcome[0]
                break
            if outcome[0] != "restarted":
                raise RuntimeError(outcome[0]) from failure
            sync_engine(step - 1)
        t_rollout = time.time() - t0
        result = grpo_train_step(setup.ddp_chunks, setup.optimizer, batch, grpo, state, groups, reference)
        t_train = time.time() - t0 - t_rollout
        sync_engine(step)
        kv_cache_scales = recalibrate_kv_cache(rollout_sequences(batch.tokens, batch.mask,
                                                                 args.rollout_kv_cache_calibration_sequences))
        routing = None
        if args.verify_refit_interval and step % args.verify_refit_interval == 0:
            routing = verify_refit_on_all_ranks(engine, setup.ddp_chunks, probe, groups, build.shape.vocab_size,
                                                refit_precision(args), layout.engine_rank, build.shape.is_moe)
        t_sync = time.time() - t0 - t_rollout - t_train
        metrics = from_last_stage(dict(result.metrics))
        if routing is not None:
            metrics["rollout/routing_mismatch"] = routing
        if kv_cache_scales is not None:
            metrics.update({"rollout/kv_cache_k_scale_max": max(k for _, k, _ in kv_cache_scales.scales),
                            "rollout/kv_cache_v_scale_max": max(v for _, _, v in kv_cache_scales.scales)})
        metrics.update({"rollout/reward": float(batch.rewards.mean()), "time/rollout_s": t_rollout,
                        "time/train_s": t_train, "time/sync_s": t_sync,
                        "rollout/tokens_per_s": float(batch.mask.sum()) / max(t_rollout, 1e-9)})
        if is_engine_rank and (step % args.eval_interval == 0 or step == args.grpo_steps):
            try:
                metrics.update(evaluate(engine, tokenizer, task, args))
            except Exception as err:  # a dead engine is restarted (and re-synced) at the next rollout
                if engine.health_check():
                    raise
                log.info(f"step {step}: the rollout engine died during evaluation ({type(err).__name__}); "
                         "skipping this evaluation")
        history.append({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        console = step % args.log_interval == 0 or step == args.grpo_steps
        log.step(step, metrics, f"{grpo_console_line(step, metrics)} | reward {metrics['rollout/reward']:.3f} "
                                f"acc {metrics.get('eval/accuracy', float('nan')):.3f} | "
                                f"{metrics['rollout/tokens_per_s']:.0f} tok/s | rollout {t_rollout:.1f}s train "
                                f"{t_train:.1f}s sync {t_sync:.1f}s" if console else None)
        if args.save and (step == args.grpo_steps or (args.save_interval and step % args.save_interval == 0)):
            run_state = {"kind": "grpo", "step": step, "ais_state": state.state_dict(), "data_seed": data_seed,
                         "rollout_seed": rollout_seed, "consumed_prompts": step * args.prompts_per_step,
                         "reference_source": reference_source, "history": history, "eval_before": before,
                         "args": saved_flags(args),
                         "kv_cache_scales": None if kv_cache_scales is None else list(kv_cache_scales.scales)}
            save_checkpoint(args.save, step, setup.chunks, checkpoint_metadata(args, build, hf_config, step),
                            setup.assets_dir, ranks, optimizer=setup.optimizer, run_state=run_state,
                            dp_group=ps.get_data_parallel_group(), keep=args.keep_checkpoints,
                            protect=_protected_iterations(reference_source, args.save) if args.kl_coef else ())
            log.info(f"saved checkpoint {args.save} iteration {step}")
    summary = {"accuracy_before": accuracy_before, "greedy_accuracy_before": before.get("eval/greedy_accuracy"),
               "accuracy_after": next((h["eval/accuracy"] for h in reversed(history) if "eval/accuracy" in h),
                                      accuracy_before),
               "steps": args.grpo_steps, "wall_s": time.time() - start, "history": history}
    log.summary(summary)
    if is_engine_rank and history:
        from megatron_ais.logging import plot_run
        plot_run(history, os.path.join(args.output_dir, "run.png"), accuracy_before)
    log.close()
    weight_bridge.close()
    if engine is not None:
        engine.shutdown()
        receiver.close()
    return summary
