"""4-bit float (e2m1) weight quantization for weight-only rollouts: `format` (the e2m1 grid, its rounding and the
two-per-byte packing) and `quantize` (NVFP4 as ModelOpt writes it, MXFP4 as the OCP MX spec defines it)."""
