# megatron-ais: `make run` and `make test` create the environments on first use (idempotent).
PYTHON ?= python3
VENV := .venv
VENV_LAUNCH := .venv-launch
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LAUNCH_STAMP := $(VENV_LAUNCH)/.installed
TINY := runs/tiny-llama
NPROC ?= 2

.PHONY: run test venv venv-launch clean-venv

venv: $(STAMP)

# The stamp depends on the pins, so changing a pin reinstalls.
$(STAMP): requirements/train.txt requirements/stubs.txt pyproject.toml tools/make_stub_wheels.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -rf $(VENV)/stubs && $(PYTHON) tools/make_stub_wheels.py $(VENV)/stubs requirements/stubs.txt >/dev/null
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 $(VENV)/stubs/*.whl
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/train.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	$(PY) -c "import torch, megatron.core, vllm; assert not torch.version.cuda or torch.cuda.is_available(), 'CUDA torch on a CPU machine'"
	touch $@

venv-launch: $(LAUNCH_STAMP)

$(LAUNCH_STAMP): requirements/launch.txt
	test -x $(VENV_LAUNCH)/bin/python || $(PYTHON) -m venv $(VENV_LAUNCH)
	$(VENV_LAUNCH)/bin/pip install -q --disable-pip-version-check -r requirements/launch.txt
	$(VENV_LAUNCH)/bin/pip check
	$(VENV_LAUNCH)/bin/python -c "import nemo_run"
	touch $@

# Until the GRPO recipe lands: build the tiny model, then a short supervised Megatron job on 2 gloo ranks
# (TP2), which saves a Megatron checkpoint and exports the trained model back to HF format.
run: $(STAMP)
	$(PY) tools/make_tiny_model.py --arch llama --out $(TINY)
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) tools/train_sft.py \
	    --hf-dir $(TINY) --tensor-model-parallel-size 2 --train-iters 30 --micro-batch-size 8 \
	    --seq-length 64 --lr 3e-3 --output-dir runs/sft-smoke --save runs/sft-smoke/checkpoint \
	    --export-hf-dir runs/sft-smoke/hf

test: $(STAMP) $(LAUNCH_STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV) $(VENV_LAUNCH)
