"""Reading back what Weights & Biases wrote offline: a run's `.wandb` file is a LevelDB-style log (32 KiB blocks of
records with a 7-byte header: checksum, length, type) of `wandb_internal_pb2.Record` messages."""
import glob
import json
import os
import struct
import time

BLOCK, FULL, FIRST, MIDDLE, LAST = 32768, 1, 2, 3, 4


def _records(data: bytes):
    pos, pending = 7, b""  # after the file's own header (":W&B" and a version)
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # the rest of the block is padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def offline_runs(directory: str) -> list[str]:
    """The offline run files under a W&B directory."""
    return sorted(glob.glob(os.path.join(directory, "wandb", "offline-run-*", "run-*.wandb")))


def _values(items) -> dict:
    """A record's items by key (a nested key joined by "/"), their JSON values decoded."""
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


def read_offline_run(path: str, timeout_s: float = 60.0) -> tuple[dict, dict[int, dict]]:
    """(the run's config, {step: the scalars logged at it}) of an offline run file, once the file holds the run's exit
    record: W&B's service writes the file from its own process and may still be flushing it when `finish` returns (a
    loaded CI machine once read it without the run's config)."""
    deadline = time.monotonic() + timeout_s
    while (parsed := _parse_finished_run(path)) is None:
        assert time.monotonic() < deadline, f"{path} holds no exit record {timeout_s:g} s after the run finished"
        time.sleep(0.2)
    return parsed


def _parse_finished_run(path: str) -> tuple[dict, dict[int, dict]] | None:
    from wandb.proto import wandb_internal_pb2 as pb

    config, history, finished = {}, {}, False
    with open(path, "rb") as f:
        data = f.read()
    for raw in _records(data):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config given to init, or updates the SDK sends after the run record
            config.update(_values((record.run.config if kind == "run" else record.config).update))
        elif kind == "history":
            items = _values(record.history.item)
            history[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
        finished |= kind == "exit"
    return (config, history) if finished else None
