"""The bridge's one-pass bucket kernel (`kernels.bucket_pass`): its torch reference, walking the kernel's tiles,
writes today's bytes and gives today's figures (the C kernel's checksum sums, the reference quantizer's codes and
scales, NaN/Inf counts); the Triton kernel matches the reference bit for bit under the interpreter on CPU (given a
GPU's float rounding, `interpreter_rounding`) and on a GPU."""
import os
import subprocess
import sys

import pytest
import torch

from kernels.bucket_pass import BucketPass, PassPiece, flat_sums_pieces, run_reference
from kernels.fp8.format import scale_shape
from kernels.fp8.reference import blockwise_fp8_quantize_reference
from kernels.fp8.triton import fp8_kernels_available
from kernels.integrity import Position, checksum_sums

ROWS = 8  # figures rows: copy dim 0, converted 1-D copy, codes, scales, int32 sums, scratch copy (not counted),
# codes and scales of an aligned tensor


def _case(device: str = "cpu", pow2: bool = False, corrupt: bool = False, seed: int = 0) -> dict:
    """Sources and zeroed destinations of one bucket: a BF16 piece at rows 100.. of a 400-row tensor, an FP32 1-D
    tensor converted to BF16, a BF16 piece quantized into columns 256.. of a 300 x 516 FP8 tensor (partial edge
    blocks; its scales a column slice), an int32 tensor summed flat (a short last row), a scratch copy, a whole
    256 x 384 tensor quantized. Aligned launches (16-byte addresses, rows of multiples of 16 elements): the first
    copy, the int32 rows, the last tensor; the others not."""
    g = torch.Generator().manual_seed(seed)
    t = {"a": torch.randn(300, 512, generator=g).to(torch.bfloat16), "a_full": torch.zeros(400, 512),
         "b": torch.randn(1000, generator=g) * 1e3, "b_full": torch.zeros(1000),
         "w": torch.randn(300, 260, generator=g).to(torch.bfloat16),
         "q": torch.zeros(300, 516), "s": torch.zeros(*scale_shape((300, 516))),
         "i": torch.randint(-2 ** 31, 2 ** 31 - 1, (7, 1000), generator=g, dtype=torch.int32),
         "scratch_src": torch.randn(64, 40, generator=g).to(torch.bfloat16), "scratch": torch.zeros(64, 40),
         "w2": torch.randn(256, 384, generator=g).to(torch.bfloat16), "q2": torch.zeros(256, 384),
         "s2": torch.zeros(2, 3)}
    t["a_full"], t["b_full"] = t["a_full"].to(torch.bfloat16), t["b_full"].to(torch.bfloat16)
    t["q"], t["q2"] = t["q"].to(torch.float8_e4m3fn), t["q2"].to(torch.float8_e4m3fn)
    t["scratch"] = t["scratch"].to(torch.bfloat16)
    if corrupt:
        t["a"][5, 7], t["b"][3], t["w"][299, 259], t["w"][0, 0] = float("nan"), float("inf"), -float("inf"), float("nan")
        t["scratch_src"][0, 0], t["w2"][255, 383] = float("nan"), float("inf")
    return {k: v.to(device) for k, v in t.items()}


def _pieces(t: dict) -> list[PassPiece]:
    s_shape = tuple(t["s"].shape)
    return [PassPiece("copy", t["a"], Position.of_piece((400, 512), 0, 100), 0, True, t["a_full"].narrow(0, 100, 300)),
            PassPiece("copy", t["b"], Position.whole(t["b_full"]), 1, True, t["b_full"]),
            PassPiece("quantize", t["w"], Position.of_piece((300, 516), 1, 256), 2, True, t["q"].narrow(1, 256, 260),
                      t["s"].narrow(1, 2, 3), Position.of_piece(s_shape, 1, 2), 3),
            *flat_sums_pieces(t["i"], 4),
            PassPiece("copy", t["scratch_src"], Position.whole(t["scratch"]), 5, False, t["scratch"]),
            PassPiece("quantize", t["w2"], Position.whole(t["q2"]), 6, True, t["q2"], t["s2"], Position.whole(t["s2"]),
                      7)]


def _unsigned(row) -> tuple[int, int]:
    return tuple(v & (2 ** 64 - 1) for v in row[1:].tolist())


@pytest.mark.parametrize("pow2", [False, True])
def test_reference_writes_todays_bytes_and_figures(pow2):
    t = _case(pow2=pow2)
    figures = run_reference(_pieces(t), ROWS, 128, pow2)
    q, s = blockwise_fp8_quantize_reference(t["w"], 128, pow2)
    assert torch.equal(t["a_full"][100:], t["a"]) and not t["a_full"][:100].any()
    assert torch.equal(t["b_full"], t["b"].to(torch.bfloat16)) and torch.equal(t["scratch"], t["scratch_src"])
    assert torch.equal(t["q"][:, 256:].view(torch.uint8), q.view(torch.uint8)) and torch.equal(t["s"][:, 2:], s)
    assert not t["q"][:, :256].view(torch.uint8).any() and not t["s"][:, :2].any()
    q2, s2 = blockwise_fp8_quantize_reference(t["w2"], 128, pow2)
    assert torch.equal(t["q2"].view(torch.uint8), q2.view(torch.uint8)) and torch.equal(t["s2"], s2)
    s_shape = tuple(t["s"].shape)
    assert _unsigned(figures[0]) == checksum_sums(t["a_full"][100:], Position.of_piece((400, 512), 0, 100))
    assert _unsigned(figures[1]) == checksum_sums(t["b_full"])
    assert _unsigned(figures[2]) == checksum_sums(t["q"][:, 256:], Position.of_piece((300, 516), 1, 256))
    assert _unsigned(figures[3]) == checksum_sums(t["s"][:, 2:], Position.of_piece(s_shape, 1, 2))
    assert _unsigned(figures[4]) == checksum_sums(t["i"])
    assert _unsigned(figures[6]) == checksum_sums(t["q2"]) and _unsigned(figures[7]) == checksum_sums(t["s2"])
    assert figures[5].tolist() == [0, 0, 0] and figures[:, 0].tolist() == [0] * ROWS  # not counted; all finite
    # the figures of a whole tensor add up from its pieces: the other half of the BF16 tensor, in another pass
    rest = run_reference([PassPiece("sums", t["a_full"][:100], Position.of_piece((400, 512), 0, 0), 0)], 1)
    assert _unsigned(rest[0] + figures[0]) == checksum_sums(t["a_full"])


def test_reference_counts_nan_and_inf_per_row():
    t = _case(corrupt=True)
    figures = run_reference(_pieces(t), ROWS)
    # a quantized piece's NaN/Inf counted on its source, a copied one's on what it wrote
    assert figures[:, 0].tolist() == [1, 1, 2, 0, 0, 1, 1, 0]


def _kernel_against_reference(device: str) -> dict:
    """Run the kernel and the reference on the same inputs: which outputs and figures rows are equal, the NaN/Inf
    counts, and the fraction of FP8 codes that differ."""
    out = {}
    for pow2, corrupt in [(False, False), (True, False), (False, True)]:
        ref, got = _case("cpu", pow2, corrupt), _case(device, pow2, corrupt)
        expected = run_reference(_pieces(ref), ROWS, 128, pow2)
        figures = BucketPass(_pieces(got), ROWS, 128, pow2).run().cpu()
        got = {k: v.cpu() for k, v in got.items()}
        codes = got["q"][:, 256:].view(torch.uint8) != ref["q"][:, 256:].view(torch.uint8)
        out[(pow2, corrupt)] = {
            "equal": {k: torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8)) for k in got},
            "rows_equal": [torch.equal(figures[r], expected[r]) for r in range(ROWS)],
            "counts": figures[:, 0].tolist(), "code_slips": float(codes.float().mean())}
    return out


def _assert_bit_exact(results: dict) -> None:
    for (pow2, corrupt), r in results.items():
        assert r["counts"] == ([1, 1, 2, 0, 0, 1, 1, 0] if corrupt else [0] * ROWS)
        if not corrupt:  # what a corrupt pass writes is refused whole
            assert all(r["equal"].values()) and all(r["rows_equal"]) and r["code_slips"] == 0, r


def test_kernel_under_interpreter_matches_reference():
    """Under the interpreter with a GPU's float rounding (`interpreter_rounding`: its own truncates the FP32 -> BF16
    copy), every byte and figure equals the reference's."""
    pytest.importorskip("triton.language")
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests, here])}
    script = ("import interpreter_rounding; interpreter_rounding.install(); "
              "from test_bucket_pass import _kernel_against_reference as k; print(repr(k('cpu')))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    _assert_bit_exact(eval(run.stdout.strip().splitlines()[-1]))


@pytest.mark.gpu
def test_kernel_bit_exact_on_gpu():
    if not fp8_kernels_available(torch.device("cuda")):
        pytest.skip("Triton compiles no e4m3 for this GPU (before sm_89): the bridge quantizes with torch there")
    _assert_bit_exact(_kernel_against_reference("cuda"))


def test_bench_bucket_pass_runs_and_its_tiles_agree_under_the_interpreter():
    """`tools/bench_bucket_pass.py` (the kernel alone against a copy, tiles and warps swept) runs end to end on tiny
    shapes under the interpreter: every tile writes the same figures as the defaults (else it exits 1), and its last
    line has its figures; on a CPU without the interpreter it refuses in one line."""
    pytest.importorskip("triton.language")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tool = os.path.join(root, "tools", "bench_bucket_pass.py")
    args = [sys.executable, tool, "--layers", "1", "--hidden-size", "256", "--intermediate-size", "384",
            "--num-attention-heads", "2", "--num-key-value-heads", "1", "--repeats", "1", "--sweep", "--tiles",
            "64x128", "--warps", "4"]
    run = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert sum("| 64x128 | 4 |" in line for line in lines) == 3 and lines[-1].startswith("copy_pass_over_copy=")
    if not torch.cuda.is_available():
        refused = subprocess.run(args[:2], capture_output=True, text=True,
                                 env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        assert refused.returncode == 2 and "needs a CUDA GPU with Triton" in refused.stderr
