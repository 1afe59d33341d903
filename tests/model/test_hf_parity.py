"""Megatron logits after loading HF weights equal transformers' fp32 forward, at TP1/TP2/PP2/TP2xPP2."""
import os

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

TOLERANCE = 1e-4


def _pipeline_logits(chunks, tokens):
    """Return full-vocabulary logits [b, s, V_padded] (on the host) on the last stage, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ais.platform import device

    tokens = tokens.to(device())
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, position_ids, attention_mask=None)
        return output, lambda out: (out.float().sum() * 0, {"logits": out.detach().float()})

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=chunks,
                                      num_microbatches=1, seq_length=tokens.shape[1],
                                      micro_batch_size=tokens.shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    local = out[0]["logits"]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).cpu()


def _naive_fc1_shard(self, hf, ctx):
    """A wrong layout (plain concatenation of gate and up, then split) used as a negative control."""
    return torch.cat(hf).chunk(ctx.tp_size, dim=0)[ctx.tp_rank]


def _parity_worker(cases, export_root=None):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from distributed import start_trainer
    from megatron_ais.mapping import layouts
    from megatron_ais.mapping.distributed import load_hf_weights, save_hf_checkpoint
    from megatron_ais.model import build_model_chunks

    results = []
    correct_shard = layouts.GatedFC1.shard
    for hf_dir, tp, pp, *broken in cases:
        layouts.GatedFC1.shard = _naive_fc1_shard if broken else correct_shard
        _, hf_config, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", tp,
                                            "--pipeline-model-parallel-size", pp, "--seq-length", 16,
                                            "--transformer-impl", "local")
        chunks = build_model_chunks(build)
        load_hf_weights(chunks, hf_dir, build, ps.get_tensor_model_parallel_rank())
        tokens = torch.randint(0, build.shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
        logits = _pipeline_logits(chunks, tokens)
        diff = None
        if logits is not None:
            hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            with torch.no_grad():
                ref = hf(tokens).logits
            diff = (logits[..., : build.shape.vocab_size] - ref).abs().max().item()
            scale = ref.abs().max().item()
            results.append((hf_dir, tp, pp, diff, scale, logits.shape[-1], bool(broken)))
        if export_root is not None:
            out = f"{export_root}/{os.path.basename(hf_dir)}-tp{tp}pp{pp}"
            save_hf_checkpoint(chunks, build, hf_config, out, ps.get_tensor_model_parallel_group(),
                               ps.get_pipeline_model_parallel_group(),
                               is_stage_writer=ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0,
                               dtype=torch.bfloat16)
            dist.barrier()
        ps.destroy_model_parallel()
    return results


def _check(results):
    checked = [r for rank in results for r in rank]
    assert checked
    for hf_dir, tp, pp, diff, scale, padded, broken in checked:
        if broken:
            assert diff > 1e-2, f"negative control: a wrong fc1 layout went unnoticed (diff {diff:.3e})"
            continue
        assert scale > 1.0, f"{hf_dir}: logits too small ({scale}) for the comparison to mean anything"
        assert diff <= TOLERANCE, f"{hf_dir} TP{tp} PP{pp}: max |logits - HF| = {diff:.3e} (scale {scale:.2f})"
    return checked


@pytest.mark.slow
def test_logits_match_transformers_two_ranks(model_root):
    archs = {a: make_model_dir(model_root, a) for a in ("llama", "qwen2", "qwen3")}
    kv1 = make_model_dir(model_root, "qwen3", num_key_value_heads=1)
    tied = make_model_dir(model_root, "llama", tie_word_embeddings=True)
    cases = [(archs["llama"], 1, 1)]
    cases += [(d, 2, 1) for d in archs.values()] + [(d, 1, 2) for d in archs.values()]
    cases += [(kv1, 2, 1), (tied, 1, 2), (tied, 2, 1), (archs["llama"], 2, 1, "broken")]
    checked = _check(spawn(2, _parity_worker, cases))
    # TP1 at world 2 runs as DP2: both replicas report; every other case reports from its last stage
    assert {(c[0], c[1], c[2]) for c in checked} == {c[:3] for c in cases}
    assert any(c[5] > 384 for c in checked), "vocab padding was not exercised"


@pytest.mark.slow
def test_logits_match_transformers_tp2_pp2_and_export(model_root, tmp_path):
    from megatron_ais.mapping.hf_io import HFCheckpointReader

    cases = [(make_model_dir(model_root, a), 2, 2) for a in ("llama", "qwen2", "qwen3")]
    cases.append((make_model_dir(model_root, "qwen3", num_key_value_heads=1, tie_word_embeddings=True), 2, 2))
    checked = _check(spawn(4, _parity_worker, cases, str(tmp_path)))
    assert {(c[0], c[1], c[2]) for c in checked} == set(cases)
    # the distributed export (one file per PP stage) reproduces the HF tensors bit for bit
    for hf_dir, _, _ in cases:
        out = tmp_path / f"{os.path.basename(hf_dir)}-tp2pp2"
        assert sorted(p.name for p in out.glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        source, exported = HFCheckpointReader(hf_dir), HFCheckpointReader(str(out))
        assert sorted(source.names()) == sorted(exported.names())
        for name in source.names():
            assert torch.equal(source.get(name), exported.get(name)), name
