"""The engine side of rollouts: one vLLM engine (`vllm_engine.RolloutEngine`) and what it needs — its config, model
directory, memory budget, weight feeds, FP8 emulation, probes, the turns of its generations and syncs, and the code
vLLM's own processes load (`vllm_plugin`, `worker_extension`, through `vllm_compat`)."""
