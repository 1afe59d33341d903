"""4-bit rollouts on the CPU engine (W4A16): vLLM loads the NVFP4 (ModelOpt) and MXFP4 (compressed-tensors)
checkpoints `quantize_for_engine` writes, and its linear layers compute with the codes dequantized to BF16 — at start
and after an in-place weight update — so its log-probs equal, bit for bit, a BF16 engine's on those weights,
dequantized here by vLLM's own NVFP4 reference and compressed-tensors' e8m0 scales. Plus the config and the
refusals around it."""
import json
import os

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from quantized_references import reference_dequantized
from megatron_ais.mapping.hf_io import HFCheckpointReader

PROBE = [3, 17, 42, 99, 120, 7, 8, 9, 250, 61, 5, 33, 201, 77, 150, 12, 88, 64, 199, 2, 45, 300, 11, 90]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             initializer_range=0.02)


def _bf16_dir(hf_dir: str, tensors: dict, out: str) -> str:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(hf_dir, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(config, dtype="bfloat16"), f, indent=2)
    return out


def _engines(hf_dir: str, work: str):
    """In one process: the NVFP4 engine's log-probs at start and after an update to other weights, the MXFP4
    engine's at start, and a BF16 engine's on each of those three sets of weights, dequantized."""
    import contextlib
    import io

    from safetensors.torch import load_file

    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.engine.vllm_engine import RolloutEngine
    from megatron_ais.mapping.hf_io import HFCheckpointReader

    os.environ["MEGATRON_AIS_CPU_BF16"] = "fp32"

    def engine(model_dir, precision, name):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            built = RolloutEngine(EngineConfig(model_dir=model_dir, precision=precision, kv_cache_gb=0.25,
                                               placement="colocated"), os.path.join(work, name))
        return built, printed.getvalue()

    found, printed = {}, {}
    nvfp4, printed["nvfp4"] = engine(hf_dir, "nvfp4", "nvfp4")
    found["nvfp4"] = nvfp4.prompt_logprobs(PROBE)
    engine_tensors = {"nvfp4": load_file(os.path.join(nvfp4.engine_dir, "model.safetensors"))}
    reader = HFCheckpointReader(hf_dir)
    moved = [(n, reader.get(n) * 1.5 if n.endswith("proj.weight") else reader.get(n)) for n in reader.names()]
    update = list(quantize_for_engine(moved, QuantizationPolicy(precision="nvfp4")))
    nvfp4.update_weights(update)
    found["nvfp4 updated"] = nvfp4.prompt_logprobs(PROBE)
    engine_tensors["nvfp4 updated"] = dict(update)
    nvfp4.shutdown()
    mxfp4, printed["mxfp4"] = engine(hf_dir, "mxfp4", "mxfp4")
    found["mxfp4"] = mxfp4.prompt_logprobs(PROBE)
    engine_tensors["mxfp4"] = load_file(os.path.join(mxfp4.engine_dir, "model.safetensors"))
    mxfp4.shutdown()

    references = {key: reference_dequantized(tensors, key.split()[0]) for key, tensors in engine_tensors.items()}
    bf16, _ = engine(_bf16_dir(hf_dir, references["nvfp4"], os.path.join(work, "dequantized")), "bf16", "bf16")
    expected = {"nvfp4": bf16.prompt_logprobs(PROBE)}
    for key in ("nvfp4 updated", "mxfp4"):
        bf16.update_weights(list(references[key].items()))
        expected[key] = bf16.prompt_logprobs(PROBE)
    bf16.shutdown()
    return found, expected, printed


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_4bit_engines_equal_a_bf16_engine_on_the_dequantized_weights_bit_for_bit(model_root, tmp_path, arch):
    """Dense, and Qwen3-MoE whose experts the CPU runs as vLLM's BF16 experts on the dequantized codes."""
    shape = SHAPE if arch == "qwen3" else dict(num_layers=2, hidden_size=256, vocab_size=512, initializer_range=0.1)
    hf_dir = make_model_dir(model_root, arch, **shape)
    ((found, expected, printed),) = spawn(1, _engines, hf_dir, str(tmp_path))
    for key in ("nvfp4", "nvfp4 updated", "mxfp4"):
        assert torch.equal(found[key], expected[key]), (key, (found[key] - expected[key]).abs().max())
    assert "NVFP4 W4A16" in printed["nvfp4"] and "MXFP4 W4A16" in printed["mxfp4"], printed
    # the formats differ, and the update reached the engine
    assert (found["nvfp4"] - found["mxfp4"]).abs().mean() > 1e-3
    assert (found["nvfp4"] - found["nvfp4 updated"]).abs().mean() > 1e-3


def test_engine_configs_name_what_vllm_loads_them_by():
    from megatron_ais.bridge.quantization import QuantizationPolicy, engine_quantization_config

    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    keep = ("layers\\.1\\.mlp\\.down",)
    nvfp4 = engine_quantization_config(QuantizationPolicy(precision="nvfp4", exclude=keep), names)
    assert nvfp4 == {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16,
                     "ignore": ["lm_head", "model.layers.1.mlp.down_proj"]}
    mxfp4 = engine_quantization_config(QuantizationPolicy(precision="mxfp4"), names)
    assert mxfp4["format"] == "mxfp4-pack-quantized" and mxfp4["ignore"] == ["lm_head"]
    assert mxfp4["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert mxfp4["config_groups"]["group_0"]["input_activations"] is None
    # a layer's experts kept in BF16: compressed-tensors looks them up by their own names (`...experts.0.gate_proj`)
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    experts = [f"model.layers.{layer}.mlp.experts.0.{p}_proj.weight" for layer in (0, 1)
               for p in ("gate", "up", "down")]
    kept = engine_quantization_config(QuantizationPolicy(precision="mxfp4", exclude=("layers\\.1\\.mlp\\.experts",)),
                                      experts)["ignore"]
    assert should_ignore_layer("model.layers.1.mlp.experts.0.gate_proj", kept)
    assert not should_ignore_layer("model.layers.0.mlp.experts.0.gate_proj", kept)
    assert not should_ignore_layer("model.layers.10.mlp.experts.0.gate_proj", kept)


def test_nvfp4_fused_projections_share_one_global_scale_and_other_layers_their_own():
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine

    generator = torch.Generator().manual_seed(0)
    prefix = "model.layers.0"
    weights = {f"{prefix}.self_attn.{p}_proj.weight": torch.randn(32, 64, generator=generator) * (i + 1)
               for i, p in enumerate("qkvo")}
    weights[f"{prefix}.mlp.gate_proj.weight"] = torch.randn(64, 64, generator=generator)
    weights[f"{prefix}.mlp.up_proj.weight"] = torch.randn(64, 64, generator=generator) * 3
    out = dict(quantize_for_engine(weights.items(), QuantizationPolicy(precision="nvfp4")))
    scale = {p: float(out[f"{prefix}.{p}.weight_scale_2"]) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj")}
    qkv_amax = max(float(weights[f"{prefix}.self_attn.{p}_proj.weight"].abs().max()) for p in "qkv")
    assert scale["self_attn.q_proj"] == scale["self_attn.k_proj"] == scale["self_attn.v_proj"]
    assert scale["self_attn.q_proj"] == pytest.approx(qkv_amax / (6 * 448), rel=1e-6)
    assert scale["self_attn.o_proj"] == pytest.approx(
        float(weights[f"{prefix}.self_attn.o_proj.weight"].abs().max()) / (6 * 448), rel=1e-6)
    assert scale["mlp.gate_proj"] == scale["mlp.up_proj"] != scale["self_attn.q_proj"]
    with pytest.raises(ValueError, match="without the rest of their fused group"):
        list(quantize_for_engine([(f"{prefix}.self_attn.q_proj.weight", weights[f"{prefix}.self_attn.q_proj.weight"])],
                                 QuantizationPolicy(precision="nvfp4")))


def test_4bit_refusals_name_the_flag():
    from types import SimpleNamespace

    from megatron_ais.bridge.quantization import QuantizationPolicy, check_engine_shapes

    dense = SimpleNamespace(num_layers=1, num_attention_heads=4, head_dim=64, hidden_size=256, ffn_hidden_size=688,
                            is_moe=False)
    check_engine_shapes(dense, QuantizationPolicy(precision="nvfp4"), 1)  # 688 = 43 x 16
    with pytest.raises(ValueError, match="mlp.down_proj.weight has 688 input columns .* not whole 1x32 groups"):
        check_engine_shapes(dense, QuantizationPolicy(precision="mxfp4"), 1)
    moe = SimpleNamespace(**{**vars(dense), "is_moe": True, "moe_ffn_hidden_size": 48})
    check_engine_shapes(moe, QuantizationPolicy(precision="nvfp4"), 1)  # 48 = 3 x 16
    with pytest.raises(ValueError, match="mlp.experts.0.down_proj.weight has 48 input columns .* not whole 1x32"):
        check_engine_shapes(moe, QuantizationPolicy(precision="mxfp4"), 1)
    # the HF export names its own flag, not the run's rollout flags it does not have
    with pytest.raises(ValueError, match=r"^--precision mxfp4: .*down_proj.weight has 688 input columns, not whole "
                                         r"1x32 groups .*; export it with --precision bf16$"):
        check_engine_shapes(dense, QuantizationPolicy(precision="mxfp4"), 1, export=True)


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp4", "fp8"])
def test_the_placement_estimate_counts_the_bytes_the_engine_receives(model_root, precision):
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.model import ModelShape
    from megatron_ais.rollout.placement import ModelBytes

    hf_dir = make_model_dir(model_root, "qwen3", **SHAPE)
    reader = HFCheckpointReader(hf_dir)
    sent = sum(t.numel() * t.element_size() for _, t in quantize_for_engine(
        ((n, reader.get(n)) for n in reader.names()), QuantizationPolicy(precision=precision)))
    with open(os.path.join(hf_dir, "config.json")) as f:
        estimate = ModelBytes.of(ModelShape.from_hf_config(json.load(f)), precision).sync
    assert estimate == pytest.approx(sent, rel=1e-3)  # NVFP4's fp32 global scales are left out of the estimate
