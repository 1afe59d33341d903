"""Kernels of the resharding bridge, free of megatron_ais: `fp8` (blockwise FP8 quantization), `integrity`
(NaN/Inf checks and checksums) and `cpu_library` (the C kernels of `csrc/`, built on first use)."""
