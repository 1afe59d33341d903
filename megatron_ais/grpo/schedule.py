"""Which step's rollout batch is generated when: with --max-off-policy-steps η, the batches of the next η steps are
submitted to the fleet before a step trains (`GRPOLoopConfig.steps_ahead`) and generate while it trains; a step's
batch is taken from them, or made when the step starts."""
from __future__ import annotations

from typing import Callable

from megatron_ais.grpo.loop_config import GRPOLoopConfig
from megatron_ais.rollout.fleet import PendingRollouts
from megatron_ais.rollout.rows import StepRollouts


class RolloutSchedule:
    """The batches submitted ahead of the step that trains (on every rank; the fleet's methods are collective)."""

    def __init__(self, fleet, loop: GRPOLoopConfig, saves_at: Callable[[int], bool]):
        self.fleet, self.loop, self.saves_at = fleet, loop, saves_at
        self.pending: dict[int, PendingRollouts] = {}

    @property
    def generating(self) -> bool:
        """Whether batches submitted ahead are outstanding (generating, or made and not yet taken)."""
        return bool(self.pending)

    def rollouts(self, step: int) -> StepRollouts:
        """Step `step`'s rollouts: those submitted ahead, or generated now by the weights the engines hold."""
        return (self.pending.pop(step, None) or self.fleet.submit(step)).wait()

    def submit_ahead(self, step: int) -> None:
        """Submit the batches generated while step `step` trains, after the last one submitted."""
        submitted = max(self.pending, default=step)
        for later in self.loop.steps_ahead(step, submitted, self.saves_at):
            self.pending[later] = self.fleet.submit(later, ahead=True)

    def wait_submitted(self) -> None:
        """Wait until every batch submitted is in: the engines change weights between batches, never during one."""
        for later in sorted(self.pending):
            self.pending[later].wait()
