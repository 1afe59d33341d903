"""The declarative mapping covers every parameter megatron builds, under either layer spec."""
import inspect
import itertools
import re

import pytest

from distributed import spawn
from megatron_ais.mapping.rules import (ARCHITECTURES, canonical_name, expert_index, megatron_param_names, rules_for,
                                        split_layer)


def test_te_fused_norm_names_alias_local_names():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"


def _te_spec_name(local: str) -> str:
    """The TE spec's name of a local-spec MoE parameter: grouped experts (local expert i's weights are weight{i} of
    TEGroupedMLP's linear_fc1 / linear_fc2), the pre-attention norm fused into linear_qkv."""
    name = re.sub(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".mlp.experts.\2.weight\1", local)
    return name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")


def test_te_grouped_expert_names_alias_the_local_experts_both_ways():
    """TE's grouped experts, named by hand where TE does not import (the names checked against megatron-core's own
    source): every TE-spec parameter of a Qwen3-MoE stage maps to its local-spec rule, and its experts' HF tensors are
    every expert tensor of the HF checkpoint, each once (the GPU test below builds the TE model itself)."""
    import megatron.core.extensions.transformer_engine as te_extension
    import megatron.core.transformer.moe.experts as experts

    assert 'full_state_dict[f"weight{gemm_idx}"]' in inspect.getsource(te_extension)  # TEGroupedLinear's gemm i
    assert "class TEGroupedMLP" in inspect.getsource(experts)
    assert re.search(r"self\.linear_fc1 = build_module\(", inspect.getsource(experts.TEGroupedMLP))
    declared = megatron_param_names("qwen3_moe", range(2), True, True, tie_word_embeddings=False, experts=range(4))
    te_names = [_te_spec_name(name) for name in declared]
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in te_names
    assert [canonical_name(name) for name in te_names] == declared
    rules = rules_for("qwen3_moe")
    hf_expert_tensors = []
    for name in te_names:
        canonical = canonical_name(name)
        layer, template = split_layer(canonical)
        if ".experts." in name:
            hf_expert_tensors += rules[template].format(layer, expert_index(canonical))[1]
    assert sorted(hf_expert_tensors) == sorted(
        f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
        for layer, expert, proj in itertools.product(range(2), range(4), ("gate_proj", "up_proj", "down_proj")))


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_stage_names_have_rules_and_tied_output_only_off_the_first_stage(model_type):
    rules = rules_for(model_type)
    first = megatron_param_names(model_type, range(0, 2), True, False, tie_word_embeddings=True, experts=range(2))
    last = megatron_param_names(model_type, range(2, 4), False, True, tie_word_embeddings=True, experts=range(2))
    single = megatron_param_names(model_type, range(0, 4), True, True, tie_word_embeddings=True, experts=range(2))
    for name in first + last + single:
        assert split_layer(name)[1] in rules, name
    assert "output_layer.weight" in last and "output_layer.weight" not in single
    assert any(".layers.3." in n for n in last) and not any(".layers.3." in n for n in first)


def _model_names(model_type, use_te):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.model import ModelBuildConfig, ModelShape, build_gpt_model
    from megatron_ais.platform import apply_cpu_compat

    apply_cpu_compat()
    initialize_distributed()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    cfg = dict(model_type=model_type, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32)
    model = build_gpt_model(ModelBuildConfig(shape=ModelShape.from_hf_config(cfg), precision="fp32", use_te=use_te),
                            True, True)
    return [name for name, _ in model.named_parameters()]


def _built_model_names(model_type, use_te=False):
    """Parameter names of a real GPTModel (TP1) built in a fresh process."""
    (names,) = spawn(1, _model_names, model_type, use_te)
    return names


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_declared_names_equal_the_built_model(model_type):
    built = _built_model_names(model_type)
    declared = megatron_param_names(model_type, range(2), True, True, tie_word_embeddings=False, experts=range(4))
    assert sorted(built) == sorted(declared)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_te_spec_parameters_equal_declared_names_after_aliasing(model_type):
    pytest.importorskip("transformer_engine.pytorch")
    built = [canonical_name(n) for n in _built_model_names(model_type, use_te=True)]
    declared = megatron_param_names(model_type, range(2), True, True, tie_word_embeddings=False, experts=range(4))
    assert sorted(built) == sorted(declared)
