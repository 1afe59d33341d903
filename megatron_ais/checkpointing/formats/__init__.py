"""Checkpoint formats: how the rank files of one iteration are laid out, the one replaceable part; the store
(store.py: staging, checksums, atomic commit, verified fallback) and the run lock (lock.py) stay whatever the format.

A format is a module with
    NAME                                           its --ckpt-format choice
    RESHARDS_ON_LOAD                               whether a checkpoint loads at another TP / PP / EP / DP layout
                                                   (and vocabulary padding) than it was saved at
    rank_files(directory)                          the rank files of a checkpoint directory, relative to it
    prepare_rank_files(stage, iteration, ranks, chunks, optimizer, run_state, dp_group, snapshot)
                                                   the format's collectives of a save (and, with `snapshot`, a copy
                                                   of what training changes); returns a config.RankFileWrite whose
                                                   `write` writes this rank's files into the staging directory (no
                                                   collective: --async-save runs it in a background thread) and
                                                   whose `finish` completes them once every rank has (collective);
                                                   both return names relative to the staging directory
    files_to_read(directory, ranks, distributed_optimizer)
                                                   the files this rank reads on load, relative to the directory
    read_rank_files(directory, files)              (state, distributed-optimizer shard or None) from those files
    read_rank_state(directory, tp_rank, pp_rank, pp_size, ep_rank, ep_size, mmap)
                                                   one shard's saved state, for offline tools
    load_model(chunks, loaded)                     this rank's parameters from a LoadedCheckpoint
    restore_training_state(loaded, chunks, optimizer, dp_rank, dp_size)
                                                   the optimizer and this DP rank's RNG state (collective)

torch_dist.py: Megatron-LM's distributed format (megatron-core dist_checkpointing), `--ckpt-format`'s default; model
    and optimizer reshard on load. Its tensors are read by `load_model` / `restore_training_state`, which need the
    model to know what this rank's layout takes; its `read_rank_files` returns the run state only. Its save is
    megatron-core's asynchronous one, planned, then written by `write`, then finalised by `finish`.
torch.py: Megatron-LM's legacy per-rank `torch.save` layout; resumes at the saved layout only.
"""
