"""Delta syncs against full ones: real Adam steps (lr 1e-6) on a Qwen3-0.6B-shaped decoder layer of std-0.02
weights, quantized to blockwise FP8 or NVFP4 as the engine receives them. A delta (every tensor element-sparse: codes,
scales, the BF16 norm) applied to the previous version equals the new version bit for bit and sends a small fraction
of the full bytes; a dropped or altered element is refused by the manifest's full-tensor checksums naming the tensor.
Across two simulated nodes (real gloo ranks), the node copy follows the arena bit for bit through deltas, a full copy
comes at the interval, after a refused delta and with a new layout. A tensor goes in full exactly when its changed
elements and their positions would take as many bytes."""
import pytest
import torch

from distributed import spawn

# Qwen3-0.6B: hidden 1024, 16 query heads and 8 KV heads of 128, FFN 3072
LAYER = {"self_attn.q_proj": (2048, 1024), "self_attn.k_proj": (1024, 1024), "self_attn.v_proj": (1024, 1024),
         "self_attn.o_proj": (1024, 2048), "mlp.gate_proj": (3072, 1024), "mlp.up_proj": (3072, 1024),
         "mlp.down_proj": (1024, 3072)}


class Layer:
    """One decoder layer's linear weights (std 0.02) and norm, trained by Adam on a real least-squares loss."""

    def __init__(self, seed: int, lr: float = 1e-6):
        generator = torch.Generator().manual_seed(seed)
        self.weights = {f"model.layers.0.{name}.weight": (torch.randn(shape, generator=generator) * 0.02)
                        .requires_grad_() for name, shape in LAYER.items()}
        self.weights["model.layers.0.input_layernorm.weight"] = torch.ones(1024, requires_grad=True)
        self.inputs = {name: torch.randn(8, w.shape[-1], generator=generator) for name, w in self.weights.items()}
        self.optimizer = torch.optim.Adam(self.weights.values(), lr=lr)

    def step(self) -> None:
        self.optimizer.zero_grad()
        loss = sum(((x @ w.T if w.dim() == 2 else x * w) - 1.0).square().mean()
                   for w, x in zip(self.weights.values(), self.inputs.values()))
        loss.backward()
        self.optimizer.step()

    def engine_tensors(self, precision: str = "fp8") -> list[tuple[str, torch.Tensor]]:
        from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine

        with torch.no_grad():
            return list(quantize_for_engine(((n, w.detach().to(torch.bfloat16)) for n, w in self.weights.items()),
                                            QuantizationPolicy(precision=precision)))


def arena_of(tensors: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """The tensors laid out as a staging arena (8-byte aligned) and their manifest entries."""
    from megatron_ais.bridge.buckets import manifest_entry

    entries, offset = [], 0
    for name, t in tensors:
        entries.append(manifest_entry(name, t, offset))
        offset += -(-t.numel() * t.element_size() // 8) * 8
    data = torch.zeros(offset, dtype=torch.uint8)
    for entry, (_, t) in zip(entries, tensors):
        data[entry.offset: entry.offset + entry.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
    return data, entries


def drop_one(plan, header, payload):
    """The delta without the first changed element of its first changed tensor (its position and its bytes)."""
    from megatron_ais.bridge import delta

    first = next(i for i, n in enumerate(header.changed) if n > 0)
    size = delta.element_bytes(plan.sparse[first])
    before = sum(max(n, 0) for n in header.changed[:first])  # positions of earlier tensors
    sparse = sum(max(n, 0) for n in header.changed)
    value = 4 * sparse + plan.dense_bytes + sum(e.nbytes if n == delta.FULL else n * delta.element_bytes(e)
                                                for e, n in zip(plan.sparse[:first], header.changed[:first]))
    changed = list(header.changed)
    changed[first] -= 1
    payload = torch.cat([payload[: 4 * before], payload[4 * before + 4: value], payload[value + size:]])
    return first, delta.DeltaHeader(tuple(changed)), payload


def verify(data: torch.Tensor, entries: list) -> None:
    from megatron_ais.bridge.arena import entry_views
    from megatron_ais.bridge.buckets import verify_tensors

    verify_tensors([(e, view) for e, (_, view) in zip(entries, entry_views(data, entries))])


@pytest.mark.parametrize("precision, codes_dtype", [("fp8", "float8_e4m3fn"), ("nvfp4", "uint8")])
def test_a_delta_after_adam_steps_equals_the_full_sync_and_a_changed_element_is_refused(precision, codes_dtype):
    from megatron_ais.bridge import delta

    layer = Layer(seed=0)
    old, entries = arena_of(layer.engine_tensors(precision))
    plan = delta.DeltaPlan.of(entries)
    assert plan.sparse == tuple(entries) and not plan.dense  # codes, scales and the BF16 norm
    base, copy = delta.snapshot(old, plan), old.clone()
    fractions = []
    for _ in range(3):
        layer.step()
        new, entries = arena_of(layer.engine_tensors(precision))
        header, payload = delta.encode(new, plan, base)
        delta.apply(copy, plan, header, payload)
        assert copy.equal(new)  # bit for bit the full sync
        verify(copy, entries)
        assert all(base[e.name].equal(new[e.offset: e.offset + e.nbytes]) for e in plan.sparse)  # the next base
        codes = [(e, n) for e, n in zip(plan.sparse, header.changed) if e.dtype == codes_dtype and e.nbytes > 4]
        fractions.append(sum(n for _, n in codes) / sum(e.nbytes for e, _ in codes))
        assert delta.FULL not in [n for _, n in codes] and 0 < sum(n for _, n in codes)
        assert payload.numel() == header.payload_bytes(plan) < new.numel() // 10
    assert max(fractions) < 0.02, fractions  # about 0.4 % of the FP8 codes change per step at lr 1e-6

    layer.step()
    new, entries = arena_of(layer.engine_tensors(precision))
    previous = copy.clone()
    header, payload = delta.encode(new, plan, delta.snapshot(previous, plan))
    first, dropped, without_one = drop_one(plan, header, payload)
    assert without_one.numel() == payload.numel() - 5
    target = copy.clone()
    delta.apply(target, plan, dropped, without_one)
    with pytest.raises(ValueError, match=f"{plan.sparse[first].name}: checksum"):
        verify(target, entries)
    altered, target = payload.clone(), previous.clone()
    altered[-1] ^= 1  # the last changed element
    delta.apply(target, plan, header, altered)
    with pytest.raises(ValueError, match="checksum"):
        verify(target, entries)
    outside = payload.clone()
    elements = plan.sparse[first].nbytes // delta.element_bytes(plan.sparse[first])
    outside[:4] = torch.tensor([elements], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        delta.apply(previous.clone(), plan, header, outside)
    with pytest.raises(ValueError, match="header describes"):
        delta.apply(previous.clone(), plan, header, payload[:-1])


@pytest.mark.parametrize("dtype, size, threshold", [(torch.float8_e4m3fn, 1, 3277), (torch.bfloat16, 2, 5462)])
def test_a_tensor_goes_in_full_once_its_delta_would_be_as_large(dtype, size, threshold):
    """A changed element costs its int32 position and its bytes: of 16384 FP8 codes, 3276 changed ship as a delta of
    5 x 3276 bytes, 3277 (5 x 3277 >= 16384) in full; of 16384 BF16 values (32768 bytes), 5461 as 6 x 5461 bytes,
    5462 in full; either way the copy becomes the new bytes."""
    from megatron_ais.bridge import delta

    tensor = (torch.randn(128, 128, generator=torch.Generator().manual_seed(3)) * 0.02).to(dtype)
    old, entries = arena_of([("model.layers.0.mlp.up_proj.weight", tensor)])
    plan = delta.DeltaPlan.of(entries)
    for changed, expected in ((threshold - 1, threshold - 1), (threshold, delta.FULL)):
        new = old.clone()
        new[: changed * size: size] ^= 1  # the first byte of each of the first `changed` elements
        header, payload = delta.encode(new, plan, delta.snapshot(old, plan))
        assert header.changed == (expected,), changed
        assert payload.numel() == (16384 * size if expected == delta.FULL else (4 + size) * changed)
        copy = old.clone()
        delta.apply(copy, plan, header, payload)
        assert torch.equal(copy, new)


def _nodes_worker(work: str, slots: int, dropped: int):
    import os

    os.environ["MEGATRON_AIS_NODE_NAME"] = f"node{os.environ['RANK']}"
    import torch.distributed as dist

    from megatron_ais.bridge import delta
    from megatron_ais.bridge.arena import ArenaWeights, SharedBuffer, buffer_data
    from megatron_ais import distributed
    from megatron_ais.bridge.node_copies import NodeCopies
    from megatron_ais.distributed import initialize_distributed

    initialize_distributed()
    rank = dist.get_rank()
    copies = NodeCopies(0, (1,), rank, "on", full_sync_interval=2, on_gpu=False, slots=slots)
    devices, broadcast = set(), distributed._broadcast

    def recording(group, tensor):  # the device of every chunk that crosses: it picks the group's backend
        devices.add(tensor.device.type)
        broadcast(group, tensor)

    distributed._broadcast = recording
    layer, arena, applied = Layer(seed=1, lr=1e-6), None, None
    encode, log = delta.encode, []

    def dropping(data, plan, base):  # the arena rank's delta loses one changed code on the way
        return drop_one(plan, *encode(data, plan, base))[1:]

    for forward in range(8):
        if forward:
            layer.step()
        tensors = layer.engine_tensors()
        data, entries = arena_of(tensors[::-1] if forward == 7 else tensors)  # the last: a new layout
        if rank == 0:
            if arena is None:
                arena = SharedBuffer.create("test-delta-arena", data.numel())
            arena.data.copy_(data)
        delta.encode = dropping if forward == dropped else encode
        copy, error = copies.forward(ArenaWeights(arena.ref if rank == 0 else None, tuple(entries)))
        errors = [None, None]
        dist.all_gather_object(errors, error)
        same = None if copy is None else buffer_data(copy.ref)[: data.numel()].equal(data)
        # what the node's engines applied last (and a restarted one reloads) is still intact
        kept = None if applied is None else buffer_data(applied[0].ref)[: applied[1].numel()].equal(applied[1])
        if errors == [None, None]:  # as apply_on_every_engine: every node verified it, its engines apply it
            copies.commit()
            applied = (copy, data.clone()) if copy is not None else None
        log.append((copies.sent_bytes, data.numel(), errors[1], same, kept))
    kind = type(copies.copies[0]).__name__
    copies.close()
    if arena is not None:
        arena.close()
    return log, devices, kind


def test_a_second_node_follows_the_arena_through_deltas(tmp_path):
    (sent, sent_on, _), (leader, received_on, copy_kind) = spawn(2, _nodes_worker, str(tmp_path), 1, 4)
    # a host arena crosses from host memory into a shared-memory copy (gloo); a GPU arena's copies are GPU buffers
    # and its bytes cross from GPU memory (NCCL), which a CPU cannot run
    assert sent_on == received_on == {"cpu"} and copy_kind == "SharedBuffer"
    # forwards: full, delta, delta, full (the interval of 2), delta with one code lost, full (the copy was refused),
    # delta, full (the tensors laid out anew)
    full = [n for _, n, _, _, _ in sent]
    sizes = [s for s, _, _, _, _ in sent]
    assert all(sizes[i] == full[i] for i in (0, 3, 5, 7)), sizes
    assert all(sizes[i] < full[i] // 10 for i in (1, 2, 4, 6)), sizes
    errors = [e for _, _, e, _, _ in sent]
    assert errors[:4] == [None] * 4 and errors[5:] == [None] * 3
    assert "differs" in errors[4] and "checksum" in errors[4]
    assert [same for _, _, _, same, _ in leader] == [True, True, True, True, None, True, True, True]
    # one copy: each forward writes the weights the node's engines hold (the negative control of the test below)
    assert [kept for _, _, _, _, kept in leader][1:] == [False] * 7


def test_a_double_buffered_arenas_node_copies_keep_the_applied_weights_intact(tmp_path):
    """η ≥ 1: each forward writes the copy the last applied one is not in, and a delta is against what that copy
    holds (two syncs back), so a restarted engine reloads intact weights even during a forward, or after a refused
    one."""
    (sent, _, _), (leader, _, _) = spawn(2, _nodes_worker, str(tmp_path), 2, 5)
    # forwards (copy 0, 1, 0, 1, ...): full, full (each copy's first), delta, delta, full (the interval of 2), delta
    # with one code lost into copy 1, full into copy 1 again (refused there), full (the tensors laid out anew)
    full = [n for _, n, _, _, _ in sent]
    sizes = [s for s, _, _, _, _ in sent]
    assert all(sizes[i] == full[i] for i in (0, 1, 4, 6, 7)), sizes
    assert all(sizes[i] < full[i] // 10 for i in (2, 3, 5)), sizes
    errors = [e for _, _, e, _, _ in sent]
    assert errors[:5] == [None] * 5 and errors[6:] == [None] * 2 and "checksum" in errors[5]
    assert [same for _, _, _, same, _ in leader] == [True, True, True, True, True, None, True, True]
    assert [kept for _, _, _, _, kept in leader][1:] == [True] * 7


def _shipping_worker(hf_dir):
    """PP2, every stage shipping its buckets point-to-point into a double-buffered arena, FP8: one bridge with
    delta syncs (at most 3 in a row), one without, synced after the same Adam steps; a NaN in stage 1 refuses the
    seventh sync. On the engine's rank: per sync whether both bridges' engine tensors are byte for byte equal (and
    whether the weights changed); on stage 1's sender: each bridge's shipped bytes per sync."""
    import os
    import sys

    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_bridge_sync import _bf16_model

    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.bridge.quantization import QuantizationPolicy
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.bridge.sync import WeightBridge
    from megatron_ais.errors import SyncError
    from megatron_ais.engine.feeds.base import named_tensors

    chunks, build, layout = _bf16_model(hf_dir, "--pipeline-model-parallel-size")
    params = [p for chunk in chunks for p in chunk.parameters()]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = torch.optim.Adam(masters, lr=1e-5)
    generator = torch.Generator().manual_seed(layout.rank)
    bridges = {}
    for mode in ("on", "off"):
        receiver = SyncReceiver(slots=2) if layout.rank == 0 else None
        config = BridgeConfig(bucket_size_mb=0.05, policy=QuantizationPolicy(precision="fp8"), transport="distributed",
                              delta=mode, full_sync_interval=3)
        bridges[mode] = (WeightBridge(chunks, build, config, layout, receiver), receiver)
    fc2 = next(p for n, p in chunks[0].named_parameters() if n.endswith("linear_fc2.weight"))
    equal, changed, shipped, previous = [], [], {"on": [], "off": []}, None
    for sync_id in range(9):
        if sync_id:
            optimizer.zero_grad()
            for master in masters:
                master.grad = torch.randn(master.shape, generator=generator)
            optimizer.step()
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)
        corrupt = sync_id == 6 and layout.rank == 1
        if corrupt:
            with torch.no_grad():
                fc2[0, 0] = float("nan")
        synced = {}
        for mode, (bridge, _) in bridges.items():
            try:
                stats = bridge.sync(sync_id)
                synced[mode] = {n: t.view(torch.uint8).clone() for n, t in named_tensors(stats.committed)} \
                    if layout.rank == 0 else None
                shipped[mode].append(stats.shipped_bytes)
            except SyncError:
                shipped[mode].append(None)
        if corrupt:
            with torch.no_grad():
                fc2.copy_(next(m for p, m in zip(params, masters) if p is fc2))
        if layout.rank == 0 and synced:
            equal.append(synced["on"].keys() == synced["off"].keys()
                         and all(torch.equal(synced["on"][n], synced["off"][n]) for n in synced["off"]))
            changed.append(previous is not None and any(not torch.equal(previous[n], t)
                                                        for n, t in synced["off"].items()))
            previous = synced["off"]
        dist.barrier()
    tensors = bridges["off"][0].plan.tensors
    codes = sum(t.nbytes for t in tensors if t.dtype == "float8_e4m3fn"), sum(t.nbytes for t in tensors)
    for bridge, receiver in bridges.values():
        bridge.close()
        if receiver is not None:
            receiver.close()
    return equal, changed, shipped, codes


def test_delta_syncs_shipped_by_a_stage_equal_full_ones(model_root):
    """Slots alternate: syncs 0 and 1 fill them in full, 2-4 are deltas against the sync each slot holds, 5 is full
    (three deltas in a row), 6 is refused (a NaN), 7 rewrites the refused sync's slot in full (it holds no committed
    sync any more), 8 is a delta again; every committed sync's engine tensors equal the full bridge's byte for byte."""
    from conftest import make_model_dir as model_dir

    model = model_dir(model_root, "qwen3", num_key_value_heads=1)
    (equal, changed, _, _), (_, _, shipped, (codes, everything)) = spawn(2, _shipping_worker, model)
    assert equal == [True] * 8 and all(changed[1:]), (equal, changed)
    delta, full = shipped["on"], shipped["off"]
    assert full[6] is None and delta[6] is None  # refused
    assert [delta[k] == full[k] for k in (0, 1, 5, 7)] == [True] * 4, (delta, full)
    # a delta ships 4 + the element's bytes per changed element (scales mostly in full)
    assert all(0 < delta[k] < everything / 4 for k in (2, 3, 4, 8)), (delta, full, everything)
