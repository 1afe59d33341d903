"""The trainer's parallel layout: one object, built once from the parallelism flags and passed explicitly to
whatever builds process groups, models, checkpoints or bridges. Data parallelism is what the world size leaves."""
from __future__ import annotations

import dataclasses
import math

from megatron_ais import platform
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class ParallelLayout(FlagConfig):
    """TP, PP (and virtual stages), CP, EP and expert-TP sizes and sequence parallelism; checked on construction."""

    tensor: int = flag(1, "TP: shard attention heads, MLP and vocabulary over this many ranks.",
                       name="--tensor-model-parallel-size", at_least=1)
    pipeline: int = flag(1, "PP: split the layers into this many stages.", name="--pipeline-model-parallel-size",
                         at_least=1)
    virtual_pipeline: int | None = flag(
        None, "Model chunks per pipeline stage for the interleaved 1F1B schedule (needs PP > 1).",
        name="--virtual-pipeline-model-parallel-size", type=int, at_least=1)
    context: int = flag(1, "CP: split sequences over this many ranks. Not supported yet (only 1): the training steps "
                           "do not split sequences, and megatron's CP attention needs Transformer Engine.",
                        name="--context-parallel-size", at_least=1)
    expert: int = flag(1, "EP: distribute MoE experts over this many ranks.", name="--expert-model-parallel-size",
                       at_least=1)
    expert_tensor: int | None = flag(None, "TP size inside each expert, a divisor of TP (default: "
                                           "--tensor-model-parallel-size).",
                                     name="--expert-tensor-parallel-size", type=int, at_least=1)
    sequence_parallel: bool = flag(False, "Megatron sequence parallelism for norms and dropout (needs TP > 1).")
    distributed_timeout_minutes: int = flag(
        30, "How long a rank waits in one collective before the run stops (Megatron-LM's flag): longer than any phase "
            "a rank waits through for others, e.g. a separate engine's --rollout-generation-timeout-s.", at_least=1)

    def __post_init__(self):
        super().__post_init__()
        if self.virtual_pipeline is not None and self.pipeline == 1:
            raise ArgumentValidationError(
                "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1; drop the flag or "
                "raise the PP size")
        if self.sequence_parallel and self.tensor == 1:
            raise ArgumentValidationError("--sequence-parallel needs --tensor-model-parallel-size > 1; drop the flag")
        if self.context > 1:
            raise ArgumentValidationError(
                f"--context-parallel-size {self.context}: the training steps do not split sequences over "
                "context-parallel ranks (and megatron's context-parallel attention needs Transformer Engine); use 1")
        self._check_interleaving_over_gloo()

    def _check_interleaving_over_gloo(self) -> None:
        if self.virtual_pipeline is not None and self.pipeline == 2 and not platform.is_cuda():
            # at PP2 a stage's previous and next stage are one rank, and the interleaved schedule exchanges
            # activations and gradients with it in both directions in one batch: gloo matches them by peer and tag
            # only and swaps them (wrong losses, found by tests/training/test_ddp_training.py); NCCL keeps their order
            raise ArgumentValidationError(
                "--virtual-pipeline-model-parallel-size with --pipeline-model-parallel-size 2 gives wrong results "
                "over gloo (CPU): use a PP size of 3 or more, or drop the virtual pipeline")

    @property
    def model_parallel(self) -> int:
        """TP x PP x CP: the ranks one data-parallel replica spans."""
        return self.tensor * self.pipeline * self.context

    @property
    def expert_tensor_size(self) -> int:
        """The TP size inside experts (the trainer's TP unless set)."""
        return self.expert_tensor or self.tensor

    @property
    def model_chunks(self) -> int:
        """Model chunks over the whole pipeline (stages x virtual stages)."""
        return self.pipeline * (self.virtual_pipeline or 1)

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes under the keyword names both megatron's `initialize_model_parallel` and `TransformerConfig`
        take."""
        return dict(tensor_model_parallel_size=self.tensor, pipeline_model_parallel_size=self.pipeline,
                    virtual_pipeline_model_parallel_size=self.virtual_pipeline, context_parallel_size=self.context,
                    expert_model_parallel_size=self.expert, expert_tensor_parallel_size=self.expert_tensor)

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel size at `world_size` ranks; refuses a world the layout does not fit."""
        if world_size % self.model_parallel:
            raise ArgumentValidationError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {self.tensor} x "
                f"--pipeline-model-parallel-size {self.pipeline} x --context-parallel-size {self.context} = "
                f"{self.model_parallel}; launch a multiple of {self.model_parallel} ranks or change the parallel sizes")
        # megatron forms expert groups from the TP x DP (x CP) ranks of each pipeline stage
        expert_ranks = self.expert * self.expert_tensor_size * self.pipeline
        if world_size % expert_ranks:
            raise ArgumentValidationError(
                f"world size {world_size} is not divisible by --expert-model-parallel-size {self.expert} x expert-TP "
                f"{self.expert_tensor_size} x --pipeline-model-parallel-size {self.pipeline} = {expert_ranks}; "
                "change the expert-parallel sizes")
        return world_size // self.model_parallel

    def shard_directories(self) -> list[tuple[int, int]]:
        """The (TP rank, EP rank) shard directories a run at this layout saves per pipeline stage: one per position
        some rank holds (megatron: rank r has TP rank r mod TP and EP rank (r // expert-TP) mod EP; all of them
        within lcm(TP, expert-TP x EP) ranks). Every TP x EP pair when expert-TP = TP."""
        etp = self.expert_tensor_size
        return sorted({(r % self.tensor, (r // etp) % self.expert)
                       for r in range(math.lcm(self.tensor, etp * self.expert))})
