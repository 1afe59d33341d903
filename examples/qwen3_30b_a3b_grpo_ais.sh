#!/bin/bash
# GRPO + AIS for Qwen3-30B-A3B (MoE: 48 layers, 128 experts, top-8, 3B active) on 2-4 nodes of 8x H100 80GB:
# BF16 Megatron-Core trainer with expert parallelism, FP8 vLLM rollouts (float8 experts, BF16 router), adaptive
# importance sampling against the FP8/BF16 mismatch, which routing flips make larger than on dense models.
# Megatron-LM style: one array per concern.
#
#   Slurm:        srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 bash examples/qwen3_30b_a3b_grpo_ais.sh
#                 (or examples/nemo_run_grpo_ais.py --executor slurm --recipe qwen3_30b_a3b)
#   print only:   PRINT_ARGS=1 bash examples/qwen3_30b_a3b_grpo_ais.sh   (one pretrain_grpo_ais.py flag per line)
#
# Inputs (environment): HF_MODEL (Qwen3-30B-A3B HF directory), PROMPT_FILE (GSM8K-style JSONL, docs/data.md),
# CHECKPOINT_PATH (resumes automatically when it holds a checkpoint; one shard directory per TP x EP rank),
# OUTPUT_DIR.
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${SLURM_NNODES:-2}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        MASTER_ADDR=localhost
    fi
fi
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

HF_MODEL=${HF_MODEL:-/models/Qwen3-30B-A3B}
PROMPT_FILE=${PROMPT_FILE:-/data/gsm8k/train.jsonl}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-/checkpoints/qwen3-30b-a3b-grpo-ais}
OUTPUT_DIR=${OUTPUT_DIR:-/results/qwen3-30b-a3b-grpo-ais}

# 30B MoE, 32 query / 4 KV heads, hidden 2048, 128 experts of moe_intermediate_size 768. The dense part is small
# (attention + router + embeddings, about 1.5B): TP4 gives one KV head per rank with sequence parallelism (needed
# by megatron for MoE under TP). The experts (about 29B) are spread by EP8 with expert-TP 1: each GPU holds 16
# whole experts of every layer and the token dispatcher (alltoall) moves tokens, not weights. Megatron forms the
# expert groups from the TP x DP ranks of a stage, so EP8 x ETP1 fits 2 nodes (TP4 x DP4) and 4 nodes (TP4 x DP8);
# PP1: with the distributed optimizer a GPU holds about 3.6B expert + 0.4B dense parameters plus their states.
TP=${TP:-4}
PP=${PP:-1}
EP=${EP:-8}
ETP=${ETP:-1}
# Rollouts: FP8 Qwen3-30B-A3B is about 31 GB of weights; rollout TP2 puts half on each of GPUs 0 and 1, which the
# engine shares with trainer ranks 0 and 1 (16 GB of weights + 12 GB of KV cache + 2 GB each, next to a trainer rank's
# ~45 GB: 3.6B expert parameters with BF16 grads and a distributed optimizer over 2 expert-DP ranks), and keeps every
# expert's 768 rows a multiple of the 128-row FP8 block per rank (768 / 2 = 384). The bridge's staging arena (one more
# 31 GB copy) cannot fit on GPU 0 as well: it lives in host memory (--bridge-arena host).
ROLLOUT_TP=${ROLLOUT_TP:-2}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
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
    --prompts-per-step 192        # x 8 samples = 1536 sequences: 4 whole mini-batches at DP 2, 4, 6 or 8
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
    --rollout-tensor-parallel-size "$ROLLOUT_TP"
    --rollout-kv-cache-gb 12              # per GPU; the engine checks its budget against the free memory
    --rollout-max-num-seqs 256
    --rollout-max-model-len 4096
    --max-new-tokens 3072
    --temperature 1.0
    --top-p 1.0
    --bridge-bucket-size-mb 512
    --bridge-arena host                   # trainer GPUs copy their FP8 shards to /dev/shm, engine workers load them
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
    --reward-workers 8                    # math-verify in 8 processes on the engine's host (it breaks in threads)
    --reward-timeout-s 30                 # a sample past it scores 0 and is counted (rollout/reward_timeouts)
    --eval-prompts 256
    --eval-samples 4
    --eval-interval 20
)

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_PATH"     # mp_rank_TT_EEE directories: dense weights + each EP rank's own experts
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

echo "Qwen3-30B-A3B GRPO+AIS: ${NNODES} node(s) x ${GPUS_PER_NODE} GPUs, TP${TP} PP${PP} EP${EP} ETP${ETP}" \
     "DP$((WORLD_SIZE / (TP * PP))), rollout TP${ROLLOUT_TP}, node rank ${NODE_RANK}, master ${MASTER_ADDR}:${MASTER_PORT}"
cd "$(dirname "$0")/.."
exec torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_grpo_ais.py "${ALL_ARGS[@]}"
