"""The declarative mapping covers every parameter megatron builds, under either layer spec."""
import pytest

from megatron_ais.mapping.rules import ARCHITECTURES, canonical_name, megatron_param_names, rules_for, split_layer


def test_te_fused_norm_names_alias_local_names():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"


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


def _built_model_names(model_type, use_te=False):
    """Parameter names of a real GPTModel (TP1) built in a fresh process."""
    import subprocess
    import sys
    code = f"""
import os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1")
from megatron_ais.platform import apply_cpu_compat, distributed_backend; apply_cpu_compat()
import torch.distributed as dist; dist.init_process_group(distributed_backend())
from megatron.core import parallel_state as ps; ps.initialize_model_parallel()
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed; model_parallel_cuda_manual_seed(0)
from megatron_ais.model import ModelBuildConfig, ModelShape, build_gpt_model
cfg = dict(model_type="{model_type}", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32)
m = build_gpt_model(ModelBuildConfig(shape=ModelShape.from_hf_config(cfg), precision="fp32", use_te={use_te}),
                    True, True)
print("\\n".join(n for n, _ in m.named_parameters()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


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
