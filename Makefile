# megatron-ais: `make run` and `make test` create the environments on first use (idempotent).
PYTHON ?= python3
VENV := .venv
VENV_LAUNCH := .venv-launch
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LAUNCH_STAMP := $(VENV_LAUNCH)/.installed
TINY := runs/tiny-qwen3
NPROC ?= 2

.PHONY: run test venv venv-launch clean-venv

venv: $(STAMP)

# The stamp depends on the pins, so changing a pin reinstalls. torch's CPU build by its local version: where pip
# cannot find it, the install stops at once rather than downloading the CUDA wheel (docs/install.md).
$(STAMP): requirements/train.txt requirements/stubs.txt pyproject.toml tools/make_stub_wheels.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -rf $(VENV)/stubs && $(PYTHON) tools/make_stub_wheels.py $(VENV)/stubs requirements/stubs.txt >/dev/null
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0+cpu $(VENV)/stubs/*.whl
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/train.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	$(PY) -W ignore -c "import logging; logging.disable(logging.WARNING); import torch, megatron.core, vllm; assert not torch.version.cuda or torch.cuda.is_available(), 'CUDA torch on a CPU machine'"
	touch $@

venv-launch: $(LAUNCH_STAMP)

$(LAUNCH_STAMP): requirements/launch.txt
	test -x $(VENV_LAUNCH)/bin/python || $(PYTHON) -m venv $(VENV_LAUNCH)
	$(VENV_LAUNCH)/bin/pip install -q --disable-pip-version-check -r requirements/launch.txt
	$(VENV_LAUNCH)/bin/pip check
	$(VENV_LAUNCH)/bin/python -c "import nemo_run"
	touch $@

# The default recipe on 2 gloo ranks (DP2): tiny Qwen3 model and tokenizer, a check that this machine runs the FP8
# engine (seconds, before the long phases), a supervised warm-up on the digit-sort task (Megatron checkpoint), then
# GRPO + AIS with FP8 rollouts in two colocated vLLM engines (one inside each trainer rank), micro-batches by
# tokens, checkpointed. tools/torchrun.py: an error that stops a rank is one line, with the full log's path.
RUN_DIR ?= runs/default
TORCHRUN := OMP_NUM_THREADS=1 $(PY) tools/torchrun.py
run: $(STAMP)
	rm -rf $(RUN_DIR)
	$(PY) tools/make_tiny_model.py --arch qwen3 --out $(TINY)
	OMP_NUM_THREADS=1 $(PY) tools/check_engine.py --hf-dir $(TINY) --rollout-precision fp8
	$(TORCHRUN) --log $(RUN_DIR)/logs/sft.log --standalone --nproc-per-node $(NPROC) tools/train_sft.py \
	    --hf-dir $(TINY) --task digit_sort --train-iters 150 --micro-batch-size 16 --global-batch-size 32 \
	    --seq-length 64 --lr 3e-3 --log-interval 10 --output-dir $(RUN_DIR)/sft --save $(RUN_DIR)/sft/checkpoint
	$(TORCHRUN) --log $(RUN_DIR)/logs/grpo.log --standalone --nproc-per-node $(NPROC) pretrain_grpo_ais.py \
	    --load $(RUN_DIR)/sft/checkpoint --task digit_sort --seq-length 64 --grpo-steps 50 --eval-interval 10 \
	    --eval-prompts 128 --micro-batch-size 16 --max-tokens-per-microbatch 1024 --lr 3e-4 --prompts-per-step 32 \
	    --group-size 8 --rollout-precision fp8 --is-correction ais --rollout-kv-cache-gb 0.5 \
	    --rollout-placement colocated --save $(RUN_DIR)/checkpoint --save-interval 25 --output-dir $(RUN_DIR)

# The suite on TEST_WORKERS pytest-xdist workers, the longest modules first (tests/durations.json); a module
# marked xdist_group stays on one worker. One worker per core: a third ran no faster on 2 cores and stretched the
# runs that kill processes mid-step.
TEST_WORKERS ?= 2
test: $(STAMP) $(LAUNCH_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=15 tests

clean-venv:
	rm -rf $(VENV) $(VENV_LAUNCH)
