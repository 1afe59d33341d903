"""The receiver alone, on a host arena: a delivered bucket is checksummed by `HOST_VERIFIERS` threads, each a run of
whole tensors of about equal bytes; a byte flipped in any run refuses the sync naming its tensor, and an intact sync
commits every tensor."""
import pytest
import torch

from megatron_ais.bridge.buckets import manifest_entry
from megatron_ais.bridge.plan import EngineTensor
from megatron_ais.bridge.receiver import HOST_VERIFIERS, SyncReceiver, split_by_bytes
from megatron_ais.errors import SyncError

SHAPES = [(300, 64), (8,), (1000, 128), (64, 64), (7, 3), (512, 256)]


def _stage():
    tensors, offset = [], 0
    for i, shape in enumerate(SHAPES):
        nbytes = 2 * torch.Size(shape).numel()
        tensors.append(EngineTensor(f"t{i}", "bfloat16", shape, offset, nbytes))
        offset += nbytes
    return tensors, offset


def _deliver(receiver, tensors, values, sync_id, flip=None):
    """Write `values` into the arena, then deliver them as two buckets (flipping one byte of tensor `flip` after
    its manifest entry was made)."""
    receiver.begin(sync_id)
    manifests = []
    for t, v in zip(tensors, values):
        window = receiver.window(0, t.offset, t.offset + t.nbytes)
        window.copy_(v.reshape(-1).view(torch.uint8))
        manifests.append(manifest_entry(t.name, v, t.offset))
        if t.name == flip:
            window[t.nbytes // 2] ^= 0x01
    receiver.receive(sync_id, 0, manifests[:3])
    receiver.receive(sync_id, 0, manifests[3:])
    return receiver.commit(sync_id)


@pytest.mark.parametrize("flip", ["t0", "t2", "t5"])
def test_host_verifiers_refuse_a_flipped_byte_by_name_in_any_run(flip):
    tensors, total = _stage()
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(t.shape, generator=g).bfloat16() for t in tensors]
    applied = []
    receiver = SyncReceiver(on_commit=lambda weights: applied.append([e.name for e in weights.entries]) or applied[-1])
    receiver.prepare([tensors], [total], [0])
    try:
        assert _deliver(receiver, tensors, values, 1) == [t.name for t in tensors]
        with pytest.raises(SyncError, match=f"sync 2 refused, engine keeps its weights: {flip}: checksum"):
            _deliver(receiver, tensors, values, 2, flip=flip)
        assert len(applied) == 1 and receiver.slot_syncs == [None]  # nothing applied, nothing committed
    finally:
        receiver.close()


class _Entry:
    def __init__(self, nbytes):
        self.nbytes = nbytes


@pytest.mark.parametrize("sizes", [[10, 10, 10, 10], [100, 1, 1], [1, 1, 100], [5], [], [3, 1, 4, 1, 5, 9, 2, 6]])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_by_bytes_keeps_order_and_balances_whole_tensors(sizes, parts):
    checks = [(_Entry(n), i) for i, n in enumerate(sizes)]
    runs = split_by_bytes(checks, parts)
    assert [c for run in runs for c in run] == checks and all(runs) and len(runs) <= parts
    # no run is heavier than its share by more than one tensor
    assert all(sum(e.nbytes for e, _ in run) <= sum(sizes) / parts + max(sizes) for run in runs)
    if len(sizes) >= parts and max(sizes) <= sum(sizes) / parts:
        assert len(runs) == parts
    assert HOST_VERIFIERS >= 2
