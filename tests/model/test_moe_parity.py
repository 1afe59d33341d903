"""Qwen3-MoE in megatron-core (local spec, SequentialMLP experts, alltoall dispatcher): logits after loading the HF
weights equal transformers' fp32 forward at EP1, EP2 and EP2xTP2; experts numbered by their local index instead of
their global one (the classic expert-parallel loading bug) are caught."""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from test_hf_parity import TOLERANCE, _pipeline_logits


def _moe_worker(hf_dir, tp, ep, local_numbering=False):
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from distributed import start_trainer
    from megatron_ais.mapping.distributed import load_hf_weights
    from megatron_ais.model import build_model_chunks, unwrap_model

    _, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", tp,
                                "--expert-model-parallel-size", ep, "--seq-length", 16, "--transformer-impl", "local",
                                *(["--sequence-parallel"] if tp > 1 else []))
    chunks = build_model_chunks(build)
    layers = unwrap_model(chunks[0]).decoder.layers
    experts = [list(layer.mlp.local_expert_indices) for layer in layers]
    if local_numbering:
        for layer in layers:
            layer.mlp.local_expert_indices = list(range(len(layer.mlp.local_expert_indices)))
    load_hf_weights(chunks, hf_dir, build, ps.get_tensor_model_parallel_rank())
    tokens = torch.randint(0, build.shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = _pipeline_logits(chunks, tokens)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(tokens).logits
    diff = (logits[..., : build.shape.vocab_size] - ref).abs().max().item()
    on = next(chunks[0].parameters()).device.type
    ps.destroy_model_parallel()
    return diff, experts[0], type(layers[0].mlp.experts).__name__, on


@pytest.fixture(scope="module")
def moe_dir(model_root):
    # std 0.1 so that router logits are far from ties (exact parity needs the same top-k on both sides)
    return make_model_dir(model_root, "qwen3_moe", num_layers=2, initializer_range=0.1)


def test_moe_logits_equal_hf_at_ep1(moe_dir):
    ((diff, experts, kind, on),) = spawn(1, _moe_worker, moe_dir, 1, 1)
    assert kind == "SequentialMLP" and experts == list(range(8)) and on == "cpu"
    assert diff <= TOLERANCE


@pytest.mark.gpu
def test_moe_logits_equal_hf_on_the_gpu(moe_dir):
    """On a CUDA machine megatron builds and runs the model on the GPU (local spec, no Transformer Engine)."""
    ((diff, experts, kind, on),) = spawn(1, _moe_worker, moe_dir, 1, 1)
    assert kind == "SequentialMLP" and experts == list(range(8)) and on == "cuda"
    assert diff <= TOLERANCE


@pytest.mark.slow
def test_moe_logits_equal_hf_at_ep2_and_local_numbering_is_caught(moe_dir):
    results = spawn(2, _moe_worker, moe_dir, 1, 2)
    assert sorted(e for _, e, _, _ in results) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each rank holds its own experts
    assert all(diff <= TOLERANCE for diff, *_ in results)
    wrong = spawn(2, _moe_worker, moe_dir, 1, 2, True)
    assert all(diff > 100 * TOLERANCE for diff, *_ in wrong)


@pytest.mark.slow
def test_moe_logits_equal_hf_at_ep2_tp2(moe_dir):
    results = spawn(4, _moe_worker, moe_dir, 2, 2)
    assert all(diff <= TOLERANCE for diff, *_ in results)


def _forced_gate(gate, forced):
    """A transformers Qwen3-MoE gate that routes every token to the experts `forced` [tokens, k] names, weighting
    them by its softmax over all experts, renormalised over the chosen ones (norm_topk_prob)."""
    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        chosen = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, forced)
        return logits, (chosen / chosen.sum(dim=-1, keepdim=True)).to(logits.dtype), forced
    return forward


def _hf_logprobs(hf, tokens, labels, routes=None):
    """transformers' log-probs of the labels; `routes` [b, s, layers, k]: every MoE layer forced to them."""
    for index, layer in enumerate(hf.model.layers):
        gate = layer.mlp.gate
        gate.forward = type(gate).forward.__get__(gate) if routes is None else \
            _forced_gate(gate, routes[:, :, index].reshape(-1, routes.shape[-1]).long())
    with torch.no_grad():
        logits = hf(tokens).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _replay_worker(hf_dir, tp, ep, pp):
    """Megatron's log-probs of random tokens: routing itself, replaying the routes transformers chooses, and
    replaying other routes; with transformers' log-probs under the same forced routes."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from distributed import start_trainer
    from megatron_ais.forward import ParallelGroups, forward_logprobs
    from megatron_ais.mapping.distributed import load_hf_weights
    from megatron_ais.model import build_model_chunks
    from megatron_ais.platform import to_device

    _, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", tp,
                                "--expert-model-parallel-size", ep, "--pipeline-model-parallel-size", pp,
                                "--seq-length", 16, "--transformer-impl", "local",
                                *(["--sequence-parallel"] if tp > 1 else []))
    chunks = build_model_chunks(build)
    load_hf_weights(chunks, hf_dir, build, ps.get_tensor_model_parallel_rank())
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, build.shape.vocab_size, (2, 17), generator=generator)
    tokens, labels = tokens[:, :-1], tokens[:, 1:]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    own = _hf_routes(hf, tokens)
    other = torch.rand(2, 16, 2, 8, generator=generator).argsort(-1)[..., :2].to(torch.int16)
    groups, vocab = ParallelGroups.from_parallel_state(), build.shape.vocab_size

    def megatron(routes):
        mb = {"tokens": tokens, "labels": labels,
              "position_ids": torch.arange(16).unsqueeze(0).expand(2, 16).contiguous()}
        if routes is not None:
            mb["routed_experts"] = routes
        out = forward_logprobs(chunks, [to_device(mb)], groups, vocab)
        return None if out is None else out[0].cpu()

    from megatron.core.transformer.moe.router import TopKRouter

    maps = {}
    hooks = [m.register_forward_hook(lambda module, args, output: maps.__setitem__(module.layer_number, output[1]))
             for m in chunks[0].modules() if isinstance(m, TopKRouter)]
    replayed_other = megatron(other)
    for hook in hooks:
        hook.remove()
    # every token went to the given experts in this rank's layers: the [s, b] tokens its routers see (under
    # sequence parallelism this TP rank's share of the positions)
    shard = 16 // tp
    positions = slice(ps.get_tensor_model_parallel_rank() * shard, (ps.get_tensor_model_parallel_rank() + 1) * shard)
    routed = all(torch.equal(routing_map.cpu(), torch.zeros(shard, 2, 8, dtype=torch.bool).scatter_(
        -1, other[:, positions, number - 1].transpose(0, 1).long(), True).reshape(-1, 8))
        for number, routing_map in maps.items())
    results = (megatron(None), megatron(own), replayed_other, _hf_logprobs(hf, tokens, labels, other),
               _hf_logprobs(hf, tokens, labels))
    ps.destroy_model_parallel()
    return results if groups.is_last_stage else None, routed, sorted(maps)


def _hf_routes(hf, tokens):
    """The top-k experts transformers' own routers choose for every token and layer [b, s, layers, k] (int16)."""
    routes = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, output, index=index: routes.__setitem__(index, output[2]))
        for index, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hf(tokens)
    for hook in hooks:
        hook.remove()
    b, s = tokens.shape
    return torch.stack([routes[i].reshape(b, s, -1) for i in sorted(routes)], dim=2).to(torch.int16)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,pp", [(1, 2, 1), (2, 1, 1), (1, 1, 2)], ids=["ep2", "tp2-sp", "pp2"])
def test_replayed_routes_route_every_token_and_match_a_forced_reference(moe_dir, tp, ep, pp):
    """Replaying the routes the model would choose itself changes no log-prob (bit for bit); replaying other routes
    changes them, to transformers' log-probs under the same forced routes."""
    ranks = spawn(2, _replay_worker, moe_dir, tp, ep, pp)
    assert all(routed for _, routed, _ in ranks)  # each rank's routers used the given ids, token by token
    assert sorted({layer for _, _, layers in ranks for layer in layers}) == [1, 2]
    scored = [results for results, _, _ in ranks if results is not None]
    assert scored
    for results in scored:  # every last-stage rank's (at EP2 and TP2 both score)
        _check_replay(results)


@pytest.mark.gpu
def test_replayed_routes_on_the_gpu(moe_dir):
    ((results, routed, layers),) = spawn(1, _replay_worker, moe_dir, 1, 1, 1)
    assert routed and layers == [1, 2]
    _check_replay(results)


def _check_replay(results):
    own, replayed_own, replayed_other, forced, reference = results
    assert (own - reference).abs().max() <= TOLERANCE  # the unforced forwards agree (so do their routes)
    assert torch.equal(replayed_own, own)
    assert (replayed_other - own).abs().max() > 100 * TOLERANCE
    assert (replayed_other - forced).abs().max() <= TOLERANCE


def _router_gradients_worker(hf_dir, tp, pp, lengths, with_real_positions):
    """The routers' gradients of the load-balancing loss alone (Qwen3-MoE's router_aux_loss_coef; the logits enter
    the backward with weight 0) for a row of 10 real tokens padded to each of `lengths`."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from distributed import start_trainer
    from megatron_ais.mapping.distributed import load_hf_weights
    from megatron_ais.model import build_model_chunks
    from megatron_ais.platform import to_device
    from megatron_ais.routing_replay import forward_replaying

    _, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--tensor-model-parallel-size", tp,
                                "--pipeline-model-parallel-size", pp, "--seq-length", max(lengths),
                                "--transformer-impl", "local", *(["--sequence-parallel"] if tp > 1 else []))
    chunks = build_model_chunks(build)
    load_hf_weights(chunks, hf_dir, build, ps.get_tensor_model_parallel_rank())
    tokens = torch.randint(1, build.shape.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    out = []
    # the last: a token-budget placeholder (no real position; `forward.micro_batches`), which DP ranks with fewer
    # micro-batches than the others run
    for length, real in [(length, 10) for length in lengths] + [(lengths[0], 0)] * with_real_positions:
        mb = {"tokens": torch.cat([tokens[:, :real], torch.zeros(1, length - real, dtype=torch.long)], dim=1),
              "position_ids": torch.arange(length).unsqueeze(0)}
        if with_real_positions:
            mb["real_positions"] = torch.arange(length).unsqueeze(0) < real

        def forward_step(data_iterator, model):
            output = forward_replaying(model, next(data_iterator))
            return output, lambda logits: (logits.sum() * 0.0, {})

        for param in chunks[0].parameters():
            param.grad = None
        chunks[0].train()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([to_device(mb)]),
                                    model=chunks[0], num_microbatches=1, seq_length=length, micro_batch_size=1)
        stage = ps.get_pipeline_model_parallel_rank()
        out.append({(stage, n): p.grad.clone() for n, p in chunks[0].named_parameters() if "router" in n})
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)], ids=["one-rank", "tp2-sp-pp2"])
def test_padding_does_not_reach_the_load_balancing_loss(moe_dir, tp, pp):
    # the update's micro-batches are padded to a length that depends on how rows are grouped; megatron's aux loss
    # counted every padded position until the micro-batches carried their real positions (a later pipeline stage
    # gets its own sequence-parallel share of the padding mask: megatron splits it on the first stage only)
    def summed(ranks, index):  # a router's gradient is the sum of its sequence-parallel shares' (DDP's all-reduce)
        total = {}
        for rank in ranks:
            for key, grad in rank[index].items():
                total[key] = total.get(key, 0) + grad
        return total

    for with_mask in (True, False):
        ranks = spawn(tp * pp, _router_gradients_worker, moe_dir, tp, pp, (12, 16), with_mask)
        short, long = summed(ranks, 0), summed(ranks, 1)
        assert len(short) == 2 and short.keys() == long.keys()  # both layers' routers
        same = [torch.allclose(short[key], long[key], rtol=1e-5, atol=1e-9) for key in short]
        assert all(same) if with_mask else not any(same), (with_mask, same)
        if with_mask:  # a placeholder adds no load-balancing gradient (it was NaN: megatron's loss over 0 tokens)
            placeholder = summed(ranks, 2)
            assert placeholder.keys() == short.keys() and all(torch.equal(g, torch.zeros_like(g))
                                                                for g in placeholder.values()), placeholder
