"""vLLM rollout engine: lifecycle, generation, weight receive, refit verification, our vLLM plugin."""
