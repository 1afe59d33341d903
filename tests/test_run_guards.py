"""What a run refuses before it starts, in one line a person reads, writing nothing: a start without torchrun, bad
flags (no usage block), a --save another live run holds or that holds another run's checkpoints, output directories that cannot be written or lack room
for a checkpoint, FP8 shapes vLLM cannot load."""
import os

import pytest

from conftest import make_model_dir
from megatron_ais.checkpointing import preflight, store
from megatron_ais.checkpointing.lock import RunLock
from megatron_ais.errors import CheckpointError

TORCHRUN_RANK0 = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # what torchrun gives a 1-rank run


@pytest.fixture
def grpo(monkeypatch, capsys):
    """pretrain_grpo_ais.py's main in this process, as torchrun would start rank 0 of 1 (`torchrun=False`: as a
    plain script); return (exit code, stderr)."""
    import pretrain_grpo_ais

    def run(*argv, torchrun=True):
        for name, value in TORCHRUN_RANK0.items():
            monkeypatch.setenv(name, value) if torchrun else monkeypatch.delenv(name, raising=False)
        with pytest.raises(SystemExit) as exit_info:
            pretrain_grpo_ais.main([str(a) for a in argv])
        return exit_info.value.code, capsys.readouterr().err

    return run


def _refused(result, *expected):
    code, stderr = result
    lines = stderr.strip().splitlines()
    assert code == 2, stderr[-3000:]
    assert "usage:" not in stderr and lines[-1] == "see: pretrain_grpo_ais.py --help", lines[-4:]
    assert lines[-2].startswith("pretrain_grpo_ais.py: error: "), lines[-4:]
    for text in expected:
        assert text in lines[-2], lines[-2]
    return lines[-2]


@pytest.fixture(scope="module")
def model(model_root):
    return make_model_dir(model_root, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2)


def test_a_start_without_torchrun_says_how_to_start(grpo, model):
    _refused(grpo("--hf-dir", model, torchrun=False), "runs one process per rank under torchrun: python -m "
                                                      "torch.distributed.run --nproc-per-node N pretrain_grpo_ais.py")


def test_flag_errors_are_one_line_without_the_usage_block(grpo, model):
    _refused(grpo("--hf-dir", model, "--group-size", "1"),
             "--group-size 1 must be at least 2 (GRPO's advantages compare")
    _refused(grpo("--hf-dir", model, "--rollout-precision", "int4"), "argument --rollout-precision: invalid choice")


def test_a_save_directory_a_live_run_holds_is_refused_writing_nothing(grpo, model, tmp_path):
    save, out = str(tmp_path / "ckpt"), tmp_path / "out"
    lock = RunLock(save)
    lock.acquire()  # this test process plays the live run
    try:
        _refused(grpo("--hf-dir", model, "--save", save, "--output-dir", out),
                 f"--save {save} is in use by the run of pid {os.getpid()}")
        _refused(grpo("--load", save, "--output-dir", out), f"--load {save} is in use by the run of pid {os.getpid()}")
    finally:
        lock.release()
    assert not out.exists()


def _snapshot(root):
    """Every path under root with its mtime: what a refusal must leave as it was."""
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns
            for d, dirs, files in os.walk(root) for n in dirs + files}


def test_a_fresh_run_on_another_runs_checkpoints_is_refused_writing_nothing(grpo, model, tmp_path):
    """A run killed at step 9 left iterations under --save; a new run from elsewhere must not save over them and
    prune the rest unless told to, and a run that resumes from that directory is no fresh run."""
    save, out = str(tmp_path / "ckpt"), tmp_path / "out"
    for iteration in (2, 8):
        stage = store.prepare_staging(save, iteration)
        store.write_metadata(stage, {"hf_config": {}}, None)
        store.commit_checkpoint(save, iteration)
    before = _snapshot(save)
    _refused(grpo("--hf-dir", model, "--save", save, "--output-dir", out),
             f"--save {save} holds another run's checkpoints (newest: iteration 8) and this run does not resume from "
             f"it (no --load); pass --load {save} to resume that run, or --replace-checkpoints")
    assert _snapshot(save) == before and not out.exists()
    # with the flag the run goes past that check, to the next refusal (the prompts do not fit --seq-length 32)
    _refused(grpo("--hf-dir", model, "--save", save, "--output-dir", out, "--replace-checkpoints",
                  "--seq-length", 32), "--seq-length 32 is too short")
    assert _snapshot(save) == before and not out.exists()
    with pytest.raises(CheckpointError, match=rf"\(--load {tmp_path}/sft\); pass --load {save} to resume"):
        preflight.check_save_holds_no_other_run(save, str(tmp_path / "sft"), replace=False)
    preflight.check_save_holds_no_other_run(save + "/", save, replace=False)  # resuming: the same directory
    preflight.check_save_holds_no_other_run(str(tmp_path / "empty"), None, replace=False)
    # --load is --save, but the run starts afresh from it: its saves would replace that run's checkpoints
    sft = str(tmp_path / "sft")
    stage = store.prepare_staging(sft, 100)
    store.write_metadata(stage, {"hf_config": {}, "run_kind": "sft"}, None)
    store.commit_checkpoint(sft, 100)
    preflight.check_save_holds_no_other_run(sft, sft, replace=False, run_kind="sft")
    for kind, finetune, why in (("grpo", False, "they are a sft run's, this is a grpo run"),
                                ("sft", True, "--finetune")):
        with pytest.raises(CheckpointError, match=rf"^--save {sft} is --load too, but this run starts afresh from it "
                                                  rf"\({why}\), so its saves would replace that run's checkpoints "
                                                  r"\(newest: iteration 100\); choose another --save"):
            preflight.check_save_holds_no_other_run(sft, sft, False, kind, finetune)
        preflight.check_save_holds_no_other_run(sft, sft, True, kind, finetune)  # --replace-checkpoints


def test_a_missing_kl_reference_is_refused_naming_its_flag_writing_nothing(grpo, model, tmp_path):
    save, out, ref = tmp_path / "ckpt", tmp_path / "out", tmp_path / "no-reference"
    _refused(grpo("--hf-dir", model, "--save", save, "--output-dir", out, "--kl-coef", "0.1", "--ref-load", ref),
             f"--ref-load {ref} has no latest_checkpointed_iteration.txt")
    assert not save.exists() and not out.exists()


def _unwritable(tmp_path):
    """A directory nobody may create files in: sysfs refuses even root, a read-only mode everyone else."""
    if os.geteuid() == 0:
        return "/sys/megatron-ais-test"
    path = tmp_path / "read-only"
    path.mkdir(mode=0o555)
    return str(path)


def test_unwritable_output_directories_are_refused_up_front(grpo, model, tmp_path):
    unwritable = _unwritable(tmp_path)
    _refused(grpo("--hf-dir", model, "--save", f"{unwritable}/ckpt", "--output-dir", tmp_path / "out"),
             f"--save {unwritable}/ckpt cannot be written")
    _refused(grpo("--hf-dir", model, "--output-dir", f"{unwritable}/out"), f"--output-dir {unwritable}/out cannot")
    _refused(grpo("--hf-dir", model, "--output-dir", tmp_path / "out", "--tensorboard-dir", f"{unwritable}/tb"),
             f"--tensorboard-dir {unwritable}/tb cannot be written")
    _refused(grpo("--hf-dir", model, "--output-dir", tmp_path / "out", "--wandb-save-dir", f"{unwritable}/wandb"),
             f"--wandb-save-dir {unwritable}/wandb cannot be written")
    assert not (tmp_path / "out").exists()


def test_fp8_shapes_vllm_cannot_load_are_refused_naming_the_tensor(grpo, model_root, tmp_path):
    odd = make_model_dir(model_root, "qwen3", hidden_size=192, intermediate_size=320, num_attention_heads=3,
                         num_key_value_heads=1)
    message = _refused(grpo("--hf-dir", odd, "--rollout-precision", "fp8", "--output-dir", tmp_path / "out"),
                       "--rollout-precision fp8: model.layers.0.self_attn.q_proj.weight has 192 output rows per engine "
                       "rank (--rollout-tensor-parallel-size 1)")
    assert "--bridge-fp8-exclude 'self_attn\\.[qkv]_proj'" in message and "--rollout-precision bf16" in message


def test_a_save_directory_without_room_for_a_checkpoint_is_refused(tmp_path, monkeypatch):
    import shutil

    from megatron_ais.model import ModelBuildConfig, ModelShape

    shape = ModelShape.from_hf_config({"model_type": "qwen3", "num_attention_heads": 32, "num_key_value_heads": 8,
                                       "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
                                       "vocab_size": 151936, "head_dim": 128})
    build = ModelBuildConfig(shape=shape)
    assert 8.1e9 < shape.num_parameters() < 8.3e9  # Qwen3-8B: 8.2 B parameters
    assert preflight.checkpoint_bytes(build) == shape.num_parameters(build.padded_vocab_size) * 14
    usage = shutil.disk_usage(str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=50 * 10 ** 9))
    with pytest.raises(CheckpointError, match=f"--save {tmp_path}/ckpt: one checkpoint of this model takes about "
                                              "11[0-9].[0-9]+ GB and 50.00 GB are free there"):
        preflight.check_room(str(tmp_path / "ckpt"), preflight.checkpoint_bytes(build), "--save")
    preflight.check_room(str(tmp_path / "ckpt"), 10 ** 9, "--save")


@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True}),
                                            ("qwen3_moe", {})])
def test_parameter_count_equals_transformers(model_root, arch, overrides):
    import json

    from transformers import AutoModelForCausalLM

    from megatron_ais.model import ModelShape

    hf_dir = make_model_dir(model_root, arch, **overrides)
    reference = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(hf_dir).parameters())
    assert ModelShape.from_hf_config(json.load(open(os.path.join(hf_dir, "config.json")))).num_parameters() == reference


def test_routing_replay_of_a_dense_model_is_refused_naming_the_flag(grpo, model, tmp_path):
    _refused(grpo("--hf-dir", model, "--moe-routing-replay", "rollout", "--output-dir", tmp_path / "out"),
             "--moe-routing-replay rollout needs a MoE model", "use --moe-routing-replay none")
    assert not (tmp_path / "out").exists()


def test_partial_rollouts_of_a_moe_model_with_routing_replay_are_refused_naming_the_flags(grpo, model_root, tmp_path):
    """A resumed sample's routes would be those of the weights that finished it, not those that sampled its start."""
    moe = make_model_dir(model_root, "qwen3_moe")
    _refused(grpo("--hf-dir", moe, "--max-off-policy-steps", "1", "--partial-rollouts", "--rollout-placement",
                  "separate", "--rollout-precision", "bf16", "--output-dir", tmp_path / "out"),
             "--partial-rollouts with MoE routing replay", "use --moe-routing-replay none")
    assert not (tmp_path / "out").exists()


def test_prompts_longer_than_the_sequence_allows_are_refused_before_the_run(grpo, model, tmp_path):
    """Every prompt the task can draw is measured (chat template included) before anything starts, not at the step
    that happens to draw the longest one."""
    from megatron_ais.data.tasks import running_sum_task
    from megatron_ais.rollout.manager import prompt_ids
    from megatron_ais.hf_assets import load_tokenizer

    task = running_sum_task(1234, 10)
    longest = max(map(len, prompt_ids(load_tokenizer(model), [e.prompt for e in task.train + task.eval])))
    flags = ("--hf-dir", model, "--task", "running_sum", "--sum-terms", "10", "--max-new-tokens", "96",
             "--output-dir", tmp_path / "out")
    _refused(grpo(*flags, "--seq-length", longest + 94, "--rollout-max-model-len", 512),
             f"--seq-length {longest + 94} is too short: the task's longest prompt has {longest} tokens",
             f"raise --seq-length to {longest + 95} or lower --max-new-tokens")
    _refused(grpo(*flags, "--seq-length", longest + 95, "--rollout-max-model-len", longest + 95),
             f"raise --rollout-max-model-len to {longest + 96}")
    assert not (tmp_path / "out").exists()
