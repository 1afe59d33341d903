"""Engine tensors from a HF export: FP8 for attention/MLP linears (dequantizing within the e4m3 bound), BF16
for the rest; buckets bounded and verified against their manifest."""
import pytest
import torch

from conftest import make_model_dir
from kernels.fp8.format import blockwise_fp8_dequantize
from megatron_ais.bridge.buckets import manifest_entry, verify_bucket
from megatron_ais.bridge.quantization import (QuantizationPolicy, engine_quantization_config,
                                              quantize_for_engine)
from megatron_ais.mapping.hf_io import HFCheckpointReader


def _hf(model_root):
    reader = HFCheckpointReader(make_model_dir(model_root, "qwen3", hidden_size=128, intermediate_size=256,
                                               num_attention_heads=4, num_key_value_heads=2))
    return {n: reader.get(n) for n in reader.names()}


def test_fp8_policy_names_dtypes_and_bound(model_root):
    hf = _hf(model_root)
    engine = dict(quantize_for_engine(hf.items(), QuantizationPolicy()))
    for name, tensor in hf.items():
        if any(p in name for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            q, s = engine[name], engine[name + "_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            err = (blockwise_fp8_dequantize(q, s, 128, torch.float32) - tensor.float()).abs()
            assert bool((err <= 2 ** -4 * tensor.float().abs() + s.max() * 2 ** -9).all()), name
        else:
            assert engine[name].dtype == torch.bfloat16 and name + "_scale_inv" not in engine
            assert torch.equal(engine[name], tensor.to(torch.bfloat16))
    assert "model.embed_tokens.weight" in engine and engine["model.embed_tokens.weight"].dtype == torch.bfloat16
    bf16 = dict(quantize_for_engine(hf.items(), QuantizationPolicy(precision="bf16")))
    assert set(bf16) == set(hf) and all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_quantization_config_and_ignored_layers(model_root):
    hf = _hf(model_root)
    config = engine_quantization_config(QuantizationPolicy(), hf)
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]}
    policy = QuantizationPolicy(exclude=(r"layers\.0\.mlp\.",))
    assert engine_quantization_config(policy, hf)["ignored_layers"] == [
        "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    with pytest.raises(ValueError, match="vLLM fuses them"):
        engine_quantization_config(QuantizationPolicy(exclude=(r"layers\.1\.self_attn\.q_proj",)), hf)
    assert engine_quantization_config(QuantizationPolicy(precision="bf16"), hf) is None


def test_nan_weight_is_refused():
    bad = torch.ones(4, 4)
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="model.norm.weight: NaN/Inf"):
        list(quantize_for_engine([("model.norm.weight", bad)], QuantizationPolicy()))


def test_stage_plan_buckets_bounded_ordered_and_aligned(model_root):
    from megatron_ais.bridge.plan import HFTarget, plan_stage
    from megatron_ais.mapping.layouts import Piece

    policy = QuantizationPolicy()
    hf = _hf(model_root)
    targets = [HFTarget(n, tuple(t.shape), t, [Piece(0, 0, 0, 0, t.shape[0])], policy.quantizes(n),
                        policy.quantizes(n)) for n, t in hf.items()]
    limit = 64 * 1024
    plan = plan_stage(targets, policy, limit)
    engine = list(quantize_for_engine(hf.items(), policy))
    assert [(t.name, t.dtype, t.shape) for t in plan.tensors] == [
        (n, str(x.dtype).removeprefix("torch."), tuple(x.shape)) for n, x in engine]
    assert all(t.offset % 64 == 0 for t in plan.tensors)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(plan.tensors, plan.tensors[1:]))
    assert [b.first for b in plan.buckets[1:]] == [b.last for b in plan.buckets[:-1]]
    assert plan.buckets[-1].last == len(plan.tensors) and len(plan.buckets) > 3
    for b in plan.buckets:
        names = [t.name for t in plan.tensors[b.first:b.last]]
        assert b.nbytes <= limit or len({n.removesuffix("_scale_inv") for n in names}) == 1
        # a weight never travels without its scales
        assert all(n + "_scale_inv" in names for n in names if policy.quantizes(n))


def test_manifest_refuses_altered_swapped_or_truncated_bytes(model_root):
    from kernels.integrity import checksum_sums, checksum_sums_reference

    bucket = [(n, t) for n, t in quantize_for_engine(_hf(model_root).items(), QuantizationPolicy())][:6]
    manifest = [manifest_entry(n, t) for n, t in bucket]
    verify_bucket(bucket, manifest)
    name, tensor = next((n, t) for n, t in bucket if t.dtype == torch.float8_e4m3fn)
    raw = tensor.view(-1).view(torch.uint8)
    flipped = raw.clone()
    flipped[0] ^= 1
    swapped = raw.clone().view(-1, 8)  # two 8-byte runs trade places: an additive sum would not notice
    swapped[[0, 4]] = swapped[[4, 0]]
    assert not torch.equal(swapped[0], swapped[4])
    for bad in (flipped, swapped.view(-1)):
        with pytest.raises(ValueError, match=f"{name}: checksum"):
            verify_bucket([(name, bad.view(torch.float8_e4m3fn).view(tensor.shape)) if n == name else (n, t)
                           for n, t in bucket], manifest)
    with pytest.raises(ValueError, match=f"{name}: shape"):
        verify_bucket([(name, tensor[:-1]) if n == name else (n, t) for n, t in bucket], manifest)
    assert checksum_sums(raw) == checksum_sums_reference(raw)
