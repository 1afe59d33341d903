"""Megatron checkpoints, written atomically and verified on load. One module per concern, imports pointing down:

    config.py           the --load / --save flags; what a load gives a rank; the metadata every checkpoint carries
    lock.py             one live run per --save directory (a flock held for the life of the run)
    preflight.py        the checks made before any process group starts: writable, room for a checkpoint, no other
                        run's checkpoints under --save, the saved parallel layout and vocabulary padding
    ranks.py            where a rank sits in a checkpoint (shard position, writer, committer) and the collectives of a
                        save and a load
    optimizer_state.py  optimizer (plain or distributed) and RNG state: what a save takes, what a resume restores
    formats/            how the rank files are laid out (formats/torch.py: Megatron-LM's per-rank torch.save files;
                        formats/torch_dist.py: megatron-core's dist_checkpointing)
    store.py            staging, checksums, commit by rename then tracker, pruning, the fallback to the newest verified
                        iteration; format-agnostic: a format module writes and reads the rank files
    background.py       --async-save: a save's files written by a background thread, committed on the main thread
"""
