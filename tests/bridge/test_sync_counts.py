"""The structure of the GPU's one-pass sync (issue 31), counted on CPU tensors by `tools/bench_bridge.py
--one-pass` (the bucket kernels run by Triton's interpreter, each launch one op): its aten ops on the engine's rank
grow with buckets, not with pieces; it allocates no temporary; it reads figures back once per bucket and once at the
commit."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_pass_counts(layers: int) -> dict[str, tuple[int, ...]]:
    """(buckets, aten ops, host synchronisations, new bytes per synced byte) of one BF16 and one FP8 sync along
    the one-pass path, TP2, one 64 MB bucket."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_bridge.py"), "--hidden-size", "256",
                          "--num-layers", str(layers), "--intermediate-size", "512", "--vocab-size", "512",
                          "--repeats", "1", "--bucket-size-mb", "64", "--one-pass"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| (BF16|FP8) sync, one pass \| (\d+) \| (\d+) \| \d+ \| (\d+) \| [\d.]+ \| ([\d.]+) \|$",
                      run.stdout, re.M)
    return {name: (int(b), int(ops), int(syncs), float(new)) for name, b, ops, syncs, new in rows}


@pytest.mark.slow
def test_one_pass_ops_grow_with_buckets_not_pieces():
    pytest.importorskip("triton.language")
    fewer, more = _one_pass_counts(1), _one_pass_counts(2)  # the same bucket count, twice the pieces
    assert set(fewer) == set(more) == {"BF16", "FP8"}
    for precision in fewer:
        assert fewer[precision] == more[precision], precision
        buckets, ops, syncs, new_bytes = fewer[precision]
        assert buckets == 1 and syncs == buckets + 1 and new_bytes == 0.0
        assert ops < 50  # a handful per bucket (table-driven launches, the figures' read-back)
