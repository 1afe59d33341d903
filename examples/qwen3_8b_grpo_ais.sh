#!/bin/bash
# GRPO + AIS for Qwen3-8B on 1-4 nodes of 8x H100 80GB: BF16 Megatron-Core trainer, FP8 vLLM rollouts,
# adaptive importance sampling against the FP8/BF16 mismatch. Megatron-LM style: one array per concern.
#
#   single node:  bash examples/qwen3_8b_grpo_ais.sh
#   Slurm:        srun --nodes 4 --ntasks-per-node 1 --gpus-per-node 8 bash examples/qwen3_8b_grpo_ais.sh
#                 (or examples/nemo_run_grpo_ais.py --executor slurm, which submits exactly this script)
#   print only:   PRINT_ARGS=1 bash examples/qwen3_8b_grpo_ais.sh   (one pretrain_grpo_ais.py flag per line)
#   plan only:    PRINT_PLACEMENT=1 NNODES=4 bash examples/qwen3_8b_grpo_ais.sh   (GPUs, memory and sync bytes per
#                 node and link for these flags, from examples/models/qwen3-8b unless HF_MODEL exists; starts nothing)
#
# Inputs (environment): PYTHON (the interpreter; default python, e.g. .venv/bin/python for a plan on the CPU
# machine), HF_MODEL (Qwen3-8B HF directory), PROMPT_FILE (GSM8K-style JSONL, docs/data.md),
# CHECKPOINT_PATH (resumes automatically when it holds a checkpoint), OUTPUT_DIR.
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        MASTER_ADDR=localhost
    fi
fi
MASTER_PORT=${MASTER_PORT:-6000}

HF_MODEL=${HF_MODEL:-/models/Qwen3-8B}
PROMPT_FILE=${PROMPT_FILE:-/data/gsm8k/train.jsonl}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-/checkpoints/qwen3-8b-grpo-ais}
OUTPUT_DIR=${OUTPUT_DIR:-/results/qwen3-8b-grpo-ais}

# The fleet: every node gives GPUs 4-7 to four FP8 vLLM engines (one GPU each, driven by the node's trainer ranks
# 0-3) and GPUs 0-3 to the trainer. FP8 Qwen3-8B is 9.4 GB of weights, so an engine is TP1 with a large KV cache;
# rollouts (3072-token responses) dominate the step, so half of every node generates: 16 engines on 4 nodes.
ENGINES_PER_NODE=${ENGINES_PER_NODE:-4}
ROLLOUT_TP=${ROLLOUT_TP:-1}
TRAINER_GPUS_PER_NODE=$((GPUS_PER_NODE - ENGINES_PER_NODE * ROLLOUT_TP))
WORLD_SIZE=$((TRAINER_GPUS_PER_NODE * NNODES))
# 8B dense, 36 layers, 32 query / 8 KV heads: TP4 keeps 2 KV heads per rank (no KV replication) and a node's four
# trainer GPUs hold one replica; PP1, so DP = number of nodes (1-4).
TP=${TP:-4}
PP=${PP:-1}
# One step off policy (slime's train_async.py, verl's one-step-off-policy): the engines generate step t + 1's batch
# with the weights step t starts from while the trainer trains step t; AIS sees the lag in the rollout log-probs.
# Steps that evaluate or save (every 20 here) sync first. 0 gives the synchronous loop.
# Stale tokens are corrected fully (--ais-stale-lambda-floor 1, below): in issue 30's CPU study (docs/results.md,
# tiny model, lr 3e-4) staleness of 2 and 4 steps cost uncorrected GRPO 0.11-0.16 of held-out accuracy, truncated
# IS recovered most of it and AIS's one λ did not; with the floor AIS corrects stale tokens as TIS does and adapts
# only to the current version's precision mismatch. At this lr (1e-6) one step moves the policy far less, which no
# run here has measured.
MAX_OFF_POLICY_STEPS=${MAX_OFF_POLICY_STEPS:-1}
# PARTIAL_ROLLOUTS=1: each step's weights reach the engines as soon as it has trained; requests in flight are aborted
# and resumed on them with their tokens kept (slime's --partial-rollout). Not reproducible token for token.
PARTIAL_ROLLOUTS=${PARTIAL_ROLLOUTS:-0}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$TRAINER_GPUS_PER_NODE"  # the engines' GPUs come after these (vLLM device_ids)
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --hf-dir "$HF_MODEL"          # architecture, tokenizer and initial weights (Qwen3: QK-norm, no bias)
    --bf16
    --seq-length 4096             # prompt + response; the rotary table length
    --transformer-impl auto       # Transformer Engine when importable
    --make-vocab-size-divisible-by 128
)

TRAINING_ARGS=(
    --seed 1234
    --micro-batch-size 2
    --max-tokens-per-microbatch 8192  # micro-batches by tokens: at most what 2 rows of 4096 take today, each padded
                                      # only to its own longest sequence; DP ranks get balanced token counts
    --lr 1e-6
    --weight-decay 0.01
    --adam-beta1 0.9
    --adam-beta2 0.98
    --clip-grad 1.0
    --grpo-steps 500
    --prompts-per-step 192        # x 8 samples = 1536 sequences: 4 whole mini-batches at DP 1-4; 12-48 prompts
                                  # per engine
    --group-size 8
    --num-minibatches 4           # 4 optimizer steps per rollout batch (off-policy within the batch)
    --ppo-epochs 1
    --clip-low 0.2
    --clip-high 0.28              # asymmetric (DAPO-style) clip
    --loss-agg token-mean
    --kl-coef 0.0
)
# A DAPO-style recipe (verl's recipe/dapo, slime's --dynamic-sampling-filter-path): add to TRAINING_ARGS
#     --dynamic-sampling --max-sampling-rounds 3   # only groups with reward variance; up to 3 rounds of 192 prompts
#     --overlong soft-penalty --overlong-buffer-tokens 512 --overlong-penalty 1.0
#                                                  # reward -(len - 2560) / 512 past 2560 of the 3072 response tokens
# (clip-higher 0.2/0.28, token-mean and no KL are already set above). GSPO instead of PPO's token ratio:
#     --policy-loss gspo --loss-agg seq-mean-token-mean --clip-low 3e-4 --clip-high 4e-4, and --is-level geometric
# below; Dr. GRPO: --advantage-no-std --loss-agg seq-mean-token-sum-norm.

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel
    --use-distributed-optimizer
)

ROLLOUT_ARGS=(
    --rollout-precision fp8               # blockwise FP8 (128x128, weight_scale_inv) from the bridge
    --rollout-kv-cache-dtype auto
    --rollout-placement separate
    --max-off-policy-steps "$MAX_OFF_POLICY_STEPS"  # separate engines only
    --rollout-engines-per-node "$ENGINES_PER_NODE"
    --rollout-tensor-parallel-size "$ROLLOUT_TP"
    --rollout-kv-cache-gb 60              # an engine's GPU: 9.4 GB of FP8 weights + 60 GB of KV cache (about 400k
                                          # tokens at 147 kB each) + 2 GB workspace = 71 GiB of 80
    --bridge-arena auto                   # the staging arena on trainer GPU 0: two 9.4 GB buffers one step off
                                          # policy, plus a CUDA context for each engine process that maps it
                                          # (19.6 GiB, PRINT_PLACEMENT=1), beside rank 0's 34 GiB (DP1) to 17 GiB
                                          # (DP4) of weights, grads and Adam state before activations; each other
                                          # node gets one verified copy on its GPU 0 (10.8 GiB)
    --rollout-min-engines 2               # an engine past its restarts is retired; fewer than this stops the run
    --rollout-max-num-seqs 256
    --rollout-max-model-len 4096
    --max-new-tokens 3072
    --temperature 1.0
    --top-p 1.0
    --bridge-bucket-size-mb 512
    --verify-refit-interval 10            # probe-sequence refit check every 10 syncs
)
if [ "$PARTIAL_ROLLOUTS" = 1 ]; then ROLLOUT_ARGS+=(--partial-rollouts); fi

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
if [ "$MAX_OFF_POLICY_STEPS" -gt 0 ]; then AIS_ARGS+=(--ais-stale-lambda-floor 1); fi

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
    --save "$CHECKPOINT_PATH"
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
    [[ -d "$HF_MODEL" ]] || HF_MODEL=examples/models/qwen3-8b
    ALL_ARGS+=(--hf-dir "$HF_MODEL" --print-placement --cluster-nodes "$NNODES" --cluster-gpus-per-node "$GPUS_PER_NODE")
    exec "${PYTHON:-python}" pretrain_grpo_ais.py "${ALL_ARGS[@]}"
fi

echo "Qwen3-8B GRPO+AIS: ${NNODES} node(s) x ${GPUS_PER_NODE} GPUs, trainer TP${TP} PP${PP}" \
     "DP$((WORLD_SIZE / (TP * PP))) on ${TRAINER_GPUS_PER_NODE} GPUs per node, ${ENGINES_PER_NODE} engine(s) of TP${ROLLOUT_TP}" \
     "per node, node rank ${NODE_RANK}, master ${MASTER_ADDR}:${MASTER_PORT}"
# torchrun through tools/torchrun.py: a rank's error is one line on the console, every rank's output in the log
exec "${PYTHON:-python}" tools/torchrun.py --log "$OUTPUT_DIR/logs/node${NODE_RANK}.log" "${DISTRIBUTED_ARGS[@]}" \
    pretrain_grpo_ais.py "${ALL_ARGS[@]}"
