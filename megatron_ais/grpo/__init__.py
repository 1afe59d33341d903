"""GRPO: group advantages, vocab-parallel log-probs, PPO-clip policy loss with global normalisation."""
