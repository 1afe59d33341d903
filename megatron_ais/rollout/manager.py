"""The engine's rank's side of the GRPO loop: the rollout engine with its prompts, rewards, evaluation and restart
policy. Prompts and sampling seeds depend only on the seeds and the step, so a resumed (or restarted) run continues
the same stream; an engine that dies is restarted with the weights and KV-cache scales it had, and the step goes on."""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

from megatron_ais.batch import RolloutBatch
from megatron_ais.engine.turns import EngineTurns
from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
from megatron_ais.errors import ArgumentValidationError, EngineRetiredError, EngineTimeoutError, RolloutError
from megatron_ais.rollout.batching import rollouts_to_batch
from megatron_ais.rollout.dynamic_sampling import stream_seed
from megatron_ais.rollout.overlong import OverlongConfig, shape_overlong
from megatron_ais.rollout.repetition import repeats_an_ngram
from megatron_ais.rollout.rewards import RewardScorer, Scores
from megatron_ais.rollout.verify import RefitReference


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The chat-templated token ids of user prompts, ready for generation."""
    if not prompts:
        return []
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True) for prompt in prompts]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def check_prompt_lengths(tokenizer, task, max_new_tokens: int, seq_length: int, max_model_len: int) -> None:
    """Every prompt the run can draw (training and held-out, chat-templated) leaves room for --max-new-tokens in
    the trainer's --seq-length and in the engine's --rollout-max-model-len; checked before the run starts."""
    longest = max(len(ids) for ids in prompt_ids(tokenizer, sorted({e.prompt for e in task.train + task.eval})))
    for flag, limit, need in (("--seq-length", seq_length, longest + max_new_tokens - 1),
                              ("--rollout-max-model-len", max_model_len, longest + max_new_tokens)):
        if limit < need:
            raise ArgumentValidationError(
                f"{flag} {limit} is too short: the task's longest prompt has {longest} tokens (chat template "
                f"included) and --max-new-tokens is {max_new_tokens}; raise {flag} to {need} or lower --max-new-tokens")


def step_example_indices(examples: int, prompts_per_step: int, data_seed: int, step: int, round_index: int = 0
                         ) -> list[int]:
    """Which of `examples` training examples make a step's prompts (of its `round_index`-th round with
    --dynamic-sampling): they depend only on the data seed, the step and the round. A later round draws from the
    examples no earlier round of the step drew (from all of them once too few remain), so a step never trains twice
    on one example's groups."""
    drawn: set[int] = set()
    for index in range(round_index + 1):
        pool = [i for i in range(examples) if i not in drawn]
        if len(pool) < prompts_per_step:
            pool = list(range(examples))
        # sampling indices picks what sampling the examples themselves did (round 0: the stream before rounds)
        chosen = random.Random(stream_seed(data_seed, step, index)).sample(pool, prompts_per_step)
        drawn.update(chosen)
    return chosen


def step_examples(task, prompts_per_step: int, data_seed: int, step: int, round_index: int = 0) -> list:
    """The training examples of a step's prompts (`step_example_indices`)."""
    return [task.train[i] for i in step_example_indices(len(task.train), prompts_per_step, data_seed, step,
                                                        round_index)]


def step_prompt_ids(tokenizer, task, prompts_per_step: int, data_seed: int, step: int) -> list[list[int]]:
    """The token ids of a step's prompts."""
    return prompt_ids(tokenizer, [e.prompt for e in step_examples(task, prompts_per_step, data_seed, step)])


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """What the rollouts and evaluations of a run sample: prompts per step, the group's sampling, evaluation's
    samples and seed, the sequence length rollouts are padded to."""

    prompts_per_step: int
    sampling: SamplingConfig
    eval_samples: int
    eval_seed: int
    seq_length: int
    # the batch (whole groups) with its rows' group advantages: the engine's host computes them (the loop passes
    # `grpo.advantages.with_advantages` with the run's options)
    with_advantages: Callable[[RolloutBatch], RolloutBatch]
    routing_replay: bool = False  # MoE: the engine routes every rollout once more for the trainer to replay
    overlong: OverlongConfig = OverlongConfig()  # responses that reach --max-new-tokens
    policy_versions: bool = False  # record which step's weights sampled each token (--max-off-policy-steps > 0)
    partial_rollouts: bool = False  # a weight sync interrupts a generation, resumed on its weights (--partial-rollouts)


@dataclasses.dataclass(frozen=True)
class ServingPolicy:
    """How hard a manager keeps its engine serving: restarts over the run, and how long one generate call may take
    (seconds; None: no limit)."""

    max_restarts: int = 3
    generation_timeout_s: float | None = None


class RolloutManager:
    """Lives on an engine's host rank: generates and scores the prompts of each step it is given (a range of the
    step's prompt indices), evaluates its share of the held-out prompts and applies weight syncs. An engine that dies
    (or runs past the generation timeout) is restarted and, once its refit check passes, asked again while
    `policy.max_restarts` lasts; after that it is shut down and EngineRetiredError raised (`log` tells the user)."""

    def __init__(self, engine: RolloutEngine, tokenizer, task, plan: RolloutPlan, data_seed: int, rollout_seed: int,
                 log: Callable[[str], None], scorer: RewardScorer, policy: ServingPolicy = ServingPolicy()):
        self.engine, self.tokenizer, self.task, self.plan = engine, tokenizer, task, plan
        self.data_seed, self.rollout_seed, self.log, self.scorer = data_seed, rollout_seed, log, scorer
        self.policy, self.restarts = policy, 0
        self.refit_reference: RefitReference | None = None  # of the weights the engine holds, set at each sync
        self.restarted_unchecked = False  # restarted while its reference awaited the MoE routes' replay
        self.turns = EngineTurns()  # generations (the background worker's, the main thread's) and syncs take turns

    def _score(self, examples: list, rollouts: list, what: str) -> Scores:
        scores = self.scorer.score([(self.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                                     examples[r.prompt_index].answer) for r in rollouts])
        if scores.failed or scores.timed_out:
            self.log(f"{what}: {scores.failed} reward(s) raised or were not a number in [0, 1], {scores.timed_out} "
                     f"ran past --reward-timeout-s {self.scorer.config.timeout_s:g}; scored 0")
        return scores

    def _generate(self, examples: list, indices: range, sampling: SamplingConfig, progress: bool | None = None,
                  resumable: bool = False) -> tuple[list, list]:
        """The examples at `indices` and their rollouts (each prompt sampled with its index's seed; `resumable`: a
        weight sync may interrupt them, `RolloutEngine.generate_resumable`)."""
        mine = [examples[i] for i in indices]
        return mine, self.engine.generate(prompt_ids(self.tokenizer, [e.prompt for e in mine]), sampling,
                                          progress=progress, first_index=indices.start if indices else 0,
                                          timeout_s=self.policy.generation_timeout_s,
                                          turns=self.turns if resumable else None)

    def _collect(self, step: int, prompts: range, round_index: int, policy_version: int):
        sampling = dataclasses.replace(self.plan.sampling, seed=stream_seed(self.rollout_seed, step, round_index))
        examples, rollouts = self._generate(
            step_examples(self.task, self.plan.prompts_per_step, self.data_seed, step, round_index), prompts, sampling,
            resumable=self.plan.partial_rollouts)
        # the trainer's input positions: every token but the last
        routes = self.engine.route([(r.prompt_token_ids + r.token_ids)[:-1] for r in rollouts]) \
            if self.plan.routing_replay else None
        scores = self._score(examples, rollouts, f"step {step}")
        batch = rollouts_to_batch(rollouts, scores.values, self.plan.sampling.n, self.plan.seq_length,
                                  self.tokenizer.pad_token_id, routes,
                                  policy_version if self.plan.policy_versions else None)
        batch = dataclasses.replace(batch, partial=sum(r.partial for r in rollouts),
                                    repetitive=sum(repeats_an_ngram(r.token_ids) for r in rollouts))
        batch = shape_overlong(batch, [r.length for r in rollouts], [r.finish_reason == "length" for r in rollouts],
                               self.plan.overlong, self.plan.sampling.max_new_tokens)
        return self.plan.with_advantages(dataclasses.replace(batch, reward_failures=scores.failed,
                                                             reward_timeouts=scores.timed_out))

    def _serving(self, action: Callable[[], Any], what: str, weights=None) -> Any:
        """`action()`, restarting the engine (with `weights`, default its last ones) and asking again each time it
        died or did not answer in time (`_restart`); an error of a live engine is a RolloutError."""
        while True:
            try:
                return action()
            except Exception as err:  # vLLM raises many kinds of errors when its engine core dies
                if not isinstance(err, EngineTimeoutError) and self.engine.health_check():
                    raise RolloutError(f"{what} failed: {type(err).__name__}: {err}") from err
                self._restart(what, f"the rollout engine died ({type(err).__name__}: {err})", err, weights)

    def _restart(self, what: str, reason: str, cause: Exception, weights=None) -> None:
        """Restart the engine with `weights` (default: its last ones) and its KV-cache scales until it passes its
        refit check against `refit_reference` (when set), while the restart budget lasts; past it, shut the engine
        down and raise EngineRetiredError. A MoE reference awaiting its routes' replay (a restart inside a sync)
        cannot judge it: the sync's own refit check, of every engine, does (`take_restarted_unchecked`)."""
        while True:
            if self.restarts >= self.policy.max_restarts:
                self.engine.shutdown()
                raise EngineRetiredError(
                    f"{what}: {reason} after {self.restarts} restart(s) (--rollout-max-engine-restarts "
                    f"{self.policy.max_restarts}); it serves no more") from cause
            self.log(f"{what}: {reason}; restarting it and re-syncing the current weights")
            self.restarts += 1
            self.engine.restart(weights)
            if self.refit_reference is None:
                return
            if self.refit_reference.awaits_replay:
                self.restarted_unchecked = True
                self.log(f"{what}: the restarted engine's refit is checked once the sync is applied")
                return
            try:
                failure = self.refit_reference.failure(self.engine)
            except Exception as err:  # it died again while scoring the probe
                failure = f"{type(err).__name__}: {err}"
            if failure is None:
                self.log(f"{what}: the restarted engine passed its refit check; it serves again")
                return
            reason = f"the restarted engine failed its refit check ({failure})"

    def take_restarted_unchecked(self) -> bool:
        """Whether the engine restarted unchecked since the last call (`_restart`)."""
        restarted, self.restarted_unchecked = self.restarted_unchecked, False
        return restarted

    def rollout_rows(self, step: int, prompts: range, round_index: int = 0, policy_version: int = 0):
        """Generate the group of responses to each of the step's prompts (of its `round_index`-th sampling round) at
        indices `prompts` and score them; return the RolloutBatch of their rows, advantages included (and, when the
        plan asks, `policy_version`, the step whose weights the engine holds, on every response token; with partial
        rollouts each token's own). Holds the engine (`turns`) until they are made."""
        with self.turns.generation():
            return self._serving(lambda: self._collect(step, prompts, round_index, policy_version), f"step {step}")

    def _reward_sum(self, prompts: range, sampling: SamplingConfig) -> tuple[float, int]:
        examples, rollouts = self._generate(self.task.eval, prompts, sampling, progress=False)
        rewards = self._score(examples, rollouts, "evaluation").values
        return sum(rewards), len(rewards)

    def evaluate(self, prompts: range) -> dict[str, tuple[float, int]]:
        """Held-out accuracy on the held-out prompts at indices `prompts`, as (sum of rewards, samples) per metric
        (`mean_rewards` of every engine's gives the means): the evaluation's samples per prompt at the rollout
        temperature (fixed seed, so evaluations are comparable across steps), and greedy."""
        sampling = self.plan.sampling
        sampled = dataclasses.replace(sampling, n=self.plan.eval_samples, seed=self.plan.eval_seed)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens,
                                stop_token_ids=sampling.stop_token_ids)
        with self.turns.generation():
            return {"eval/accuracy": self._reward_sum(prompts, sampled),
                    "eval/greedy_accuracy": self._reward_sum(prompts, greedy)}

    def evaluate_unless_dead(self, step: int, prompts: range) -> dict[str, tuple[float, int]]:
        """`evaluate`; an engine that died meanwhile skips it (it is restarted at the next rollout)."""
        try:
            return self.evaluate(prompts)
        except Exception as err:
            if self.engine.health_check():
                raise
            self.log(f"step {step}: the rollout engine died during evaluation ({type(err).__name__}); skipping this "
                     "evaluation")
            return {}

    def apply_weights(self, weights, reference: RefitReference, policy_version: int) -> int:
        """Install a verified sync of the trainer's step `policy_version` whose probe log-probs on the trainer are
        `reference` (the refit check of every later restart); return the trainer step whose weights the engine
        holds now (the same in a resumed run, and after a restart, unlike the engine's count of loads). An engine
        that died meanwhile is restarted with this sync's weights, not its last ones (the staging arena it read
        those from holds this sync's now), and serves once it agrees with `reference` (while the restart budget
        lasts)."""
        self.refit_reference = reference
        self._serving(lambda: self.engine.update_weights(weights), "weight sync", weights)
        self.turns.weights_version = policy_version
        return self.turns.weights_version

    def set_kv_cache_scales(self, scales) -> int:
        """Install FP8 KV-cache scales; an engine that died meanwhile is restarted (while the budget lasts) and given
        them; return the number of attention layers."""
        return self._serving(lambda: self.engine.set_kv_cache_scales(scales), "KV-cache scales")


def mean_rewards(parts: list[dict[str, tuple[float, int]]]) -> dict[str, float]:
    """Every engine's evaluation (`RolloutManager.evaluate`) as mean rewards; none if an engine skipped it."""
    if not parts or any(not part for part in parts):
        return {}
    return {name: sum(part[name][0] for part in parts) / max(sum(part[name][1] for part in parts), 1)
            for name in parts[0]}
