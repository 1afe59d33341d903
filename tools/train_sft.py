"""Supervised warm-up on a verifiable task's reference responses with megatron-core, at any TP x PP x DP.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/train_sft.py \\
        --hf-dir runs/tiny-llama --tensor-model-parallel-size 2 --train-iters 20
"""
import os
import sys

from megatron_ais.logging import quiet_libraries

# at import, before megatron is: its import-time warnings are shown by rank 0 only, once, on one line
quiet_libraries(int(os.environ.get("RANK", "0")))

from megatron_ais.arguments import SFT_FLAGS, SFTRunConfig, build_parser, launched_world_size  # noqa: E402
from megatron_ais.errors import reported_as_one_line  # noqa: E402
from megatron_ais.sft import run_sft  # noqa: E402


def main(argv=None) -> int:
    parser = build_parser(__doc__.split("\n\n")[0], SFT_FLAGS, prog="train_sft.py")
    args = parser.parse_args(argv)
    world_size = launched_world_size(parser)
    with reported_as_one_line(parser.prog, parser):
        summary = run_sft(SFTRunConfig.from_args(args, world_size))
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"loss_first={summary['loss_first']} loss_last={summary['loss_last']} steps={summary['steps']} "
              f"wall_s={summary['wall_s']:.1f}")
    from megatron_ais.initialize import destroy_megatron
    destroy_megatron()
    return 0


if __name__ == "__main__":
    sys.exit(main())
