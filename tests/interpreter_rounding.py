"""Triton's interpreter with a GPU's float conversions, for tests that compare a Triton kernel's bits with torch's.

The interpreter (triton 3.9) truncates FP32 -> BF16 where a GPU rounds to nearest even, and its own rounding to
e4m3 lets a carry out of the mantissa drop the value a binade (7.8 -> 4 instead of 8; docs/install.md). `install()`
makes its float-to-float conversions torch's (round to nearest even, as a GPU's `cvt.rn`), so that under the
interpreter a kernel's indexing, masks, clamps, scales and sums are checked bit for bit on CPU, not only on a GPU.
The conversion of NaN may differ in its payload bits from a GPU's; tests compare only what finite data writes.
"""
import numpy as np
import torch
from triton.runtime import interpreter

_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64,
          "fp8e4nv": torch.float8_e4m3fn}
_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _torch_conversion(src, dst_type):
    """The interpreter's tensor `src` converted to `dst_type` by torch, or None where either type is not a float
    that torch converts."""
    src_type, dst_scalar = src.dtype.scalar, dst_type.scalar
    if not (src_type.is_floating() and dst_scalar.is_floating()):
        return None
    source, target = _TORCH.get(src_type.name), _TORCH.get(dst_scalar.name)
    if source is None or target is None:
        return None
    data = np.ascontiguousarray(src.data)
    values = torch.from_numpy(data.view(f"uint{8 * source.itemsize}").copy()).view(source)
    out = values.to(target).view(_BITS[target.itemsize]).numpy()
    return interpreter.TensorHandle(out.view(interpreter._get_np_dtype(dst_scalar)).reshape(data.shape), dst_scalar)


def install() -> None:
    """Route the interpreter's float-to-float casts through torch (idempotent)."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_torch_rounding", False):
        return
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast(self, src, dst_type):
        converted = _torch_conversion(src, dst_type)
        return cast_impl(self, src, dst_type) if converted is None else converted

    def to_fp(self, src, dst_type, rounding_mode):
        nearest_even = rounding_mode is None or rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE
        converted = _torch_conversion(src, dst_type) if nearest_even else None
        return fp_to_fp(self, src, dst_type, rounding_mode) if converted is None else converted

    builder.cast_impl, builder.create_fp_to_fp, builder._torch_rounding = cast, to_fp, True
