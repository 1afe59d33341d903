"""Kernels of the resharding bridge, free of megatron_ais: `fp8` (blockwise FP8 quantization), `fp4` (NVFP4 and
MXFP4 weight quantization), `integrity` (NaN/Inf checks and checksums) and `cpu_library` (the C kernels of `csrc/`,
built on first use)."""
