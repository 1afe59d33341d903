"""`distributed.share`: what one rank computes reaches every rank of a real gloo world, and an error raised there
is raised on every rank with its type (ours) or as a RuntimeError naming it (anything else)."""
from distributed import spawn


def _worker():
    import torch.distributed as dist

    from megatron_ais.distributed import share
    from megatron_ais.errors import SyncError
    from megatron_ais.distributed import initialize_distributed

    initialize_distributed()
    rank = dist.get_rank()
    out = [share(lambda: {"from": rank}, src=0), share(lambda: None, src=1), share(lambda: 0, src=1)]

    def sync_refused():
        raise SyncError("sync 3 refused")

    for failing in (sync_refused, lambda: 1 / 0):
        try:
            share(failing, src=0)
            out.append(None)
        except Exception as err:  # the test records whatever each rank raises
            out.append((type(err).__name__, str(err)))
    return out


def test_values_and_errors_reach_every_rank():
    for rank, out in enumerate(spawn(2, _worker)):
        assert out[:3] == [{"from": 0}, None, 0]
        assert out[3] == ("SyncError", "sync 3 refused")
        # the rank that met an unknown error raises it; the others learn its type and message
        expected = ("ZeroDivisionError", "division by zero") if rank == 0 else \
            ("RuntimeError", "ZeroDivisionError: division by zero")
        assert out[4] == expected  # (`assert a == b if c else d` held for any tuple d)
