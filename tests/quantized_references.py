"""The engine's HF weights from the tensors a sync sends, by vLLM's own references and the formats' definitions (not
the project's dequantizers): what tests compare the engine and the aligned trainer against."""
import torch


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
