"""`tools/gpu_checks.py` and `tools/device_checks.sh`, the single-GPU checks of the first cluster run: on CPU the
kernel comparison runs under Triton's interpreter at tiny shapes (and finds a planted difference), the model check on
a tiny model on one gloo rank; the shell script's every call to the tool is one its parser takes; on a GPU the IPC
check itself."""
import os
import re
import subprocess
import sys

import pytest
import torch

import gpu_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_checks.py")

PLANTED = """
import sys, torch
sys.argv = ["gpu_checks.py"]
import gpu_checks
cpu = gpu_checks.weights([(256, 384)], 0)
clean = (gpu_checks.quantizer_mismatches(cpu, torch.device("cpu")),
         gpu_checks.bucket_pass_mismatches(cpu, torch.device("cpu")))
reference = gpu_checks.blockwise_fp8_quantize_reference
def scales_one_ulp_up(w, block, pow2):
    q, s = reference(w, block, pow2)
    return q, torch.nextafter(s, torch.full_like(s, float("inf")))
gpu_checks.blockwise_fp8_quantize_reference = scales_one_ulp_up
run_reference = gpu_checks.run_reference
def one_figure_off(pieces, rows, block):
    figures = run_reference(pieces, rows, block)
    figures[0, 1] += 1
    return figures
gpu_checks.run_reference = one_figure_off
print(repr((clean, gpu_checks.quantizer_mismatches(cpu, torch.device("cpu")),
            gpu_checks.bucket_pass_mismatches(cpu, torch.device("cpu")))))
"""


def _figures(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if re.fullmatch(r"[a-z0-9_]+=\S+", line))


def test_kernel_check_under_the_interpreter_is_exact_and_finds_a_planted_difference():
    pytest.importorskip("triton.language")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, TOOL, "kernels", "--shapes", "256x384", "--experts", "2", "--expert-shape",
                          "128x256", "--repeats", "1"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = _figures(run.stdout)
    for name in ("256x384", "experts2x128x256"):
        assert figures[f"triton_quantizer_mismatched_tensors_{name}"] == "0"
        assert figures[f"bucket_pass_mismatches_{name}"] == "none"
        assert float(figures[f"triton_quantize_gbps_{name}"]) > 0
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tools"), ROOT])
    planted = subprocess.run([sys.executable, "-c", PLANTED], capture_output=True, text=True, env=env)
    assert planted.returncode == 0, planted.stderr[-3000:]
    clean, scales_off, figure_off = eval(planted.stdout.strip().splitlines()[-1])
    assert clean == (0, [])
    assert scales_off == 2  # the tensor, with and without power-of-two scales
    assert figure_off == ["copy", "quantize", "sums (BF16 arena)", "sums (FP8 arena)"]


def test_kernel_check_refuses_a_machine_without_a_gpu_or_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the check")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for check in ("kernels", "ipc"):
        run = subprocess.run([sys.executable, TOOL, check], capture_output=True, text=True, env=env)
        assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr, run.stderr[-2000:]


def test_model_check_runs_the_bridge_and_a_grpo_step_on_a_tiny_model(tmp_path):
    """One gloo rank, a 2-layer model: the FP8 bridge into a double-buffered host arena (bytes, seconds per GB)
    and a GRPO step at token-budget micro-batches; memory figures only where CUDA counts them."""
    run = subprocess.run([sys.executable, TOOL, "model", "--hidden-size", "64", "--num-layers", "2", "--seq-length",
                          "128", "--tokens-per-microbatch", "256", "--syncs", "2", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = _figures(run.stdout)
    assert figures["arena_on_gpu_layers2"] == str(int(torch.cuda.is_available()))
    # two slots of the FP8 arena: a 64-wide model of 512 tokens, mostly BF16 embeddings (2 x 512 x 64 x 2 bytes)
    assert 2 * 2 * 512 * 64 * 2 / (1 << 30) < float(figures["arena_double_buffered_gib_layers2"]) < 0.01
    assert float(figures["fp8_sync_s_per_gb_layers2"]) > 0 and float(figures["grpo_step_s_layers2"]) > 0
    assert float(figures["verify_tail_s_per_gb_layers2"]) >= 0
    memory = figures["activation_peak_gib_layers2_seq128_mb256"]
    assert (memory == "unmeasured") != torch.cuda.is_available()
    assert os.listdir(tmp_path) == []  # the temporary model is gone


def test_every_call_of_the_device_script_is_one_the_tool_takes():
    script = open(os.path.join(ROOT, "tools", "device_checks.sh")).read()
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    calls = re.findall(r"^\s*run_check \d+ \S+ (.+)$", script, flags=re.M)
    assert {c.split()[0] for c in calls} == {"ipc", "kernels", "model"}
    for call in calls:
        args = gpu_checks.build_parser().parse_args(call.split())
        if args.check == "model":
            assert (args.seq_length, args.tokens_per_microbatch, len(args.num_layers)) == (4096, 8192, 2)
            assert not args.hidden_size  # Qwen3-8B's width
    limits = [int(n) for n in re.findall(r"^\s*run_check (\d+) ", script, flags=re.M)]
    assert sum(limits) <= 8 * 60  # the cluster part fits one device call with room for the machine's start


@pytest.mark.gpu
def test_ipc_check_on_the_gpu_counts_a_consumer_and_no_leak():
    run = subprocess.run([sys.executable, TOOL, "ipc", "--arena-gib", "0.25", "--opens", "10"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = _figures(run.stdout)
    assert float(figures["ipc_consumer_gpu_mib"]) > 0
    assert abs(float(figures["ipc_growth_after_10_opens_mib"])) < 64
