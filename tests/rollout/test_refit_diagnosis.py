"""A failed refit check names the first decoder layer whose output leaves the trainer's: a clean engine passes;
an engine given a corrupted layer-1 MLP (behind the bridge's back) fails, and the error names model.layers.1
while layer 0 still agrees (fp32 engine and trainer, colocated, through the loop's collective check)."""
import pytest

from conftest import make_model_dir
from distributed import spawn


def _worker(hf_dir, work):
    from distributed import start_trainer
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.mapping.hf_io import HFCheckpointReader
    from megatron_ais.errors import RefitVerificationError
    from megatron_ais.engine.vllm_engine import RolloutEngine
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.rollout.fleet_layout import FleetLayout
    from megatron_ais.refit_probe import probe_tokens
    from megatron_ais.rollout.verify import verify_refit_on_all_ranks
    from megatron_ais.training import load_policy_chunks

    engine = RolloutEngine(EngineConfig(model_dir=hf_dir, precision="fp32", kv_cache_gb=0.25,
                                        placement="colocated"), work)
    trainer, hf_config, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", "64")
    chunks, _, _ = load_policy_chunks(build, trainer.weights)
    groups = ParallelGroups.from_parallel_state()
    probe = probe_tokens(build.shape.vocab_size)
    fleet = FleetLayout.first_ranks(1, rank=0)
    verify_refit_on_all_ranks(engine, chunks, probe, groups, build.shape.vocab_size, "fp32", fleet)  # clean: passes

    reader = HFCheckpointReader(hf_dir)
    corrupted = [(n, -reader.get(n).float() if n == "model.layers.1.mlp.down_proj.weight" else reader.get(n).float())
                 for n in reader.names()]
    engine.update_weights(list(quantize_for_engine(iter(corrupted), QuantizationPolicy(precision="fp32"))))
    try:
        verify_refit_on_all_ranks(engine, chunks, probe, groups, build.shape.vocab_size, "fp32", fleet)
        message = None
    except RefitVerificationError as err:
        message = str(err)
    engine.shutdown()
    return message


@pytest.mark.slow
def test_failed_refit_names_the_first_mismatching_layer(model_root, tmp_path):
    hf_dir = make_model_dir(model_root, "qwen3", num_layers=3, hidden_size=128, intermediate_size=256,
                            tie_word_embeddings=True)
    (message,) = spawn(1, _worker, hf_dir, str(tmp_path))
    assert message is not None, "a corrupted engine passed the refit check"
    assert message.startswith("engine 0 (rank 0 on "), message
    assert "first mismatching layer: model.layers.1 " in message and message.endswith("; stopping"), message
    layer0 = float(message.split("per layer: 0: ")[1].split(",")[0])
    assert layer0 < 1e-4, message
