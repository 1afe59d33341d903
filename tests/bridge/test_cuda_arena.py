"""GPU staging buffers shared by CUDA IPC between the processes of a node (GPU only: skipped without CUDA)."""
import pytest
import torch

from distributed import spawn

pytestmark = pytest.mark.gpu


def _share_worker():
    import torch.distributed as dist

    from megatron_ais.bridge.arena import CudaBuffer, buffer_data, decode_ref, encode_ref, open_staging_buffer, \
        staging_buffer

    dist.init_process_group("gloo")  # both processes share the one GPU: no NCCL
    rank, nbytes = dist.get_rank(), 1 << 20
    half = nbytes // 2
    ref = [None]
    if rank == 0:
        buffer = staging_buffer("test", nbytes)
        assert isinstance(buffer, CudaBuffer) and buffer.data.is_cuda
        buffer.data[:half] = torch.arange(half, device=buffer.data.device, dtype=torch.int64).to(torch.uint8)
        torch.cuda.synchronize()
        ref = [buffer.ref]
        # the creator cannot open its own IPC handle: its readers get the buffer itself
        assert buffer_data(decode_ref(encode_ref(buffer.ref))).data_ptr() == buffer.data.data_ptr()
    dist.broadcast_object_list(ref, src=0)
    if rank == 1:
        buffer = open_staging_buffer(ref[0], nbytes)
        expected = torch.arange(half, dtype=torch.int64).to(torch.uint8)
        assert torch.equal(buffer.data[:half].cpu(), expected)
        assert torch.equal(buffer_data(decode_ref(encode_ref(ref[0])))[:half].cpu(), expected)  # the RPC form
        buffer.view(half, torch.float32, (half // 4,)).fill_(1.5)  # write into the creator's memory
        torch.cuda.synchronize()
    dist.barrier()
    result = None
    if rank == 0:
        result = bool((buffer.view(half, torch.float32, (half // 4,)) == 1.5).all())
    dist.barrier()
    return result


def test_cuda_buffer_is_shared_across_processes():
    assert spawn(2, _share_worker)[0] is True


def test_the_receiver_refuses_a_gpu_arena_larger_than_the_free_memory():
    from megatron_ais.bridge.receiver import SyncReceiver
    from megatron_ais.errors import ArgumentValidationError

    free = torch.cuda.mem_get_info()[0]
    receiver = SyncReceiver(slots=2, arena_on_gpu=True, ipc_consumers=1)
    with pytest.raises(ArgumentValidationError, match="--bridge-arena host"):
        receiver._check_gpu_room(free // 2)
    receiver._check_gpu_room(free // 8)
