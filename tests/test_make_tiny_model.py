"""tools/make_tiny_model.py is deterministic by seed and writes a loadable model with a chat tokenizer."""
import filecmp
import os

import torch

from conftest import make_model_dir


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = make_model_dir(tmp_path / "a", "qwen2", seed=3)
    b = make_model_dir(tmp_path / "b", "qwen2", seed=3)
    c = make_model_dir(tmp_path / "c", "qwen2", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name
    assert not filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(c, "model.safetensors"), shallow=False)


def test_model_and_tokenizer_load_and_round_trip(model_root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert model.config.model_type == "qwen3" and model.config.num_key_value_heads == 1
    assert len(tok) <= model.config.vocab_size
    text = "What is 12 + 7? <answer>19</answer>"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == model.config.eos_token_id
    norms = model.model.layers[0].self_attn.q_norm.weight
    assert not torch.allclose(norms, torch.ones_like(norms)), "norms must be randomised"
