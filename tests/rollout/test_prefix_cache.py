"""After a weight update the engine must not reuse KV blocks cached for a shared prompt prefix under the old
weights: a long prompt is generated from, the weights change, and the same prompt's sampled-token log-probs must
equal transformers' on the new weights. With the prefix-cache reset disabled (negative control) they do not."""
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

PROMPT = [(7 * i + 3) % 383 + 1 for i in range(300)]  # longer than two KV-cache blocks


def _worker(old_dir, new_dir, work, disable_reset):
    from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
    from megatron_ais.mapping.hf_io import HFCheckpointReader
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
    from megatron_ais.engine.config import EngineConfig

    engine = RolloutEngine(EngineConfig(model_dir=old_dir, precision="fp32", kv_cache_gb=0.25,
                                        placement="colocated"), work)
    if disable_reset:
        engine.llm.reset_prefix_cache = lambda *a, **k: True
    engine.generate([PROMPT], SamplingConfig(temperature=0.0, max_new_tokens=2))  # caches the prompt's blocks
    reader = HFCheckpointReader(new_dir)
    engine.update_weights(list(quantize_for_engine(((n, reader.get(n)) for n in reader.names()),
                                                   QuantizationPolicy(precision="fp32"))))
    (rollout,) = engine.generate([PROMPT], SamplingConfig(temperature=1.0, max_new_tokens=6, seed=5))
    engine.shutdown()
    return rollout.token_ids, rollout.logprobs


def _reference(new_dir, generated):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT + generated])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(generated) - 1)
    return logp[positions, torch.tensor(generated)]


@pytest.mark.slow
def test_prefix_cache_is_reset_on_update(model_root, tmp_path):
    shape = dict(hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    old_dir = make_model_dir(model_root, "qwen3", **shape)
    new_dir = make_model_dir(model_root, "qwen3", seed=1, **shape)
    errors = {}
    for disable_reset in (False, True):
        ((generated, logprobs),) = spawn(1, _worker, old_dir, new_dir, str(tmp_path / str(disable_reset)),
                                         disable_reset)
        errors[disable_reset] = (_reference(new_dir, generated) - torch.tensor(logprobs, dtype=torch.float64)
                                 ).abs().max().item()
    assert errors[False] <= 1e-4, errors
    assert errors[True] > 1e-2, f"negative control: a stale prefix cache should be visible, {errors}"
