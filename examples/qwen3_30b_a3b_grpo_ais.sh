#!/bin/bash
# GRPO + AIS for Qwen3-30B-A3B (MoE: 48 layers, 128 experts, top-8, 3B active) on 4 or 8 nodes of 8x H100 80GB:
# BF16 Megatron-Core trainer with expert parallelism, FP8 vLLM rollouts (float8 experts, BF16 router), adaptive
# importance sampling against the FP8/BF16 mismatch, which routing flips make larger than on dense models.
# Megatron-LM style: one array per concern.
#
#   Slurm:        srun --nodes 4 --ntasks-per-node 1 --gpus-per-node 8 bash examples/qwen3_30b_a3b_grpo_ais.sh
#                 (or examples/nemo_run_grpo_ais.py --executor slurm --recipe qwen3_30b_a3b)
#   print only:   PRINT_ARGS=1 bash examples/qwen3_30b_a3b_grpo_ais.sh   (one pretrain_grpo_ais.py flag per line)
#   plan only:    PRINT_PLACEMENT=1 NNODES=4 bash examples/qwen3_30b_a3b_grpo_ais.sh   (GPUs, memory and sync bytes
#                 per node and link, from examples/models/qwen3-30b-a3b unless HF_MODEL exists; starts nothing)
#
# Inputs (environment): PYTHON (the interpreter; default python, e.g. .venv/bin/python for a plan on the CPU
# machine), HF_MODEL (Qwen3-30B-A3B HF directory), PROMPT_FILE (GSM8K-style JSONL, docs/data.md),
# CHECKPOINT_PATH (resumes automatically when it holds a checkpoint; one shard directory per TP x EP rank),
# OUTPUT_DIR.
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${SLURM_NNODES:-4}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        MASTER_ADDR=localhost
    fi
fi
MASTER_PORT=${MASTER_PORT:-6000}

HF_MODEL=${HF_MODEL:-/models/Qwen3-30B-A3B}
PROMPT_FILE=${PROMPT_FILE:-/data/gsm8k/train.jsonl}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-/checkpoints/qwen3-30b-a3b-grpo-ais}
OUTPUT_DIR=${OUTPUT_DIR:-/results/qwen3-30b-a3b-grpo-ais}

# The fleet: every node gives GPUs 6-7 to two FP8 vLLM engines (one GPU each, driven by the node's trainer ranks
# 0-1) and GPUs 0-5 to the trainer. FP8 Qwen3-30B-A3B is 31 GB of weights (float8 experts, BF16 router and
# embeddings): one H100 holds them with a 40 GB KV cache, so an engine is TP1 (every expert's 768 rows are whole
# 128-row FP8 blocks). 8 engines on 4 nodes, 16 on 8.
ENGINES_PER_NODE=${ENGINES_PER_NODE:-2}
ROLLOUT_TP=${ROLLOUT_TP:-1}
TRAINER_GPUS_PER_NODE=$((GPUS_PER_NODE - ENGINES_PER_NODE * ROLLOUT_TP))
WORLD_SIZE=$((TRAINER_GPUS_PER_NODE * NNODES))
# 30B MoE, 32 query / 4 KV heads, hidden 2048, 128 experts of moe_intermediate_size 768. The dense part is small
# (attention + router + embeddings, about 1.5B): TP2 gives two KV heads per rank with sequence parallelism (needed
# by megatron for MoE under TP). The experts (about 29B) are spread by EP8 with expert-TP 1: each GPU holds 16
# whole experts of every layer and the token dispatcher (alltoall) moves tokens, not weights. Megatron forms the
# expert groups from the TP x DP ranks of a stage: 24 trainer ranks on 4 nodes (TP2 x DP12, 3 expert-DP replicas),
# 48 on 8. PP1: with the distributed optimizer a GPU holds 3.6B expert + 0.75B dense parameters, 39 GiB (4 nodes)
# or 32 GiB (8 nodes) with BF16 weights, fp32 grads and Adam state before activations (--print-placement).
TP=${TP:-2}
PP=${PP:-1}
EP=${EP:-8}
ETP=${ETP:-1}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$TRAINER_GPUS_PER_NODE"  # the engines' GPUs come after these (vLLM device_ids)
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --hf-dir "$HF_MODEL"          # architecture, tokenizer and initial weights (Qwen3-MoE: QK-norm, top-8 router)
    --bf16
    --seq-length 4096             # prompt + response; the rotary table length
    --transformer-impl auto       # Transformer Engine when importable
    --make-vocab-size-divisible-by 128
)

TRAINING_ARGS=(
    --seed 1234
    --micro-batch-size 1
    --max-tokens-per-microbatch 4096  # micro-batches by tokens: at most one row of 4096, several short ones
                                      # together; every DP (and so EP) rank runs as many micro-batches
    --lr 5e-7
    --weight-decay 0.01
    --adam-beta1 0.9
    --adam-beta2 0.98
    --clip-grad 1.0
    --grpo-steps 500
    --prompts-per-step 192        # x 8 samples = 1536 sequences: 4 whole mini-batches at DP 12 or 24; 24 or 12
                                  # prompts per engine
    --group-size 8
    --num-minibatches 4           # 4 optimizer steps per rollout batch (off-policy within the batch)
    --ppo-epochs 1
    --clip-low 0.2
    --clip-high 0.28              # asymmetric (DAPO-style) clip
    --loss-agg token-mean
    --kl-coef 0.0
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel           # required by megatron for MoE with TP > 1
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size "$ETP"
    --use-distributed-optimizer
)

ROLLOUT_ARGS=(
    --rollout-precision fp8               # blockwise FP8 (128x128, weight_scale_inv) from the bridge
    --rollout-kv-cache-dtype auto
    --rollout-placement separate
    --rollout-engines-per-node "$ENGINES_PER_NODE"
    --rollout-tensor-parallel-size "$ROLLOUT_TP"
    --rollout-kv-cache-gb 40              # an engine's GPU: 31 GB of FP8 weights + 40 GB of KV cache (about 400k
                                          # tokens at 98 kB each) + 2 GB workspace = 71 GiB of 80
    --rollout-min-engines 4               # an engine past its restarts is retired; fewer than this stops the run
    --rollout-max-num-seqs 256
    --rollout-max-model-len 4096
    --max-new-tokens 3072
    --temperature 1.0
    --top-p 1.0
    --bridge-bucket-size-mb 512
    --bridge-arena host                   # the 31 GB arena in /dev/shm: on GPU 0 it would join rank 0's 39 GiB (4
                                          # nodes) of weights, grads and Adam state and the MoE activations
    --verify-refit-interval 10            # probe-sequence refit check every 10 syncs
    --moe-routing-replay rollout          # R3: the trainer routes every token to the engine's experts (docs/moe.md)
)

AIS_ARGS=(
    --is-correction ais
    --is-level token
    --is-cap 2.0
    --ais-severity anchored
    --ais-reliability band_ess
    --ais-variance advantage_weighted
    --ais-combiner product
    --ais-ema 0.9
)

DATA_ARGS=(
    --task jsonl
    --prompt-file "$PROMPT_FILE"
    --reward-workers 4                    # math-verify in 4 processes on each engine's host (it breaks in threads)
    --reward-timeout-s 30                 # a sample past it scores 0 and is counted (rollout/reward_timeouts)
    --eval-prompts 256
    --eval-samples 4
    --eval-interval 20
)

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_PATH"     # torch_dist: reshards on load, so a resume may change TP / PP / EP / DP
    --save-interval 20
    --keep-checkpoints 2
)
# resume when the checkpoint directory already holds a run (Megatron-LM convention: --load = --save)
if [[ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]]; then
    CHECKPOINT_ARGS+=(--load "$CHECKPOINT_PATH")
fi

LOGGING_ARGS=(
    --output-dir "$OUTPUT_DIR"
    --log-interval 1
)

ALL_ARGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}"
          "${AIS_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}")

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '%s\n' "${ALL_ARGS[@]}"
    exit 0
fi
cd "$(dirname "$0")/.."
if [[ "${PRINT_PLACEMENT:-0}" == 1 ]]; then
    [[ -d "$HF_MODEL" ]] || HF_MODEL=examples/models/qwen3-30b-a3b
    ALL_ARGS+=(--hf-dir "$HF_MODEL" --print-placement --cluster-nodes "$NNODES" --cluster-gpus-per-node "$GPUS_PER_NODE")
    exec "${PYTHON:-python}" pretrain_grpo_ais.py "${ALL_ARGS[@]}"
fi

echo "Qwen3-30B-A3B GRPO+AIS: ${NNODES} node(s) x ${GPUS_PER_NODE} GPUs, TP${TP} PP${PP} EP${EP} ETP${ETP}" \
     "DP$((WORLD_SIZE / (TP * PP))) on ${TRAINER_GPUS_PER_NODE} GPUs per node, ${ENGINES_PER_NODE} engine(s) of" \
     "TP${ROLLOUT_TP} per node, node rank ${NODE_RANK}, master ${MASTER_ADDR}:${MASTER_PORT}"
# torchrun through tools/torchrun.py: a rank's error is one line on the console, every rank's output in the log
exec "${PYTHON:-python}" tools/torchrun.py --log "$OUTPUT_DIR/logs/node${NODE_RANK}.log" "${DISTRIBUTED_ARGS[@]}" \
    pretrain_grpo_ais.py "${ALL_ARGS[@]}"
