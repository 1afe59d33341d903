"""The engine's rank's side of the GRPO loop: the rollout engine with its prompts, rewards, evaluation and restart
policy. Prompts and sampling seeds depend only on the seeds and the step, so a resumed (or restarted) run continues
the same stream; an engine that dies is restarted with the weights and KV-cache scales it had, and the step goes on."""
from __future__ import annotations

import dataclasses
import random
from typing import Callable

from megatron_ais.errors import ArgumentValidationError, RolloutError
from megatron_ais.rollout.engine import RolloutEngine, SamplingConfig
from megatron_ais.rollout.rewards import RewardScorer, Scores


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


def step_examples(task, prompts_per_step: int, data_seed: int, step: int) -> list:
    """The prompts of a step: they depend only on the data seed and the step."""
    return random.Random(data_seed * 100003 + step).sample(task.train, prompts_per_step)


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
    routing_replay: bool = False  # MoE: the engine routes every rollout once more for the trainer to replay


class RolloutManager:
    """Lives on the engine's rank: generates and scores each step's rollouts, evaluates held-out accuracy and
    applies weight syncs, restarting the engine when it died (`log` tells the user)."""

    def __init__(self, engine: RolloutEngine, tokenizer, task, plan: RolloutPlan, data_seed: int, rollout_seed: int,
                 log: Callable[[str], None], scorer: RewardScorer):
        self.engine, self.tokenizer, self.task, self.plan = engine, tokenizer, task, plan
        self.data_seed, self.rollout_seed, self.log, self.scorer = data_seed, rollout_seed, log, scorer

    def _score(self, examples: list, rollouts: list, what: str) -> Scores:
        scores = self.scorer.score([(self.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                                     examples[r.prompt_index].answer) for r in rollouts])
        if scores.failed or scores.timed_out:
            self.log(f"{what}: {scores.failed} reward(s) raised or were not a number in [0, 1], {scores.timed_out} "
                     f"ran past --reward-timeout-s {self.scorer.config.timeout_s:g}; scored 0")
        return scores

    def _collect(self, step: int):
        from megatron_ais.rollout.batch import rollouts_to_batch

        examples = step_examples(self.task, self.plan.prompts_per_step, self.data_seed, step)
        sampling = dataclasses.replace(self.plan.sampling, seed=self.rollout_seed * 100003 + step)
        rollouts = self.engine.generate(prompt_ids(self.tokenizer, [e.prompt for e in examples]), sampling)
        # the trainer's input positions: every token but the last
        routes = self.engine.route([(r.prompt_token_ids + r.token_ids)[:-1] for r in rollouts]) \
            if self.plan.routing_replay else None
        scores = self._score(examples, rollouts, f"step {step}")
        batch = rollouts_to_batch(rollouts, scores.values, self.plan.sampling.n, self.plan.seq_length,
                                  self.tokenizer.pad_token_id, routes)
        return dataclasses.replace(batch, reward_failures=scores.failed, reward_timeouts=scores.timed_out)

    def rollout_batch(self, step: int):
        """Sample this step's prompts, generate the group of responses per prompt and score them; return the
        RolloutBatch. An engine that died is restarted (with its weights) and asked once more."""
        try:
            return self._collect(step)
        except Exception as err:  # vLLM raises many kinds of errors when its engine core dies
            if self.engine.health_check():
                raise RolloutError(f"step {step}: rollout generation failed: {type(err).__name__}: {err}") from err
            self.log(f"step {step}: the rollout engine died ({type(err).__name__}: {err}); restarting it and "
                     "re-syncing the current weights")
            self.engine.restart()
        try:
            return self._collect(step)
        except Exception as err:
            raise RolloutError(f"step {step}: rollout generation failed: {type(err).__name__}: {err}") from err

    def _mean_reward(self, sampling: SamplingConfig) -> float:
        examples = self.task.eval
        rollouts = self.engine.generate(prompt_ids(self.tokenizer, [e.prompt for e in examples]), sampling,
                                        progress=False)
        rewards = self._score(examples, rollouts, "evaluation").values
        return sum(rewards) / len(rewards)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: mean reward of the evaluation's samples per prompt at the rollout temperature (fixed
        seed, so evaluations are comparable across steps), and greedy accuracy."""
        sampling = self.plan.sampling
        sampled = dataclasses.replace(sampling, n=self.plan.eval_samples, seed=self.plan.eval_seed)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens,
                                stop_token_ids=sampling.stop_token_ids)
        return {"eval/accuracy": self._mean_reward(sampled), "eval/greedy_accuracy": self._mean_reward(greedy)}

    def evaluate_unless_dead(self, step: int) -> dict[str, float]:
        """`evaluate`; an engine that died meanwhile skips it (it is restarted at the next rollout)."""
        try:
            return self.evaluate()
        except Exception as err:
            if self.engine.health_check():
                raise
            self.log(f"step {step}: the rollout engine died during evaluation ({type(err).__name__}); skipping this "
                     "evaluation")
            return {}

    def apply_weights(self, weights) -> int:
        """The bridge receiver's callback: install a verified sync (an engine that died meanwhile is restarted and
        given the same complete set of weights)."""
        def restarting(err):
            self.log(f"the rollout engine died during a weight sync ({type(err).__name__}: {err}); restarting it and "
                     "re-syncing the current weights")
        return self.engine.update_weights_or_restart(weights, on_restart=restarting)
