"""Staging buffers on CPU: a process reads the buffers it created itself (their own memory, as CUDA requires for
IPC handles), other processes map them by ref and see the creator's writes; closing removes the file and forgets
the buffer."""
import os

import torch

from distributed import spawn
from megatron_ais.bridge.arena import SharedBuffer, buffer_data, decode_ref, encode_ref, open_staging_buffer, \
    staging_buffer


def _read_in_another_process(ref, nbytes):
    buffer = open_staging_buffer(ref, nbytes)
    return buffer.data.clone(), buffer_data(decode_ref(encode_ref(ref)))[:nbytes].clone()


def test_shared_buffer_by_ref_here_and_in_another_process():
    buffer = staging_buffer("test-arena", 4096, on_gpu=False)  # host memory, also on CUDA machines
    assert isinstance(buffer, SharedBuffer)
    try:
        buffer.view(0, torch.float32, (1024,)).copy_(torch.arange(1024, dtype=torch.float32))
        own = buffer_data(buffer.ref)
        assert own.data_ptr() == buffer.data.data_ptr()  # the creator's own bytes, not a second mapping
        opened, mapped = spawn(1, _read_in_another_process, buffer.ref, 4096)[0]
        assert torch.equal(opened, buffer.data) and torch.equal(mapped, buffer.data)
    finally:
        buffer.close()
    assert not os.path.exists(buffer.path)
