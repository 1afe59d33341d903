"""The engine's model directory, written before vLLM starts: the HF config (with the quantization_config of the
bridge's policy), the tokenizer files, and the initial HF weights converted as the bridge converts every sync."""
from __future__ import annotations

import json
import os

from safetensors.torch import save_file

from megatron_ais.bridge.quantization import QuantizationPolicy, engine_quantization_config, quantize_for_engine
from megatron_ais.engine.config import EngineConfig
from megatron_ais.hf_assets import copy_hf_assets
from megatron_ais.mapping.hf_io import HFCheckpointReader


def prepare_engine_dir(config: EngineConfig, out_dir: str) -> str:
    """Write the engine's model directory: config (with quantization_config for fp8), tokenizer, and the HF
    weights converted by the bridge's policy (FP8 + weight_scale_inv for linear layers in fp8 mode)."""
    if not os.path.isfile(os.path.join(config.model_dir, "config.json")):
        raise FileNotFoundError(f"rollout model directory {config.model_dir} has no config.json")
    os.makedirs(out_dir, exist_ok=True)
    reader = HFCheckpointReader(config.model_dir)
    policy = QuantizationPolicy(precision=config.precision, block_size=config.block_size,
                                exclude=config.quantization_exclude)
    tensors = dict(quantize_for_engine(((n, reader.get(n)) for n in reader.names()), policy))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(config.model_dir, "config.json")) as f:
        hf_config = json.load(f)
    quant = engine_quantization_config(policy, reader.names())
    hf_config.pop("quantization_config", None)
    if quant is not None:
        hf_config["quantization_config"] = quant
    hf_config["dtype"] = "float32" if config.precision == "fp32" else "bfloat16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    copy_hf_assets(config.model_dir, out_dir)
    return out_dir
