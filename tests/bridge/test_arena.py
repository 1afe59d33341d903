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


def test_a_gpu_arena_that_does_not_fit_beside_the_trainer_is_refused_naming_the_flags():
    from megatron_ais.bridge.arena import CUDA_CONTEXT_BYTES, gpu_arena_shortfall

    gib = 1 << 30
    # two 9 GiB buffers (one step off policy) and four engine processes mapping them: 18 GiB + 4 contexts
    need = 2 * 9 * gib + 4 * CUDA_CONTEXT_BYTES
    assert gpu_arena_shortfall(9 * gib, 2, 4, need) is None
    message = gpu_arena_shortfall(9 * gib, 2, 4, need - 1)
    assert message.startswith("the bridge's staging arena needs 20.0 GiB of GPU memory (2 buffer(s) of 9.0 GiB and "
                              "the CUDA contexts of 4 engine process(es)")
    assert "--bridge-arena host" in message and "--max-off-policy-steps 0" in message and "\n" not in message
    assert gpu_arena_shortfall(9 * gib, 1, 4, need - 1) is None  # synchronous: one buffer
