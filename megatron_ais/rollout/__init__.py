"""The fleet side of rollouts: the run's engines as one fleet (`fleet.RolloutFleet`), where they are placed, each
engine host's rollout manager, the rows each rank trains on, rewards, dynamic sampling and overlong shaping."""
