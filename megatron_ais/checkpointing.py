"""Megatron checkpoints in Megatron-LM's per-rank layout, written atomically.

    ROOT/latest_checkpointed_iteration.txt              "N", replaced atomically after the directory is complete
    ROOT/iter_000000N/megatron_ais.json                 layout and the HF config of the model
    ROOT/iter_000000N/hf_assets/                        tokenizer and generation config, for export
    ROOT/iter_000000N/checksums.json                    size and sha256 of every rank file, written before commit
    ROOT/iter_000000N/mp_rank_TT[_PPP]/model_optim_rng.pt      model, optimizer, RNG of every DP rank, run state
    ROOT/iter_000000N/mp_rank_TT[_PPP]/distrib_optim_dpDDD.pt  distributed-optimizer shard of DP rank DDD

Every rank writes into ROOT/iter_000000N.staging; once all ranks are done, one rank renames it into place and
only then moves the tracker. A crash at any point leaves the previous checkpoint and tracker untouched. On load
every rank verifies the files it reads against checksums.json; a truncated or corrupted checkpoint is refused
with the reason and the newest older one that verifies is used instead (`--keep-checkpoints` keeps them).
Parameter names are stored with local-spec names and stage-local layer indices, as Megatron-LM stores them.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import torch

from megatron_ais.errors import CheckpointError
from megatron_ais.flags import FlagConfig, flag

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "megatron_ais.json"
HF_ASSETS = "hf_assets"
RANK_FILE = "model_optim_rng.pt"
CHECKSUMS = "checksums.json"
LOCK_FILE = "megatron_ais.lock"
ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
REPLACED_DIR = re.compile(r"^(iter_\d{7})\.old$")
CHECKPOINT_VERSION = 3.0
# files of a HF model directory that are not weights and travel with a checkpoint
HF_ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(FlagConfig):
    """Where a run starts from and where it saves."""

    load: str | None = flag(None, "Megatron checkpoint directory to start from (written by "
                                  "tools/convert_checkpoint.py or a previous run). Overrides the weights of --hf-dir.",
                            type=str)
    save: str | None = flag(None, "Directory to write checkpoints to (model, optimizer, RNG states, run state; "
                                  "atomic, with a checksum per file). Point --load at it to resume.", type=str)
    save_interval: int | None = flag(None, "Save a checkpoint every this many steps.", type=int)
    keep_checkpoints: int = flag(2, "Committed iterations kept under --save (older ones are removed); more than one "
                                    "lets a corrupted newest checkpoint fall back to the previous one.")
    finetune: bool = flag(False, "Take only the weights of --load: fresh optimizer, RNG and step counter (like "
                                 "Megatron-LM). Implied for weights-only checkpoints (converted from HF or written by "
                                 "SFT runs).")
    allow_unverified_checkpoint: bool = flag(
        False, "Load a --load (or --ref-load) checkpoint that has no checksums.json, i.e. one whose files nobody can "
               "verify (written by another tool); the log says so. Without it such a checkpoint is refused.")

    def __post_init__(self):
        from megatron_ais.errors import ArgumentValidationError

        if self.save_interval is not None and not self.save:
            raise ArgumentValidationError("--save-interval needs --save DIR")
        if self.save_interval is not None and self.save_interval < 1:
            raise ArgumentValidationError(f"--save-interval {self.save_interval} must be a positive integer")
        if self.keep_checkpoints < 1:
            raise ArgumentValidationError(f"--keep-checkpoints {self.keep_checkpoints} must be at least 1")

    def saves_at(self, step: int, last_step: int) -> bool:
        """Whether the run saves after `step`: every --save-interval steps and after its last step."""
        return bool(self.save) and (step == last_step or bool(self.save_interval and step % self.save_interval == 0))


def _holder(text: str) -> str:
    """The run a lock file names, in words."""
    try:
        holder = json.loads(text)
        return f"the run of pid {holder['pid']} on host {holder['host']} started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a run that left no description"


class RunLock:
    """One live run per directory: an exclusive flock on DIR/megatron_ais.lock, held for the life of the run, the
    holder's host, pid and start time written inside. The kernel drops a flock when its holder dies, so a lock file
    that nobody holds is a dead run's and is taken over."""

    def __init__(self, directory: str, flag: str = "--save"):
        self.directory, self.flag, self.fd = directory, flag, None
        self.path = os.path.join(directory, LOCK_FILE)

    def acquire(self) -> str | None:
        """Hold the lock; return a message when a dead run's lock was taken over. Raise a CheckpointError naming the
        holder when a live run holds it."""
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise CheckpointError(f"{self.flag} {self.directory} is in use by {holder}: one run per directory; stop "
                                  f"that run or choose another {self.flag}") from None
        except OSError as err:  # a filesystem without flock: the run goes on unguarded, and says so
            os.close(fd)
            return f"{self.flag} {self.directory} cannot be locked ({err.strerror}): nothing keeps a second run out"
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return f"taking over the lock of {self.directory}: {_holder(previous)} is gone" if previous.strip() else None

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def refuse_if_in_use(directory: str, flag: str = "--load") -> None:
    """Raise a CheckpointError naming the holder when a live run holds `directory`'s lock (a --load of a directory
    another run is saving into)."""
    path = os.path.join(directory, LOCK_FILE)
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        raise CheckpointError(f"{flag} {directory} is in use by {holder}; wait for it to end, or load one of its "
                              "checkpoints from a copy") from None
    except OSError:
        pass  # a filesystem without flock locks nothing
    finally:
        os.close(fd)


def refuse_directories_in_use(checkpoint: CheckpointConfig) -> None:
    """Before anything reads a checkpoint: refuse a --save or --load directory that a live run holds."""
    for option, directory in (("--save", checkpoint.save), ("--load", checkpoint.load)):
        if directory:
            refuse_if_in_use(directory, option)


def hold_save_directory(checkpoint: CheckpointConfig) -> RunLock | None:
    """Hold --save's lock for the life of the run (taking over a dead run's, with a warning)."""
    if not checkpoint.save:
        return None
    lock = RunLock(checkpoint.save)
    message = lock.acquire()
    if message:
        _warn(message)
    return lock


def checkpoint_bytes(build) -> int:
    """About how many bytes one checkpoint of a model takes: its weights, and Adam's two fp32 moments (with BF16,
    the fp32 main weights too)."""
    per_parameter = 2 + 4 + 8 if build.precision == "bf16" else 4 + 8
    return build.shape.num_parameters(build.padded_vocab_size) * per_parameter


def nearest_existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable(path: str, flag: str) -> None:
    """Refuse a directory that cannot be written (or created), naming the flag; the probe file is removed at once."""
    base = nearest_existing(path)
    if not os.path.isdir(base):
        raise CheckpointError(f"{flag} {path}: {base} is not a directory; choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".megatron-ais-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"{flag} {path} cannot be written ({err.strerror} in {base}); choose a directory this "
                              "user can write") from None


def check_room(path: str, nbytes: int, flag: str) -> None:
    """Refuse a directory on a filesystem with less than `nbytes` free (a checkpoint's size), naming the flag."""
    free = shutil.disk_usage(nearest_existing(path)).free
    if free < nbytes:
        raise CheckpointError(f"{flag} {path}: one checkpoint of this model takes about {nbytes / 1e9:.2f} GB and "
                              f"{free / 1e9:.2f} GB are free there; free some space or choose another {flag}")


def iteration_dir(root: str, iteration: int) -> str:
    """Return the directory of one iteration's checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    """Return the directory ranks write into before the checkpoint is committed."""
    return iteration_dir(root, iteration) + ".staging"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Return Megatron-LM's per-rank directory name: `mp_rank_TT`, `_PPP` appended under PP, `_EEE` under expert
    parallelism (each expert-parallel rank's directory holds the dense weights and its own experts)."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
            + (f"_{ep_rank:03d}" if ep_size > 1 else ""))


def read_tracker(root: str) -> int:
    """Return the latest committed iteration under root; a missing or corrupted tracker file is named."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise CheckpointError(f"--load {root} has no {TRACKER}: it is not a megatron-ais checkpoint directory "
                              "(convert a HF model with tools/convert_checkpoint.py hf-to-megatron)")
    with open(path, errors="replace") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number (corrupted)")
    return int(text)


def candidate_iterations(root: str) -> list[int]:
    """The iterations to try, best first: the tracker's, then older committed ones. A corrupted tracker is reported
    by name and every committed iteration is tried, newest first."""
    try:
        latest = read_tracker(root)
    except CheckpointError as err:
        committed = committed_iterations(root)
        if not os.path.isfile(os.path.join(root, TRACKER)) or not committed:
            raise
        _warn(f"{err}; trying the committed iterations newest first ({', '.join(map(str, committed[:4]))})")
        return committed
    return [latest] + [i for i in committed_iterations(root) if i < latest]


def _read_metadata(root: str, iteration: int) -> dict[str, Any]:
    path = os.path.join(iteration_dir(root, iteration), METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {iteration_dir(root, iteration)} has no {METADATA}; it is incomplete")
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from err


def restore_interrupted_resave(root: str) -> None:
    """Where a filesystem cannot swap directories atomically, a re-save of iteration N moves the committed iter_N
    aside (iter_N.old) before the new copy takes its place: a crash between the two renames leaves only
    iter_N.old, which is put back here; one left beside a committed iter_N (a crash during its removal) is removed.
    Called by the run that owns the directory (startup, load, save), never by plain readers; idempotent, and
    ranks racing on it are harmless."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        m = REPLACED_DIR.match(name)
        if m is None:
            continue
        old, final = os.path.join(root, name), os.path.join(root, m.group(1))
        if os.path.exists(final):
            _remove_directory(old)
        else:
            with contextlib.suppress(OSError):
                os.replace(old, final)


def _remove_directory(path: str) -> None:
    """Rename to .deleting first: a crash during the removal must not leave a half-deleted directory under a name
    that looks like a checkpoint (one whose checksums.json went first would pass for a weights-only one)."""
    doomed = path + ".deleting"
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def exchange_paths(a: str, b: str) -> bool:
    """Swap two directory entries in one atomic step (Linux renameat2 with RENAME_EXCHANGE); return False where the
    C library, the kernel or the filesystem cannot, so that the caller falls back to two renames."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def committed_iterations(root: str) -> list[int]:
    """Return the committed iterations under root, newest first (staging and replaced copies excluded)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((int(m.group(1)) for m in map(ITERATION_DIR.match, names) if m), reverse=True)


def rank_files(directory: str) -> list[str]:
    """The rank files of a checkpoint directory (model, optimizer shards), relative to it."""
    return sorted(os.path.relpath(os.path.join(d, name), directory) for d, _, names in os.walk(directory)
                  if os.path.basename(d).startswith("mp_rank_") for name in names if name.endswith(".pt"))


def checkpoint_problem(root: str, iteration: int, allow_unverified: bool = False) -> str | None:
    """Return why a committed checkpoint cannot be used (metadata unreadable, no checksum list unless
    `allow_unverified`, a rank file missing, of the wrong size, or not listed), or None. Checksums themselves are
    checked by the ranks that read them."""
    try:
        _read_metadata(root, iteration)
    except CheckpointError as err:
        return str(err)
    directory = iteration_dir(root, iteration)
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.isfile(path):
        return None if allow_unverified else (
            f"{directory} has no {CHECKSUMS}, so nothing can verify its files (written by another tool?); pass "
            "--allow-unverified-checkpoint to load it unverified")
    try:
        with open(path) as f:
            checksums = json.load(f)
    except ValueError as err:
        return f"{path} is unreadable ({err})"
    for name, entry in checksums.items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != entry["size"]:
            return f"{file} has {os.path.getsize(file)} bytes, checksums.json says {entry['size']} (truncated?)"
    unlisted = [name for name in rank_files(directory) if name not in checksums]
    if unlisted:
        return f"{os.path.join(directory, unlisted[0])} is not listed in {CHECKSUMS}, so nothing can verify it"
    return None


def _warn(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def usable_iterations(root: str, allow_unverified: bool = False) -> list[int]:
    """Return the iterations --load may use, best first (`candidate_iterations`), each passing `checkpoint_problem`.
    Refused ones are reported; none usable raises a CheckpointError with every reason."""
    usable, reasons = [], []
    for iteration in candidate_iterations(root):
        problem = checkpoint_problem(root, iteration, allow_unverified)
        if problem is None:
            usable.append(iteration)
        else:
            reasons.append(problem)
            _warn(f"refusing checkpoint iteration {iteration}: {problem}")
    if not usable:
        raise CheckpointError(f"--load {root}: no usable checkpoint: " + "; ".join(reasons))
    return usable


def read_checkpoint_metadata(root: str, iteration: int | None = None, allow_unverified: bool = False
                             ) -> dict[str, Any]:
    """Return the layout / HF-config metadata of a checkpoint (the newest usable one by default)."""
    return _read_metadata(root, usable_iterations(root, allow_unverified)[0] if iteration is None else iteration)


def checkpoint_metadata(build, hf_config: dict, iteration: int, data_parallel_size: int | None = None,
                        use_distributed_optimizer: bool | None = None, **extra) -> dict[str, Any]:
    """Return the metadata every checkpoint carries: HF config, parallel layout (with the data-parallel size and
    optimizer kind, which the distributed optimizer's shards depend on; None for weights-only checkpoints),
    vocabulary padding, iteration, and `extra` (a converted checkpoint's source)."""
    layout = build.layout
    return {"hf_config": hf_config, "tensor_model_parallel_size": layout.tensor,
            "data_parallel_size": data_parallel_size, "use_distributed_optimizer": use_distributed_optimizer,
            "pipeline_model_parallel_size": layout.pipeline, "expert_model_parallel_size": layout.expert,
            "expert_tensor_parallel_size": layout.expert_tensor_size,
            "make_vocab_size_divisible_by": build.make_vocab_size_divisible_by,
            "padded_vocab_size": build.padded_vocab_size, "iteration": iteration, **extra}


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_state(stage: str, tp_rank: int, pp_rank: int, pp_size: int, state: dict, ep_rank: int = 0,
                     ep_size: int = 1) -> None:
    """Write one rank's state file into a staging directory."""
    directory = os.path.join(stage, rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RANK_FILE)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def copy_hf_assets(src_dir: str, dst_dir: str) -> None:
    """Copy the non-weight files of a HF model directory (tokenizer, chat template, generation config)."""
    os.makedirs(dst_dir, exist_ok=True)
    for name in HF_ASSET_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst_dir, name))


def write_checksums(stage: str, names: list[str] | None = None) -> None:
    """Record the size and sha256 of rank files (default: all of them) in a staging directory's checksums.json, for
    checkpoints one process writes (the converter); a run's ranks report theirs to the committer."""
    names = rank_files(stage) if names is None else names
    _atomic_write_text(os.path.join(stage, CHECKSUMS),
                       json.dumps({n: file_digest(os.path.join(stage, n)) for n in names}, indent=1, sort_keys=True))


def write_metadata(stage: str, metadata: dict[str, Any], hf_assets_from: str | None) -> None:
    """Write the metadata and copy the HF tokenizer / generation config into a staging directory."""
    os.makedirs(stage, exist_ok=True)
    _atomic_write_text(os.path.join(stage, METADATA), json.dumps(metadata, indent=2))
    if hf_assets_from:
        copy_hf_assets(hf_assets_from, os.path.join(stage, HF_ASSETS))


def prepare_staging(root: str, iteration: int) -> str:
    """Create an empty staging directory for an iteration (removing a crashed attempt) and return it."""
    restore_interrupted_resave(root)
    stage = staging_dir(root, iteration)
    if os.path.isdir(stage):
        shutil.rmtree(stage)
    os.makedirs(stage)
    return stage


def commit_checkpoint(root: str, iteration: int) -> str:
    """Move a complete staging directory into place, then point the tracker at it; return the final path."""
    stage, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    if not os.path.isfile(os.path.join(stage, METADATA)):
        raise CheckpointError(f"refusing to commit {stage}: it has no {METADATA}")
    if os.path.isdir(final):
        # re-saving an iteration: swap the new copy in atomically, so that iter_N holds one complete copy at every
        # instant; where the filesystem cannot, move the old copy aside first (restore_interrupted_resave)
        if exchange_paths(stage, final):
            _remove_directory(stage)  # it holds the old copy now
        else:
            old = final + ".old"
            _remove_directory(old)
            os.replace(final, old)
            os.replace(stage, final)
            _remove_directory(old)
    else:
        os.replace(stage, final)
    _atomic_write_text(os.path.join(root, TRACKER), str(iteration))
    return final


def load_rank_state(root: str, tp_rank: int, pp_rank: int, pp_size: int, iteration: int | None = None,
                    ep_rank: int = 0, ep_size: int = 1, mmap: bool = False) -> dict:
    """Return one rank's saved state (the newest usable iteration by default; `mmap`: tensors mapped from the file,
    read when used)."""
    iteration = usable_iterations(root)[0] if iteration is None else iteration
    path = os.path.join(iteration_dir(root, iteration), rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        RANK_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def check_layout(metadata: dict[str, Any], layout, root: str) -> None:
    """Raise a CheckpointError naming the flags when a checkpoint was saved at another TP / PP / EP / expert-TP
    layout than the ParallelLayout `layout` (checkpoints that predate the expert-TP record are not checked on it)."""
    tp, pp, ep, etp = layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor_size
    saved = (metadata["tensor_model_parallel_size"], metadata["pipeline_model_parallel_size"],
             metadata.get("expert_model_parallel_size", 1), metadata.get("expert_tensor_parallel_size") or etp)
    if saved != (tp, pp, ep, etp):
        raise CheckpointError(
            f"--load {root} was saved at TP{saved[0]} x PP{saved[1]} x EP{saved[2]} x expert-TP{saved[3]} but the run "
            f"uses --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} --expert-model-parallel-size "
            f"{ep} --expert-tensor-parallel-size {etp}; use the saved sizes, or reshard: "
            "tools/convert_checkpoint.py megatron-to-hf then hf-to-megatron with the new sizes")


def check_vocab_padding(metadata: dict[str, Any], divisible_by: int, tp: int, root: str) -> None:
    """Raise a CheckpointError naming the flag when this run would pad the vocabulary to another size than the
    checkpoint's (checkpoints that predate the record are not checked)."""
    from megatron_ais.model import ModelShape

    saved = metadata.get("padded_vocab_size")
    if saved is None:
        return
    padded = ModelShape.from_hf_config(metadata["hf_config"]).padded_vocab_size(divisible_by, tp)
    if padded != saved:
        raise CheckpointError(f"--load {root} holds a vocabulary padded to {saved} rows, this run pads to {padded} "
                              f"(--make-vocab-size-divisible-by {divisible_by}); use the saved run's "
                              f"--make-vocab-size-divisible-by "
                              f"{metadata.get('make_vocab_size_divisible_by', '(see its megatron_ais.json)')}")


def _model_keys(num_chunks: int) -> list[str]:
    # Megatron-LM's convention: "model", or "model0", "model1", ... with virtual pipeline chunks
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_state(chunks: list) -> dict[str, dict[str, torch.Tensor]]:
    """Return this rank's parameters keyed by local-spec name (TE names canonicalised), per model chunk."""
    from megatron_ais.mapping.rules import canonical_name
    from megatron_ais.model import unwrap_model

    return {key: {canonical_name(n): p.detach().clone() for n, p in unwrap_model(chunk).named_parameters()}
            for key, chunk in zip(_model_keys(len(chunks)), chunks)}


@torch.no_grad()
def load_model_state(chunks: list, state: dict) -> None:
    """Copy saved parameters into this rank's chunks; every parameter must be present with the right shape."""
    from megatron_ais.mapping.rules import canonical_name
    from megatron_ais.model import unwrap_model

    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        if key not in state:
            raise CheckpointError(f"checkpoint has no {key!r} entry (saved with another virtual pipeline size?)")
        saved = dict(state[key])
        for name, param in unwrap_model(chunk).named_parameters():
            tensor = saved.pop(canonical_name(name), None)
            if tensor is None:
                raise CheckpointError(f"checkpoint is missing parameter {canonical_name(name)!r}")
            if tensor.shape != param.shape:
                raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.copy_(tensor)
        if saved:
            raise CheckpointError(f"checkpoint has parameters the model lacks: {sorted(saved)[:5]}")




def file_digest(path: str) -> dict[str, Any]:
    """Return the size and sha256 of a file (flushed to disk first: the tracker must never point at files that a
    power loss could still truncate)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"size": os.path.getsize(path), "sha256": digest.hexdigest()}


def rng_state() -> dict[str, Any]:
    """Return this rank's Python, NumPy, torch (and CUDA + megatron tracker) random states."""
    import numpy as np

    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["rng_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random states returned by `rng_state`."""
    import numpy as np

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _sub_optimizers(optimizer))


def distributed_optimizer_shard(optimizer) -> list:
    """Return this DP rank's distributed-optimizer state (fp32 main params, Adam moments and step), per
    sub-optimizer in megatron's bucket order."""
    return [o.get_parameter_state_dp_reshardable() for o in _sub_optimizers(optimizer)]


@torch.no_grad()
def load_distributed_optimizer_shard(optimizer, shard: list) -> None:
    """Copy a `distributed_optimizer_shard` back into an optimizer of the same layout."""
    subs = _sub_optimizers(optimizer)
    if len(subs) != len(shard):
        raise CheckpointError(f"distributed optimizer has {len(subs)} parts, the checkpoint {len(shard)}")
    for opt, state in zip(subs, shard):
        if state["per_bucket_numel_unpadded"] != opt.per_bucket_numel_unpadded:
            raise CheckpointError("distributed-optimizer buckets differ from the checkpoint's (saved with another "
                                  "data-parallel size or bucket size); resume with the saved layout")
        for gbuf_idx, range_maps in enumerate(opt.gbuf_ranges):
            for dtype, buckets in range_maps.items():
                for bucket_idx, range_map in enumerate(buckets):
                    saved = state[gbuf_idx][dtype][bucket_idx]
                    for tensors, model_param in zip(saved, range_map["param_map"]):
                        opt._set_main_param_and_optimizer_states(
                            model_param, {k: v for k, v in tensors.items() if not k.startswith("gbuf_local")})


@dataclasses.dataclass(frozen=True)
class CheckpointRanks:
    """Where this rank sits: its shard directory (TP, PP, EP), its DP rank, whether it writes its shard file (the
    directory's lowest rank: DP rank 0 without expert parallelism, expert-data-parallel rank 0 with it) and whether
    it commits. `from_parallel_state` is collective."""

    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    is_committer: bool = True
    ep_rank: int = 0
    ep_size: int = 1
    writes_shard: bool = True

    @classmethod
    def from_parallel_state(cls) -> "CheckpointRanks":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        rank, cp0 = dist.get_rank(), ps.get_context_parallel_rank() == 0
        position = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_expert_model_parallel_rank())
        marks = _gather((rank, position, cp0))
        # the lowest rank of each shard directory writes it: expert-data-parallel rank 0 where it holds that TP rank's
        # dense shard, and also the ranks whose TP rank no such rank has (expert-TP x EP < TP)
        writes = cp0 and rank == min(r for r, p, c in marks if p == position and c)
        return cls(position[0], position[1], ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_rank(),
                   rank == 0, position[2], ps.get_expert_model_parallel_world_size(), writes)

    @property
    def shard_dir(self) -> str:
        return rank_dir_name(self.tp_rank, self.pp_rank, self.pp_size, self.ep_rank, self.ep_size)

    def distrib_optim_file(self) -> str:
        return os.path.join(self.shard_dir, f"distrib_optim_dp{self.dp_rank:03d}.pt")

    def rank_file(self) -> str:
        return os.path.join(self.shard_dir, RANK_FILE)


def _gather(obj, group=None) -> list:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def prune_checkpoints(root: str, keep: int, protect: tuple[int, ...] = ()) -> None:
    """Remove all but the newest `keep` committed iterations (the tracker's, and `protect`ed ones such as a run's
    KL reference, are always kept)."""
    latest = read_tracker(root)
    for iteration in committed_iterations(root)[keep:]:
        if iteration != latest and iteration not in protect:
            _remove_directory(iteration_dir(root, iteration))
    for name in os.listdir(root):  # what a crash left mid-removal
        if name.endswith(".deleting"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_checkpoint(root: str, iteration: int, chunks: list, metadata: dict[str, Any], hf_assets_from: str | None,
                    ranks: CheckpointRanks, optimizer=None, run_state: dict | None = None, dp_group=None,
                    keep: int | None = None, protect: tuple[int, ...] = ()) -> str:
    """Save model, optimizer, every DP rank's RNG state and the run state atomically; collective over all ranks.

    The lowest rank of each (TP, PP, EP) position writes the shard file; with the distributed optimizer every rank also
    writes its optimizer shard. Writers report sizes and sha256 to the committer, which records them in
    checksums.json, commits, moves the tracker and keeps the newest `keep` iterations."""
    stage = staging_dir(root, iteration)
    if ranks.is_committer:
        prepare_staging(root, iteration)
        write_metadata(stage, metadata, hf_assets_from)
    _barrier()
    rng_states = _gather(rng_state(), dp_group)
    written = {}
    distributed = optimizer is not None and _is_distributed(optimizer)
    if ranks.writes_shard:
        state = {**model_state(chunks), "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                 "rng_state": rng_states, "run_state": run_state}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        write_rank_state(stage, ranks.tp_rank, ranks.pp_rank, ranks.pp_size, state, ranks.ep_rank, ranks.ep_size)
        written[ranks.rank_file()] = file_digest(os.path.join(stage, ranks.rank_file()))
    if distributed:
        path = os.path.join(stage, ranks.distrib_optim_file())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(distributed_optimizer_shard(optimizer), path + ".tmp")
        os.replace(path + ".tmp", path)
        written[ranks.distrib_optim_file()] = file_digest(path)
    checksums = {name: entry for part in _gather(written) for name, entry in part.items()}
    problem = None
    if ranks.is_committer:
        problem = staging_problem(stage, checksums)
        if problem is None:
            _atomic_write_text(os.path.join(stage, CHECKSUMS), json.dumps(checksums, indent=1, sort_keys=True))
            commit_checkpoint(root, iteration)
            if keep:
                prune_checkpoints(root, keep, protect)
    problem = next((p for p in _gather(problem) if p), None)  # every rank learns it, none waits
    if problem is not None:
        raise CheckpointError(f"checkpoint iteration {iteration} not committed (the last one stays): {problem}")
    return iteration_dir(root, iteration)


def staging_problem(stage: str, checksums: dict[str, dict[str, Any]]) -> str | None:
    """What keeps a staging directory from being committed: files the writers reported that the committer does not
    see at their size (a --save directory that is not one filesystem shared by every node)."""
    missing = [name for name, entry in sorted(checksums.items())
               if not os.path.isfile(os.path.join(stage, name))
               or os.path.getsize(os.path.join(stage, name)) != entry["size"]]
    if missing:
        return (f"{len(missing)} rank file(s) are missing or short in {stage} as the committing rank sees it (e.g. "
                f"{missing[0]}); --save must be a directory every node shares")
    return None


@dataclasses.dataclass
class LoadedCheckpoint:
    """What --load gives one rank: the iteration used, its metadata, the shard state and optimizer shard."""

    root: str
    iteration: int
    metadata: dict[str, Any]
    state: dict
    distrib_optim: list | None

    @property
    def assets_dir(self) -> str:
        return os.path.join(iteration_dir(self.root, self.iteration), HF_ASSETS)

    @property
    def run_state(self) -> dict | None:
        return self.state.get("run_state")


def _verify_own_files(root: str, iteration: int, files: list[str]) -> str | None:
    directory = iteration_dir(root, iteration)
    path = os.path.join(directory, CHECKSUMS)
    checksums = {}
    if os.path.isfile(path):
        with open(path) as f:
            checksums = json.load(f)
    for name in files:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if name in checksums and file_digest(file) != checksums[name]:
            return f"{file} does not match its sha256 in {CHECKSUMS} (corrupted)"
    return None


def newest_verified_iteration(root: str, allow_unverified: bool = False) -> int:
    """Return the newest iteration whose every file matches checksums.json (offline tools read all shards)."""
    for iteration in usable_iterations(root, allow_unverified):
        path = os.path.join(iteration_dir(root, iteration), CHECKSUMS)
        names = list(json.load(open(path))) if os.path.isfile(path) else []
        problem = _verify_own_files(root, iteration, names)
        if problem is None:
            return iteration
        _warn(f"refusing checkpoint iteration {iteration}: {problem}; trying an older one")
    raise CheckpointError(f"{root}: every checkpoint failed verification (see the warnings above)")


def load_checkpoint(root: str, ranks: CheckpointRanks, distributed_optimizer: bool = False,
                    iteration: int | None = None, allow_unverified: bool = False) -> LoadedCheckpoint:
    """Load this rank's part of the newest checkpoint that every rank verifies (or of `iteration` only);
    collective when distributed.

    A checkpoint any rank finds truncated or corrupted is refused (with the reason) and the next older usable
    one is tried; one without checksums.json is refused unless `allow_unverified`, and then loaded with a warning."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        restore_interrupted_resave(root)
    candidates = usable_iterations(root, allow_unverified)
    if dist.is_initialized():  # every rank tries the same iterations in the same order (rank 0's view)
        shared = [candidates]
        dist.broadcast_object_list(shared, src=0)
        candidates = shared[0]
    if iteration is not None:
        if iteration not in candidates:
            raise CheckpointError(f"{root} no longer holds a usable iteration {iteration} (usable: {candidates})")
        candidates = [iteration]
    for iteration in candidates:
        metadata = _read_metadata(root, iteration)
        files = [ranks.rank_file()]
        has_distrib = os.path.isfile(os.path.join(iteration_dir(root, iteration), ranks.distrib_optim_file()))
        if distributed_optimizer and has_distrib:
            files.append(ranks.distrib_optim_file())
        problem = _verify_own_files(root, iteration, files)
        if problem is None:
            try:
                state = torch.load(os.path.join(iteration_dir(root, iteration), files[0]), map_location="cpu",
                                   weights_only=False)
                distrib = (torch.load(os.path.join(iteration_dir(root, iteration), files[1]), map_location="cpu",
                                      weights_only=False) if len(files) > 1 else None)
            except Exception as err:  # an unpicklable file is as corrupt as a bad checksum
                problem = f"{files[0]} cannot be read ({type(err).__name__}: {err})"
        problems = _gather(problem) if dist.is_initialized() else [problem]
        bad = [p for p in problems if p]
        if not bad:
            if not os.path.isfile(os.path.join(iteration_dir(root, iteration), CHECKSUMS)):
                _warn(f"loading {iteration_dir(root, iteration)} unverified (--allow-unverified-checkpoint): it has "
                      f"no {CHECKSUMS}")
            return LoadedCheckpoint(root, iteration, metadata, state, distrib)
        _warn(f"refusing checkpoint iteration {iteration}: {bad[0]}; trying an older one")
    raise CheckpointError(f"--load {root}: every checkpoint failed verification (see the warnings above)")


def _unshare_adam_steps(optimizer) -> None:
    # megatron's DistributedOptimizer.load_state_dict (without Apex/TE) gives every parameter's state the same
    # `step` tensor; torch Adam increments it in place once per parameter, so the bias correction would be wrong
    for sub in _sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def check_optimizer_layout(metadata: dict[str, Any], distributed: bool, dp_size: int, root: str) -> None:
    """Raise a CheckpointError naming the flags when the optimizer state cannot be resumed as this run is laid out:
    distributed-optimizer shards belong to one data-parallel size, and the two optimizer kinds save different
    states (checkpoints that predate these records are not checked)."""
    saved_distributed, saved_dp = metadata.get("use_distributed_optimizer"), metadata.get("data_parallel_size")
    if saved_distributed is not None and saved_distributed != distributed:
        raise CheckpointError(f"--load {root} was saved {'with' if saved_distributed else 'without'} "
                              f"--use-distributed-optimizer; resume {'with' if saved_distributed else 'without'} it, "
                              "or start from its weights with --finetune")
    if distributed and saved_dp is not None and saved_dp != dp_size:
        raise CheckpointError(f"--load {root} holds distributed-optimizer shards of {saved_dp} data-parallel ranks, "
                              f"this run has {dp_size}: resume with world size = TP x PP x {saved_dp}, or start from "
                              "its weights with --finetune")


def restore_training_state(loaded: LoadedCheckpoint, optimizer, dp_rank: int, dp_size: int | None = None) -> None:
    """Restore optimizer state (and distributed-optimizer shard) and this DP rank's RNG state."""
    if "optimizer" not in loaded.state:
        raise CheckpointError(f"checkpoint {iteration_dir(loaded.root, loaded.iteration)} holds no optimizer "
                              "state (weights only); start from it with --finetune")
    if dp_size is not None:
        check_optimizer_layout(loaded.metadata, _is_distributed(optimizer), dp_size, loaded.root)
    optimizer.load_state_dict(loaded.state["optimizer"])
    _unshare_adam_steps(optimizer)
    if _is_distributed(optimizer):
        if loaded.distrib_optim is None:
            raise CheckpointError(f"checkpoint {iteration_dir(loaded.root, loaded.iteration)} was saved without "
                                  "--use-distributed-optimizer; resume without it, or with --finetune")
        load_distributed_optimizer_shard(optimizer, loaded.distrib_optim)
    states = loaded.state.get("rng_state") or []
    if dp_rank < len(states):
        set_rng_state(states[dp_rank])
