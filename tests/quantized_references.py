"""The engine's HF weights from the tensors a sync sends, by vLLM's own references and the formats' definitions (not
the project's dequantizers), and the GPU's activation quantizer written out: what tests compare the engine and the
aligned trainer against."""
import torch

FP8_MAX = 448.0


def reference_dequantized(sent: dict, precision: str) -> dict:
    """BF16 HF weights from an engine's FP8 (codes x 128x128-block `_scale_inv`), NVFP4 (vLLM's
    `dequantize_to_dtype`) or MXFP4 (vLLM's `break_fp4_bytes` x 2^(e8m0 - 127)) tensors; others as sent."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes, \
        dequantize_to_dtype

    out = {}
    for name, tensor in sent.items():
        module = name.removesuffix(".weight_packed").removesuffix(".weight")
        if name.endswith(("_scale_inv", ".weight_scale", ".weight_scale_2")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = sent[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[name] = (tensor.float() * scale[:tensor.shape[0], :tensor.shape[1]]).to(torch.bfloat16)
        elif precision == "nvfp4" and module + ".weight_scale_2" in sent:
            out[name] = dequantize_to_dtype(tensor, sent[module + ".weight_scale"], sent[module + ".weight_scale_2"],
                                            torch.float32, 16, swizzle=False).to(torch.bfloat16)
        elif name.endswith(".weight_packed"):
            scale = 2.0 ** (sent[module + ".weight_scale"].to(torch.int32) - 127).float()
            out[module + ".weight"] = (break_fp4_bytes(tensor, torch.float32)
                                       * scale.repeat_interleave(32, dim=1)).to(torch.bfloat16)
        else:
            out[name] = tensor
    return out


def group_quantize(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CUDA per-token-group quantization (`per_token_group_fp8_quant`, what an H100 runs), written out: per
    `group` columns of the last dimension (the last group zero-padded) the fp32 scale max(absmax, 1e-10) / 448, codes
    x / scale clamped to ±448 and rounded to e4m3. Returns codes [.., K] and scales [.., groups]."""
    k = x.shape[-1]
    grouped = torch.nn.functional.pad(x.float(), (0, -k % group)).reshape(*x.shape[:-1], -1, group)
    scales = grouped.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    codes = (grouped / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(*x.shape[:-1], -1)[..., :k], scales


def group_round_trip(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x through `group_quantize` and back (codes x scales in fp32), in x's dtype."""
    codes, scales = group_quantize(x, group)
    return (codes.float() * scales.repeat_interleave(group, dim=-1)[..., :x.shape[-1]]).to(x.dtype)
