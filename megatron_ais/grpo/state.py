"""What a GRPO run carries from step to step and through a checkpoint: the step, the seeds of its data and rollout
streams, the KL reference it started from, the AIS state, the FP8 KV-cache scales and the history; and what a
resumed run reports of the flags that changed."""
from __future__ import annotations

import dataclasses
import os

from megatron_ais.ais import AISState
from megatron_ais.checkpointing.store import read_checkpoint_metadata, usable_iterations
from megatron_ais.errors import ArgumentValidationError, CheckpointError
from megatron_ais.kv_calibration import KVCacheScales

# flags that may change between a run and its resumption without changing what it computes
RESUME_FREE_FLAGS = ("load", "save", "grpo_steps", "output_dir", "tensorboard_dir", "save_interval", "log_interval",
                     "keep_checkpoints", "eval_interval")
# flags whose saved values a resumed run keeps: its data order, sampling seeds and KL reference (the optimizer's
# hyper-parameters are this run's flags: `training.set_hyperparameters`)
RESUME_KEPT_FLAGS = ("seed", "rollout_seed", "ref_load")


def changed_flags(saved: dict, current: dict) -> list[str]:
    """Return `--flag saved -> now` for every flag that differs from the saved run (resume-free flags aside, and
    flags this entry point does not have); those whose saved value is kept say so."""
    return [f"--{k.replace('_', '-')} {v!r} -> {current[k]!r}"
            + (" (ignored: the saved run's value is kept)" if k in RESUME_KEPT_FLAGS else "")
            for k, v in sorted(saved.items()) if k in current and k not in RESUME_FREE_FLAGS and current[k] != v]


# the checkpoint metadata's key of a GRPO run's data seed: a resumed run draws its task with it before any rank
# file is read
DATA_SEED_KEY = "grpo_data_seed"


def resumed_data_seed(checkpoint, seed: int) -> int:
    """The seed a run draws its task's data with: the resumed GRPO run's (its checkpoint's metadata records it), else
    --seed (`checkpoint`: the run's CheckpointConfig)."""
    if checkpoint.load is None or checkpoint.finetune:
        return seed
    saved = read_checkpoint_metadata(checkpoint.load, allow_unverified=checkpoint.allow_unverified_checkpoint)
    return saved.get(DATA_SEED_KEY, seed)


def check_data_seed(state: "GRPOState", drawn_with: int, load: str | None) -> None:
    """The resumed run's data seed is the one its task was drawn with: a checkpoint written before the metadata kept
    the seed cannot say it, and a changed --seed would draw other data."""
    if state.data_seed != drawn_with:
        raise CheckpointError(f"--load {load}: its run drew its data with seed {state.data_seed}, which its metadata "
                              f"does not record (written by an older version); resume with --seed {state.data_seed}")


def reference_source(ref_load: str | None, load: str | None, hf_dir: str | None, loaded_iteration: int | None,
                     allow_unverified: bool = False) -> dict:
    """Where the frozen KL reference comes from: --ref-load, else what this run started from; a checkpoint with the
    iteration it had then, so that a resumed run (whose --load has newer iterations, perhaps its own) keeps it."""
    if ref_load:
        return {"load": ref_load, "iteration": usable_iterations(ref_load, allow_unverified, flag="--ref-load")[0]}
    return {"load": load, "iteration": loaded_iteration} if load else {"hf_dir": hf_dir}


def protected_iterations(reference: dict, save: str | None) -> tuple[int, ...]:
    """The iterations of --save that pruning must keep: the KL reference's, when it lives there."""
    load, iteration = reference.get("load"), reference.get("iteration")
    if save and load and iteration is not None and os.path.realpath(load) == os.path.realpath(save):
        return (iteration,)
    return ()


def check_reference_kept(reference: dict, checkpoint, first_step: int, last_step: int) -> None:
    """Refuse, before training, a run whose --save holds its KL reference at an iteration one of its steps
    `first_step` .. `last_step` would save over (`checkpoint`: its CheckpointConfig): every later resume would take
    that step's policy as the reference."""
    save = checkpoint.save
    for iteration in protected_iterations(reference, save):
        if first_step <= iteration <= last_step and checkpoint.saves_at(iteration, last_step):
            raise ArgumentValidationError(
                f"--save {save} holds this run's KL reference (its iteration {iteration}), which step {iteration} "
                f"would save over; give --save another directory, or --ref-load a copy of that checkpoint")


@dataclasses.dataclass
class GRPOState:
    """The run's state between steps; `saved` is the checkpoint's run state it resumed from (None: a fresh start)."""

    step: int
    data_seed: int
    rollout_seed: int
    reference: dict
    ais: AISState
    history: list
    eval_before: dict
    kv_cache_scales: KVCacheScales | None = None
    saved: dict | None = None

    @classmethod
    def begin(cls, saved: dict | None, seed: int, rollout_seed: int | None, reference: dict) -> "GRPOState":
        """A fresh run's state, or the saved run's (whose seeds it keeps; `reference`: the saved run's KL reference
        when it resumes)."""
        resumed = saved or {}
        ais = AISState()
        ais.load_state_dict(resumed.get("ais_state", {}))
        scales = resumed.get("kv_cache_scales")
        return cls(step=resumed.get("step", 0), data_seed=resumed.get("data_seed", seed),
                   rollout_seed=resumed.get("rollout_seed", seed if rollout_seed is None else rollout_seed),
                   reference=reference, ais=ais,
                   history=list(resumed.get("history", [])), eval_before=resumed.get("eval_before", {}),
                   kv_cache_scales=None if scales is None else KVCacheScales(tuple(tuple(row) for row in scales)),
                   saved=saved)

    def consumed_prompts(self, prompts_per_step: int) -> int:
        """Prompts sampled so far: --prompts-per-step a step, or what dynamic sampling's rounds drew."""
        return sum(int(record.get("sampling/prompts_sampled", prompts_per_step)) for record in self.history)

    def run_state(self, prompts_per_step: int, flags: dict) -> dict:
        """What a checkpoint saves of the run after `step` (`flags`: the run's plain flag values)."""
        return {"kind": "grpo", "step": self.step, "ais_state": self.ais.state_dict(), "data_seed": self.data_seed,
                "rollout_seed": self.rollout_seed, "consumed_prompts": self.consumed_prompts(prompts_per_step),
                "reference_source": self.reference, "history": self.history, "eval_before": self.eval_before,
                "args": flags,
                "kv_cache_scales": None if self.kv_cache_scales is None else list(self.kv_cache_scales.scales)}
