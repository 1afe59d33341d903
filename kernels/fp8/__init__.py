"""Blockwise FP8 (e4m3) weight quantization: `format` (block size, scale shape, e4m3 constants, dequantization),
`reference` (the torch quantizer), `triton` (the CUDA kernel), `cpu` (the C kernel) and `dispatch` (the one
function that picks among them)."""
