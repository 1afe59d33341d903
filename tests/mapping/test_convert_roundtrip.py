"""HF -> Megatron (TP x PP) -> HF is bit-exact, for the tiny models and for shapes drawn at random."""
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import convert_checkpoint
from conftest import make_model_dir
from megatron_ais.mapping import layouts
from megatron_ais.mapping.hf_io import HFCheckpointReader
from megatron_ais.parallel import ParallelLayout


def _read_all(hf_dir):
    reader = HFCheckpointReader(hf_dir)
    return {n: reader.get(n) for n in reader.names()}


def roundtrip_mismatches(hf_dir, work, tp, pp, ep=1, etp=None):
    """Convert hf_dir to Megatron at TP x PP (x EP x expert-TP) and back; return the tensor names that differ (or
    are missing)."""
    convert_checkpoint.hf_to_megatron(hf_dir, os.path.join(work, "megatron"), tp, pp, ep=ep, etp=etp)
    out = convert_checkpoint.megatron_to_hf(os.path.join(work, "megatron"), os.path.join(work, "hf"))
    before, after = _read_all(hf_dir), _read_all(out)
    bad = sorted(set(before) ^ set(after))
    bad += [n for n in sorted(set(before) & set(after))
            if before[n].dtype != after[n].dtype or not torch.equal(before[n], after[n])]
    return bad


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_moe_roundtrip_at_ep2_bit_exact(model_root, tmp_path, tp, ep):
    """One directory per expert-parallel rank, experts under their local index; back to HF bit for bit."""
    hf_dir = make_model_dir(model_root, "qwen3_moe", initializer_range=0.1)
    assert roundtrip_mismatches(hf_dir, str(tmp_path), tp, 1, ep) == []
    shards = sorted(d for d in os.listdir(tmp_path / "megatron" / "iter_0000000") if d.startswith("mp_rank"))
    assert shards == [f"mp_rank_{t:02d}_{e:03d}" for t in range(tp) for e in range(ep)]
    rank1 = torch.load(tmp_path / "megatron" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt",
                       weights_only=False)["model"]
    # EP rank 1 holds experts 4-7 of 8 as local_experts.0-3
    assert not any(".local_experts.4." in n for n in rank1) and any(".local_experts.3." in n for n in rank1)
    source = _read_all(hf_dir)
    assert torch.equal(rank1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                       source["model.layers.0.mlp.experts.4.down_proj.weight"]
                       .chunk(tp, dim=1)[0].to(rank1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].dtype))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_roundtrip_tp2_pp2_bit_exact_and_loads_in_transformers(arch, model_root, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = make_model_dir(model_root, arch, tie_word_embeddings=arch == "qwen3")
    assert roundtrip_mismatches(hf_dir, str(tmp_path), 2, 2) == []
    original = AutoModelForCausalLM.from_pretrained(hf_dir)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ref, out = original.state_dict(), exported.state_dict()
    assert ref.keys() == out.keys()
    assert all(torch.equal(ref[k], out[k]) for k in ref)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False).startswith("<|im_start|>")


def _load_and_export_worker(load, export_dir, flags):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.mapping.distributed import save_hf_checkpoint
    from megatron_ais.training import load_policy_chunks

    trainer, hf_config, build = start_trainer("--load", load, "--fp32", "--seq-length", "16", *flags)
    chunks, assets, _ = load_policy_chunks(build, trainer.weights)
    save_hf_checkpoint(chunks, build, hf_config, export_dir, ps.get_tensor_model_parallel_group(),
                       ps.get_pipeline_model_parallel_group(),
                       ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0,
                       assets_from=assets)
    dist.barrier()


@pytest.mark.slow
def test_moe_checkpoint_at_expert_tp1_under_tp2(model_root, tmp_path):
    """hf-to-megatron at TP2 x EP2 x expert-TP 1 writes the shard directories a run at that layout saves (whole
    experts); back to HF bit for bit, and a 4-rank trainer at that layout --loads it and exports the same tensors."""
    from distributed import spawn

    hf_dir = make_model_dir(model_root, "qwen3_moe", initializer_range=0.1)
    assert roundtrip_mismatches(hf_dir, str(tmp_path), 2, 1, 2, 1) == []
    shards = sorted(d for d in os.listdir(tmp_path / "megatron" / "iter_0000000") if d.startswith("mp_rank"))
    assert shards == ["mp_rank_00_000", "mp_rank_01_001"]
    assert ParallelLayout(tensor=4, expert=2, expert_tensor=1).shard_directories() == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert ParallelLayout(tensor=2, expert=2, expert_tensor=2).shard_directories() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1"]
    spawn(4, _load_and_export_worker, str(tmp_path / "megatron"), str(tmp_path / "live"), flags)
    source, live = _read_all(hf_dir), _read_all(str(tmp_path / "live"))
    assert sorted(source) == sorted(live)
    assert all(torch.equal(live[n], source[n].to(live[n].dtype)) for n in source)


def test_wrong_mapping_breaks_the_roundtrip(model_root, tmp_path, monkeypatch):
    """Negative control: reading the fused QKV as [Q; K; V] blocks on export must be caught."""
    hf_dir = make_model_dir(model_root, "llama")

    def naive_merge(self, shards, ctx):
        full = torch.cat(shards, dim=0)
        q_rows = ctx.num_attention_heads * ctx.head_dim
        kv_rows = ctx.num_key_value_heads * ctx.head_dim
        return list(full.split([q_rows, kv_rows, kv_rows], dim=0))

    monkeypatch.setattr(layouts.FusedQKV, "merge", naive_merge)
    bad = roundtrip_mismatches(hf_dir, str(tmp_path), 2, 1)
    assert any("q_proj" in n for n in bad) and any("k_proj" in n for n in bad)


def _write_random_hf(directory, arch, layers, heads, kv_heads, head_dim, hidden, ffn, vocab, tie, seed):
    """Write a config.json + safetensors of random tensors in HF layout (no transformers model needed)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    t = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": rnd(hidden)}
    if not tie:
        t["lm_head.weight"] = rnd(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = rnd(hidden)
        t[f"{p}.post_attention_layernorm.weight"] = rnd(hidden)
        t[f"{p}.self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        t[f"{p}.self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[f"{p}.self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[f"{p}.self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[f"{p}.mlp.gate_proj.weight"] = rnd(ffn, hidden)
        t[f"{p}.mlp.up_proj.weight"] = rnd(ffn, hidden)
        t[f"{p}.mlp.down_proj.weight"] = rnd(hidden, ffn)
        if arch == "qwen2":
            for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[f"{p}.self_attn.{proj}_proj.bias"] = rnd(n * head_dim)
        if arch == "qwen3":
            t[f"{p}.self_attn.q_norm.weight"] = rnd(head_dim)
            t[f"{p}.self_attn.k_norm.weight"] = rnd(head_dim)
    os.makedirs(directory, exist_ok=True)
    save_file(t, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": arch, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_size": hidden,
                   "intermediate_size": ffn, "vocab_size": vocab, "tie_word_embeddings": tie,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 128}, f)


@st.composite
def model_and_layout(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4]))
    heads = heads if heads % tp == 0 else heads * tp
    if kv_heads % tp and tp % kv_heads:
        tp = kv_heads
    ffn = tp * draw(st.integers(1, 12))
    arch, head_dim = draw(st.sampled_from(["llama", "qwen2", "qwen3"])), draw(st.sampled_from([2, 4, 6]))
    # vLLM's Qwen2 has no head_dim of its own: hidden / heads
    hidden = heads * head_dim if arch == "qwen2" else draw(st.integers(3, 24))
    return dict(arch=arch, layers=pp * draw(st.integers(1, 2)), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                hidden=hidden, ffn=ffn, vocab=draw(st.integers(5, 300)), tie=draw(st.booleans()), tp=tp, pp=pp,
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_and_layout())
def test_roundtrip_holds_for_random_shapes(case, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("rt"))
    tp, pp = case.pop("tp"), case.pop("pp")
    qkv_rows = case["head_dim"] * (case["heads"] + 2 * case["kv_heads"])
    assume(qkv_rows % tp == 0)  # other layouts are rejected by validation (tests/test_arguments.py)
    hf_dir = os.path.join(work, "src")
    _write_random_hf(hf_dir, **case)
    assert roundtrip_mismatches(hf_dir, work, tp, pp) == []
    # the shards really are split: TP ranks hold different, correctly sized pieces
    shard = torch.load(os.path.join(work, "megatron", "iter_0000000",
                                    "mp_rank_00" + ("_000" if pp > 1 else ""), "model_optim_rng.pt"))["model"]
    emb = shard["embedding.word_embeddings.weight"]
    assert emb.shape[0] * tp % (128 * tp) == 0 and emb.shape[0] * tp >= case["vocab"]


def test_converting_into_a_run_directory_is_refused(model_root, tmp_path):
    from megatron_ais.errors import ArgumentValidationError

    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=128, intermediate_size=256)
    save = str(tmp_path / "run")
    convert_checkpoint.hf_to_megatron(hf_dir, save, 1, 1)
    with pytest.raises(ArgumentValidationError, match="already holds a checkpoint run"):
        convert_checkpoint.hf_to_megatron(hf_dir, save, 1, 1)


@pytest.mark.parametrize("damage, message", [
    (lambda w: w["model.layers.1.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")),
     r"model.layers.1.mlp.up_proj.weight holds NaN/Inf"),
    (lambda w: w.__setitem__("model.layers.1.mlp.up_proj.weight", w["model.layers.1.mlp.up_proj.weight"][:4]),
     r"model.layers.1.mlp.up_proj.weight has shape \(4, 8\), its config.json gives \(16, 8\)"),
    (lambda w: w.__setitem__("model.layers.0.mlp.down_proj.weight",
                             w["model.layers.0.mlp.down_proj.weight"].to(torch.float8_e4m3fn)),
     r"model.layers.0.mlp.down_proj.weight is torch.float8_e4m3fn, not unquantized"),
])
def test_a_broken_hf_source_is_refused_by_tensor_and_leaves_nothing(tmp_path, damage, message):
    # a short up_proj was converted (megatron's fused gate/up shard was the only check), NaN too
    from safetensors.torch import load_file

    from megatron_ais.errors import CheckpointError

    src = str(tmp_path / "src")
    _write_random_hf(src, "llama", 2, 2, 2, 4, 8, 16, 64, False, 0)
    weights = load_file(os.path.join(src, "model.safetensors"))
    damage(weights)
    save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint.hf_to_megatron(src, str(tmp_path / "megatron"), 1, 1)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_an_export_never_overwrites_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch):
    """megatron-to-hf refuses a non-empty --save by name; a NaN found after some shards were written (a checkpoint
    from a broken HF source, converted here past the converter's own check) is refused by tensor name and leaves no
    directory behind."""
    from safetensors.torch import load_file

    from megatron_ais.errors import ArgumentValidationError, CheckpointError

    src = str(tmp_path / "src")
    _write_random_hf(src, "llama", 2, 2, 2, 4, 8, 16, 64, False, 0)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(convert_checkpoint, "checked_reader", lambda reader, shape: reader.get)
    convert_checkpoint.hf_to_megatron(src, str(tmp_path / "megatron"), 1, 1)
    monkeypatch.undo()

    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    with pytest.raises(ArgumentValidationError, match="--save .*full is not empty"):
        convert_checkpoint.megatron_to_hf(str(tmp_path / "megatron"), str(full))
    assert os.listdir(full) == ["notes.txt"]

    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.down_proj.weight holds NaN/Inf"):
        convert_checkpoint.megatron_to_hf(str(tmp_path / "megatron"), str(tmp_path / "hf"), max_shard_bytes=256)
    assert sorted(os.listdir(tmp_path)) == ["full", "megatron", "src"]
