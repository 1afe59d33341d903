"""The checkpoint store: where checkpoints live under a --save / --load directory, and how they are written
atomically, verified and pruned, whatever the format of their rank files.

    ROOT/latest_checkpointed_iteration.txt      "N", replaced atomically after the directory is complete
    ROOT/iter_000000N/megatron_ais.json         layout and the HF config of the model
    ROOT/iter_000000N/hf_assets/                tokenizer and generation config, for export
    ROOT/iter_000000N/checksums.json            size and sha256 of every rank file, written before commit
    ROOT/iter_000000N/...                       the rank files, laid out by the format (formats/torch.py)

Every rank writes into ROOT/iter_000000N.staging; once all ranks are done, one rank renames it into place and
only then moves the tracker. A crash at any point leaves the previous checkpoint and tracker untouched. On load
every rank verifies the files it reads against checksums.json; a truncated or corrupted checkpoint is refused
with the reason and the newest older one that verifies is used instead (`--keep-checkpoints` keeps them).
The store knows nothing of how tensors are laid out: a format module (`fmt`, today's per-rank torch.save layout
by default) names, writes and reads the rank files.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
from types import ModuleType
from typing import Any

import torch.distributed as dist

from megatron_ais.checkpointing.config import HF_ASSETS, LoadedCheckpoint, RankFileWrite, warn
from megatron_ais.checkpointing.formats import torch as torch_format
from megatron_ais.checkpointing.formats import torch_dist as torch_dist_format
from megatron_ais.checkpointing.ranks import CheckpointRanks, barrier, gather
from megatron_ais.errors import CheckpointError
from megatron_ais.hf_assets import copy_hf_assets

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "megatron_ais.json"
CHECKSUMS = "checksums.json"
ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
REPLACED_DIR = re.compile(r"^(iter_\d{7})\.old$")


FORMATS = {fmt.NAME: fmt for fmt in (torch_format, torch_dist_format)}  # --ckpt-format's choices


def directory_format(directory: str) -> ModuleType:
    """The format a checkpoint directory was written in, told by what it holds (a resume follows the checkpoint,
    whatever --ckpt-format says)."""
    return torch_dist_format if torch_dist_format.is_format_of(directory) else torch_format


def iteration_dir(root: str, iteration: int) -> str:
    """Return the directory of one iteration's checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    """Return the directory ranks write into before the checkpoint is committed."""
    return iteration_dir(root, iteration) + ".staging"


def read_tracker(root: str, flag: str = "--load") -> int:
    """Return the latest committed iteration under root (`flag` names it); a missing or corrupted tracker file is
    named."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise CheckpointError(f"{flag} {root} has no {TRACKER}: it is not a megatron-ais checkpoint directory "
                              "(convert a HF model with tools/convert_checkpoint.py hf-to-megatron)")
    with open(path, errors="replace") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number (corrupted)")
    return int(text)


def candidate_iterations(root: str, flag: str = "--load") -> list[int]:
    """The iterations to try, best first: the tracker's, then older committed ones. A corrupted tracker is reported
    by name and every committed iteration is tried, newest first."""
    try:
        latest = read_tracker(root, flag)
    except CheckpointError as err:
        committed = committed_iterations(root)
        if not os.path.isfile(os.path.join(root, TRACKER)) or not committed:
            raise
        warn(f"{err}; trying the committed iterations newest first ({', '.join(map(str, committed[:4]))})")
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


def checkpoint_problem(root: str, iteration: int, allow_unverified: bool = False,
                       fmt: ModuleType | None = None) -> str | None:
    """Return why a committed checkpoint cannot be used (metadata unreadable, no checksum list unless
    `allow_unverified`, a rank file missing, of the wrong size, or not listed; the format `fmt` lists them), or None.
    Checksums themselves are checked by the ranks that read them."""
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
    unlisted = [name for name in (fmt or directory_format(directory)).rank_files(directory) if name not in checksums]
    if unlisted:
        return f"{os.path.join(directory, unlisted[0])} is not listed in {CHECKSUMS}, so nothing can verify it"
    return None


def usable_iterations(root: str, allow_unverified: bool = False, fmt: ModuleType | None = None,
                      flag: str = "--load") -> list[int]:
    """Return the iterations --load (or the `flag` that names `root`) may use, best first (`candidate_iterations`),
    each passing `checkpoint_problem`. Refused ones are reported; none usable raises a CheckpointError with every
    reason."""
    usable, reasons = [], []
    for iteration in candidate_iterations(root, flag):
        problem = checkpoint_problem(root, iteration, allow_unverified, fmt)
        if problem is None:
            usable.append(iteration)
        else:
            reasons.append(problem)
            warn(f"refusing checkpoint iteration {iteration}: {problem}")
    if not usable:
        raise CheckpointError(f"{flag} {root}: no usable checkpoint: " + "; ".join(reasons))
    return usable


def read_checkpoint_metadata(root: str, iteration: int | None = None, allow_unverified: bool = False,
                             fmt: ModuleType | None = None) -> dict[str, Any]:
    """Return the layout / HF-config metadata of a checkpoint (the newest usable one by default)."""
    return _read_metadata(root, usable_iterations(root, allow_unverified, fmt)[0] if iteration is None else iteration)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(path))


def fsync_directory(path: str) -> None:
    """Make the renames in a directory durable (a power loss after a rename may otherwise undo it)."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str) -> dict[str, Any]:
    """Return the size and sha256 of a file (flushed to disk first: the tracker must never point at files that a
    power loss could still truncate)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"size": os.path.getsize(path), "sha256": digest.hexdigest()}


def write_checksums(stage: str, names: list[str] | None = None, fmt: ModuleType = torch_format) -> None:
    """Record the size and sha256 of rank files (default: all of them, as the format `fmt` lists them, and the HF
    assets) in a staging directory's checksums.json, for checkpoints one process writes (the converter); a run's ranks
    report theirs to the committer."""
    names = fmt.rank_files(stage) + _asset_files(stage) if names is None else names
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
    fsync_directory(root)  # the checkpoint's directory is in place before the tracker names it
    _atomic_write_text(os.path.join(root, TRACKER), str(iteration))
    return final


def prune_checkpoints(root: str, keep: int, protect: tuple[int, ...] = ()) -> None:
    """Remove all but the newest `keep` committed iterations up to the tracker's (the tracker's, and `protect`ed ones
    such as a run's KL reference, are always kept). Newer ones are left, uncounted: a run that fell back from a
    refused checkpoint abandoned them, and counting them would leave it fewer to fall back to."""
    latest = read_tracker(root)
    for iteration in [i for i in committed_iterations(root) if i <= latest][keep:]:
        if iteration != latest and iteration not in protect:
            _remove_directory(iteration_dir(root, iteration))
    for name in os.listdir(root):  # what a crash left mid-removal
        if name.endswith(".deleting"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


@dataclasses.dataclass
class StagedSave:
    """One rank's checkpoint save after its staging directory is prepared and the format's collectives have run:
    `write_staged` writes and checksums its files (anywhere, a background thread included), `commit_staged` commits
    once every rank has (collective)."""

    root: str
    iteration: int
    files: RankFileWrite
    is_committer: bool
    keep: int | None = None
    protect: tuple[int, ...] = ()
    written: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # name -> size and sha256
    problem: str | None = None  # why this rank's files could not be written

    @property
    def stage(self) -> str:
        return staging_dir(self.root, self.iteration)


def begin_save(root: str, iteration: int, chunks: list, metadata: dict[str, Any], hf_assets_from: str | None,
               ranks: CheckpointRanks, optimizer=None, run_state: dict | None = None, dp_group=None,
               keep: int | None = None, protect: tuple[int, ...] = (), fmt: ModuleType = torch_format,
               snapshot: bool = False) -> StagedSave:
    """Prepare the staging directory (the committer; metadata and HF assets in it) and the format's part of the save
    of model, optimizer, every DP rank's RNG state and the run state; collective over all ranks. `snapshot`: the
    format copies what training changes, so that the files may be written while it goes on. A `protect`ed
    iteration (a run's KL reference) is never saved over."""
    if iteration in protect:
        raise CheckpointError(f"refusing to save iteration {iteration} into {root}: it is protected (a run's KL "
                              "reference lives there), and a resumed run would take the new weights as its reference")
    if ranks.is_committer:
        prepare_staging(root, iteration)
        write_metadata(staging_dir(root, iteration), metadata, hf_assets_from)
    barrier()
    files = fmt.prepare_rank_files(staging_dir(root, iteration), iteration, ranks, chunks, optimizer, run_state,
                                   dp_group, snapshot)
    return StagedSave(root, iteration, files, ranks.is_committer, keep, protect)


def _asset_files(stage: str) -> list[str]:
    """The HF assets (tokenizer, generation config) a staging directory holds, as checksums.json names them."""
    assets = os.path.join(stage, HF_ASSETS)
    return [os.path.join(HF_ASSETS, name) for name in sorted(os.listdir(assets))] if os.path.isdir(assets) else []


def _digests(stage: str, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(os.path.join(stage, name)) for name in names}


def write_staged(save: StagedSave) -> StagedSave:
    """Write this rank's files of a staged save and record their sizes and sha256; no collective on a group
    training uses (see RankFileWrite). A failure is recorded, not raised, so that the commit tells every rank and none waits."""
    try:
        save.written = _digests(save.stage, save.files.write())
    except Exception as err:  # a full disk, an unwritable file: the checkpoint is not committed, the run learns why
        save.problem = f"writing the rank files failed ({type(err).__name__}: {err})"
    return save


def commit_staged(save: StagedSave) -> str:
    """Complete the format's files, exchange every rank's checksums and, when every rank's files are written, record
    them in checksums.json, commit, move the tracker and keep the newest `keep` iterations; collective over all
    ranks. Every rank raises the CheckpointError of a save that was not committed."""
    problem, written = save.problem, dict(save.written)
    try:
        written.update(_digests(save.stage, save.files.finish()))
    except Exception as err:  # megatron-core raises a failed write on every rank here
        problem = problem or f"completing the checkpoint failed ({type(err).__name__}: {err})"
    reports = gather((written, problem))
    problem = next((p for _, p in reports if p), None)
    if save.is_committer and problem is None:
        checksums = {name: entry for part, _ in reports for name, entry in part.items()}
        problem = staging_problem(save.stage, checksums)
        # the tokenizer a resume reads from the newest usable checkpoint: listed, a truncated one refuses it
        checksums.update(_digests(save.stage, _asset_files(save.stage)))
        try:  # a failure here (a full disk, a refused rename) reaches every rank below, instead of leaving them waiting
            if problem is None:
                _atomic_write_text(os.path.join(save.stage, CHECKSUMS),
                                   json.dumps(checksums, indent=1, sort_keys=True))
                commit_checkpoint(save.root, save.iteration)
        except OSError as err:
            problem = f"committing it failed ({err})"
        if problem is None and save.keep:
            try:
                prune_checkpoints(save.root, save.keep, save.protect)
            except OSError as err:
                warn(f"checkpoint iteration {save.iteration} committed, but pruning older ones failed ({err})")
    problem = next((p for p in gather(problem) if p), None)  # every rank learns it, none waits
    if problem is not None:
        raise CheckpointError(f"checkpoint iteration {save.iteration} not committed (the last one stays): {problem}")
    return iteration_dir(save.root, save.iteration)


def save_checkpoint(root: str, iteration: int, chunks: list, metadata: dict[str, Any], hf_assets_from: str | None,
                    ranks: CheckpointRanks, optimizer=None, run_state: dict | None = None, dp_group=None,
                    keep: int | None = None, protect: tuple[int, ...] = (), fmt: ModuleType = torch_format) -> str:
    """Save model, optimizer, every DP rank's RNG state and the run state atomically, now; collective over all ranks.

    The format `fmt` writes each rank's files into the staging directory (formats/torch.py: the lowest rank of each
    (TP, PP, EP) position writes the shard file; with the distributed optimizer every rank also writes its optimizer
    shard). Writers report sizes and sha256 to the committer, which records them in checksums.json, commits, moves
    the tracker and keeps the newest `keep` iterations (`begin_save`, `write_staged`, `commit_staged` in a row;
    checkpointing/background.py runs the write in the background)."""
    return commit_staged(write_staged(begin_save(root, iteration, chunks, metadata, hf_assets_from, ranks, optimizer,
                                                 run_state, dp_group, keep, protect, fmt)))


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


def newest_verified_iteration(root: str, allow_unverified: bool = False, fmt: ModuleType | None = None) -> int:
    """Return the newest iteration whose every file matches checksums.json (offline tools read all shards)."""
    for iteration in usable_iterations(root, allow_unverified, fmt):
        path = os.path.join(iteration_dir(root, iteration), CHECKSUMS)
        names = list(json.load(open(path))) if os.path.isfile(path) else []
        problem = _verify_own_files(root, iteration, names)
        if problem is None:
            return iteration
        warn(f"refusing checkpoint iteration {iteration}: {problem}; trying an older one")
    raise CheckpointError(f"{root}: every checkpoint failed verification (see the warnings above)")


def _shared_candidates(root: str, iteration: int | None, allow_unverified: bool, fmt: ModuleType | None) -> list[int]:
    """The iterations every rank tries, in the same order (rank 0's view): the usable ones, or `iteration` only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        restore_interrupted_resave(root)
    candidates = usable_iterations(root, allow_unverified, fmt)
    if dist.is_initialized():
        shared = [candidates]
        dist.broadcast_object_list(shared, src=0)
        candidates = shared[0]
    if iteration is not None:
        if iteration not in candidates:
            raise CheckpointError(f"{root} no longer holds a usable iteration {iteration} (usable: {candidates})")
        candidates = [iteration]
    return candidates


def load_checkpoint(root: str, ranks: CheckpointRanks, distributed_optimizer: bool = False,
                    iteration: int | None = None, allow_unverified: bool = False,
                    fmt: ModuleType | None = None) -> LoadedCheckpoint:
    """Load this rank's part of the newest checkpoint that every rank verifies (or of `iteration` only);
    collective when distributed. The format `fmt` (by default the one each iteration's files tell) names and reads
    this rank's files.

    A checkpoint any rank finds truncated or corrupted is refused (with the reason) and the next older usable
    one is tried; one without checksums.json is refused unless `allow_unverified`, and then loaded with a warning."""
    for iteration in _shared_candidates(root, iteration, allow_unverified, fmt):
        directory = iteration_dir(root, iteration)
        metadata = _read_metadata(root, iteration)
        reader = fmt or directory_format(directory)
        files = reader.files_to_read(directory, ranks, distributed_optimizer)
        try:  # a rank's failure here reaches every rank through the gather below
            problem = _verify_own_files(root, iteration, files)
        except (OSError, ValueError) as err:
            problem = f"{directory} cannot be verified ({type(err).__name__}: {err})"
        if problem is None:
            try:
                state, distrib = reader.read_rank_files(directory, files)
            except CheckpointError as err:  # a file that would run code: refused unrun, it names itself
                problem = str(err)
            except Exception as err:  # an unpicklable file is as corrupt as a bad checksum
                problem = f"{files[0]} cannot be read ({type(err).__name__}: {err})"
        bad = [p for p in gather(problem) if p]
        if not bad:
            if not os.path.isfile(os.path.join(directory, CHECKSUMS)):
                warn(f"loading {directory} unverified (--allow-unverified-checkpoint): it has no {CHECKSUMS}")
            return LoadedCheckpoint(root, iteration, directory, metadata, state, distrib, reader.NAME)
        warn(f"refusing checkpoint iteration {iteration}: {bad[0]}; trying an older one")
    raise CheckpointError(f"--load {root}: every checkpoint failed verification (see the warnings above)")


def load_rank_state(root: str, tp_rank: int, pp_rank: int, pp_size: int, iteration: int | None = None,
                    ep_rank: int = 0, ep_size: int = 1, mmap: bool = False, fmt: ModuleType | None = None) -> dict:
    """Return one shard's saved state, read by the format `fmt` (the newest usable iteration by default; `mmap`:
    tensors mapped from the file, read when used)."""
    iteration = usable_iterations(root, fmt=fmt)[0] if iteration is None else iteration
    directory = iteration_dir(root, iteration)
    return (fmt or directory_format(directory)).read_rank_state(directory, tp_rank, pp_rank, pp_size, ep_rank, ep_size,
                                                                mmap)
