"""A step's rows from the engines to the data-parallel ranks that train on them: every engine host makes the rows
of its share of the prompts (advantages included: it holds whole groups); then every rank learns only a small record
per engine (row lengths, rewards, counts) and receives from each host just the rows its DP rank trains on, as
tensors by point-to-point sends: no rank gathers or broadcasts the whole batch. An engine retired meanwhile leaves
its share to the others. With dynamic sampling, every rank picks the step's groups from the records of several
rounds (`pick_groups`: the same on every rank, from the records alone) and each host cuts its batches to them before
the exchange."""
from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ais.batch import RolloutBatch, data_parallel_rows, row_lengths, row_tensors
from megatron_ais.distributed import share
from megatron_ais.rollout.fleet_layout import FleetLayout, Retired, outcome_here, retire, shared_outcomes


@dataclasses.dataclass(frozen=True)
class RowsRecord:
    """What an engine's host tells every rank about the rows of one run of prompts it made (small: a few numbers
    per row)."""

    host: int
    first_prompt: int
    lengths: tuple[int, ...]  # each row's length to its last response token (`batching.row_lengths`)
    rewards: tuple[float, ...]
    row_tokens: tuple[int, ...]  # each row's response tokens in the loss
    group_size: int
    columns: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # each row tensor's name, dtype, shape past rows
    reward_failures: int
    reward_timeouts: int
    truncated: int  # responses cut by --max-new-tokens
    partial: int  # responses sampled by more than one version of the weights
    repetitive: int  # responses that repeat an n-gram back to back
    seconds: float  # how long the engine's host took to make them

    @classmethod
    def of(cls, batch, host: int, first_prompt: int, seconds: float) -> "RowsRecord":
        return cls(host, first_prompt, tuple(row_lengths(batch.mask)), tuple(batch.rewards.tolist()),
                   tuple(int(n) for n in batch.mask.sum(dim=1).tolist()), batch.group_size,
                   tuple((name, t.dtype, tuple(t.shape[1:])) for name, t in row_tensors(batch)),
                   batch.reward_failures, batch.reward_timeouts, batch.truncated, batch.partial,
                   batch.repetitive, seconds)

    @property
    def response_tokens(self) -> int:
        return sum(self.row_tokens)

    @property
    def groups(self) -> int:
        return len(self.lengths) // self.group_size

    def group_rewards(self) -> list[tuple[float, ...]]:
        """Each of its groups' rewards, in prompt order."""
        size = self.group_size
        return [self.rewards[g * size:(g + 1) * size] for g in range(self.groups)]

    def picked(self, groups: list[int], blank: set[int], first_prompt: int) -> "RowsRecord":
        """The record of the rows of its groups `groups` (in that order; the groups in `blank` have their response
        masks zeroed, `picked_rows` on the host) as the batch's rows from prompt `first_prompt` on; the counts of
        the responses made stay with the step (`MadeRows.sampled`), not here."""
        rows = [(g, g * self.group_size + i) for g in groups for i in range(self.group_size)]
        return dataclasses.replace(
            self, first_prompt=first_prompt, lengths=tuple(1 if g in blank else self.lengths[r] for g, r in rows),
            rewards=tuple(self.rewards[r] for _, r in rows),
            row_tokens=tuple(0 if g in blank else self.row_tokens[r] for g, r in rows),
            reward_failures=0, reward_timeouts=0, truncated=0, partial=0, repetitive=0)

    def empty(self, rows: int) -> dict[str, torch.Tensor]:
        """Tensors for `rows` of these rows (what a receiver fills)."""
        return {name: torch.empty((rows,) + shape, dtype=dtype) for name, dtype, shape in self.columns}

    def nbytes(self, rows: int) -> int:
        return rows * sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in self.columns)


@dataclasses.dataclass
class MadeRows:
    """A step's rows as the engines made them: every rank's records (in prompt order), the serving engines after
    any retirement, and on each host the RolloutBatch of each of its records (by first prompt)."""

    records: list[RowsRecord]
    layout: FleetLayout
    made: dict[int, Any]
    retired: list[str]
    # the records of every response made for the step (default: `records`): dynamic sampling makes more than it
    # trains on
    sampled: list[RowsRecord] | None = None

    @property
    def made_records(self) -> list[RowsRecord]:
        return self.records if self.sampled is None else self.sampled


def picked_rows(batch: RolloutBatch, groups: list[int], blank: set[int]) -> RolloutBatch:
    """The rows of the batch's groups `groups` (in that order), with the response masks of the groups in `blank`
    zeroed: they fill the batch's shape and leave the loss."""
    size = batch.group_size
    rows = batch.rows([g * size + i for g in groups for i in range(size)])
    kept = torch.tensor([g not in blank for g in groups for _ in range(size)], dtype=rows.mask.dtype)
    return dataclasses.replace(rows, mask=rows.mask * kept.unsqueeze(-1))


def pick_groups(rounds: list[MadeRows], picked: list[int], blank: set[int], prompts_per_round: int) -> MadeRows:
    """The step's rows made of the groups at stream positions `picked` (round × prompts_per_round + prompt, in
    order; those in `blank` masked out of the loss) from each round's rows; every rank computes the records, each
    host the batches of its own."""
    position = {p: index for index, p in enumerate(picked)}
    records, made = [], {}
    for round_index, made_round in enumerate(rounds):
        for record in made_round.records:
            first = round_index * prompts_per_round + record.first_prompt
            groups = [g for g in range(record.groups) if first + g in position]
            if not groups:
                continue
            blank_here = {g for g in groups if first + g in blank}
            start = position[first + groups[0]]
            records.append(record.picked(groups, blank_here, start))
            if record.first_prompt in made_round.made:  # this rank made it
                made[start] = picked_rows(made_round.made[record.first_prompt], groups, blank_here)
    return MadeRows(sorted(records, key=lambda r: r.first_prompt), rounds[-1].layout, made, [],
                    sampled=[record for made_round in rounds for record in made_round.records])


def _make_share(make: Callable[[range], Any], shares: list[range], host: int, made: dict) -> list[RowsRecord]:
    """This host's rows of its runs of prompts (`make(prompts)` each, kept in `made` by first prompt), and their
    records."""
    records = []
    for prompts in shares:
        start = time.perf_counter()
        made[prompts.start] = make(prompts)
        records.append(RowsRecord.of(made[prompts.start], host, prompts.start, time.perf_counter() - start))
    return records


class BackgroundWorker:
    """One long-lived daemon thread that runs an engine host's background work, one task after another. It lives as
    long as the process: an engine it restarts must not die with it (the parent-death signal `lifetime.py` asks for
    follows the thread that started a process, not the process)."""

    def __init__(self, name: str):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            task, done = self._tasks.get()
            try:
                task()
            finally:
                done.set()

    def start(self, task: Callable[[], None]) -> threading.Event:
        """Queue `task`; the returned event is set once it has run."""
        done = threading.Event()
        self._tasks.put((task, done))
        return done


class RowsAhead:
    """A step's first round of rows started on this engine host while the trainer trains (--max-off-policy-steps):
    `worker`'s thread makes this host's share of prompts 0 .. count - 1 (no collective: vLLM's engine core runs in
    processes of its own, the trainer's collectives stay on the main thread); `make_rows(..., ahead=)` meets it."""

    def __init__(self, make: Callable[[range], Any] | None, layout: FleetLayout, count: int,
                 worker: BackgroundWorker):
        self.layout, self.made = layout, {}
        self.outcome: tuple[Any, tuple | None] = (None, None)
        shares = [share for share in [layout.share(range(count), layout.rank)] if share] \
            if layout.engine_here is not None else []
        self._done = worker.start(functools.partial(self._make, make, shares))

    def _make(self, make, shares: list[range]) -> None:
        self.outcome = outcome_here(lambda: _make_share(make, shares, self.layout.rank, self.made), self.layout)

    def result(self) -> tuple[tuple[Any, tuple | None], dict]:
        """This host's outcome (`fleet_layout.outcome_here`) and rows, once made."""
        self._done.wait()
        return self.outcome, self.made


def make_rows(make: Callable[[range], Any] | None, layout: FleetLayout, count: int, min_engines: int,
              ahead: RowsAhead | None = None) -> MadeRows:
    """Every serving engine makes the rows of its share of prompts 0 .. count - 1 (`make(prompts)` on its host: a
    RolloutBatch with advantages); the share of an engine retired meanwhile goes to the others, until every prompt
    is made or fewer than `min_engines` serve (EngineRetiredError on every rank). `ahead`: the first shares, started
    earlier (`RowsAhead`) on its layout, which `layout` may have lost engines of since: their shares go to the
    others whatever those engines returned."""
    pending, records, made, retired = [range(count)], [], {}, []
    while pending:
        split = ahead.layout if ahead is not None else layout
        assigned = {host: [split.share(p, host) for p in pending if split.share(p, host)] for host in split.hosts}
        gone = [host for host in split.hosts if host not in layout.hosts]
        if ahead is not None:
            outcome, made_ahead = ahead.result()
            if layout.rank not in gone:
                made.update(made_ahead)
            ahead = None
        else:
            outcome = outcome_here(lambda: _make_share(make, assigned[layout.rank], layout.rank, made), layout)
        results = shared_outcomes(outcome, layout)
        pending = [p for host, r in zip(layout.hosts, results) if isinstance(r, Retired) for p in assigned[host]] \
            + [p for host in gone for p in assigned[host]]
        records += [record for r in results if not isinstance(r, Retired) for record in r]
        layout, messages = retire(results, layout, min_engines, retired)
        retired += messages
    return MadeRows(sorted(records, key=lambda r: r.first_prompt), layout, made, retired)


def tokens_per_second(records: list[RowsRecord]) -> dict[int, float]:
    """Each engine's response tokens per second of making its rows (all its runs of prompts together)."""
    made: dict[int, list[float]] = {}
    for record in records:
        tokens_seconds = made.setdefault(record.host, [0.0, 0.0])
        tokens_seconds[0] += record.response_tokens
        tokens_seconds[1] += record.seconds
    return {host: tokens / max(seconds, 1e-9) for host, (tokens, seconds) in made.items()}


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """One step's rollouts as a rank holds them: the rows its DP rank trains on (`batch`, advantages included) and
    the batch-wide figures every rank knows."""

    batch: RolloutBatch  # this rank's rows
    rewards: torch.Tensor  # [B] every row's reward, in batch order
    response_tokens: int  # of every response made for the step
    reward_failures: int
    reward_timeouts: int
    truncated: int  # responses made for the step that --max-new-tokens cut
    partial: int  # responses made for the step that more than one version of the weights sampled
    repetitive: int  # responses made for the step that repeat an n-gram back to back
    sampled_rows: int  # responses made for the step
    received_bytes: int  # row bytes this rank was sent by other ranks
    held_bytes: int  # row bytes of the rows it trains on
    batch_bytes: int  # row bytes of the whole batch
    engine_tokens_per_s: dict[int, float]  # each engine's response tokens per second of making its rows
    first_host: int  # the host that made the batch's first rows
    first_rows: RolloutBatch | None = None  # their rows, on that host (None elsewhere)
    sampling: dict[str, float] = dataclasses.field(default_factory=dict)  # dynamic sampling's metrics
    policy_version: int = 0  # the trainer step whose weights the engines held when the step was submitted
    generated_ahead: bool = False  # generated while the trainer trained (--max-off-policy-steps)

    def calibration_sequences(self, count: int) -> list[list[int]]:
        """The first `count` sequences the first host made, as the engine cached them, on every rank (collective):
        what the FP8 KV-cache scales are measured on."""
        first = self.first_rows
        return share(lambda: first.cached_sequences(count), src=self.first_host)


def exchange_rows(rows: MadeRows, data_parallel_rank_of: list[int], data_parallel_rank: int,
                  balanced: bool) -> StepRollouts:
    """Every rank's rows from the engines' hosts, by point-to-point sends (each host sends each rank only rows of
    its DP rank). `data_parallel_rank_of` is every global rank's DP rank, `balanced` whether DP shares balance
    tokens (--max-tokens-per-microbatch) rather than being contiguous."""
    records, me = rows.records, rows.layout.rank
    offsets = [0]
    for record in records:
        offsets.append(offsets[-1] + len(record.lengths))
    shares = data_parallel_rows([n for record in records for n in record.lengths], max(data_parallel_rank_of) + 1,
                                balanced)

    def record_rows(index: int, dp_rank: int) -> list[int]:
        return [row - offsets[index] for row in shares[dp_rank] if offsets[index] <= row < offsets[index + 1]]

    requests, pieces, received = [], [], 0
    for index, record in enumerate(records):  # every pair of ranks meets its messages in this order
        if record.host == me:
            tensors = row_tensors(rows.made[record.first_prompt])
            for rank, dp_rank in enumerate(data_parallel_rank_of):
                wanted = record_rows(index, dp_rank)
                if rank != me and wanted:
                    requests += [dist.isend(t[wanted].contiguous(), dst=rank, group=rows.layout.group)
                                 for _, t in tensors]
            mine = record_rows(index, data_parallel_rank)
            if mine:
                pieces.append({name: t[mine] for name, t in tensors})
            continue
        mine = record_rows(index, data_parallel_rank)
        if mine:
            piece = record.empty(len(mine))
            requests += [dist.irecv(t, src=record.host, group=rows.layout.group) for t in piece.values()]
            received += record.nbytes(len(mine))
            pieces.append(piece)
    for request in requests:
        request.wait()
    batch = RolloutBatch(**{name: torch.cat([piece[name] for piece in pieces]) for name in pieces[0]},
                         group_size=records[0].group_size)
    sampled = rows.made_records
    return StepRollouts(batch, torch.tensor([r for record in records for r in record.rewards]),
                        response_tokens=sum(r.response_tokens for r in sampled),
                        reward_failures=sum(r.reward_failures for r in sampled),
                        reward_timeouts=sum(r.reward_timeouts for r in sampled),
                        truncated=sum(r.truncated for r in sampled), partial=sum(r.partial for r in sampled),
                        repetitive=sum(r.repetitive for r in sampled),
                        sampled_rows=sum(len(r.lengths) for r in sampled),
                        received_bytes=received, held_bytes=records[0].nbytes(len(shares[data_parallel_rank])),
                        batch_bytes=sum(r.nbytes(len(r.lengths)) for r in records),
                        engine_tokens_per_s=tokens_per_second(sampled),
                        first_host=records[0].host, first_rows=rows.made.get(0) if records[0].host == me else None)
