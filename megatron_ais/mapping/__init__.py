"""One declarative Megatron <-> Hugging Face mapping per architecture (see rules.py), used by the loader,
the exporter, the offline converter and the resharding bridge."""
