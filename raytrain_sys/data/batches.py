"""What the driver hands a rank instead of rows: object references and row ranges.

Read tasks (``raytrain_sys.data.reads``) put their rows in Ray's object store as *pieces*: each
piece holds the rows of delivered-stream positions ``[first, stop)``, columns as numpy arrays.
The driver keeps only the references and the small per-row metadata (sample ids, loss units),
so a step's global batch is a list of ``(piece, row range)``; ``GlobalBatch.share`` deals a
rank its slice of it the same way, and the rank fetches the pieces itself (``RankShare.fetch``),
node to node, never through the driver. A lease of many steps is sent as one ``LeasePlan`` that
every rank shares (each step's start, loss units and pieces, as arrays) and, per rank, its row
range and which of the lease's pieces it is passed (``RankPlan``): the rank deals itself each
step's ``RankShare``, so the driver's work and bytes per rank do not grow with the lease. Which
rows make a global batch, and which of them a rank gets, is decided elsewhere (``data.order``
and ``parallel.mesh.rank_data_slices``); this module only turns positions into references.

No Ray import at module level: the driver's tests build these without a cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class Piece:
    """Rows ``[first, stop)`` of the delivered stream, in the object ``ref`` (a dict of columns)."""

    first: int
    stop: int
    ref: object


@dataclass(frozen=True)
class RankShare:
    """A rank's rows of one step: ``(ref, lo, hi)`` in order, rows ``lo:hi`` of each piece.

    ``width``: trim the ``tokens`` column to this many tokens (bucketed sequences pad a global
    batch to its longest row; 0 = leave as stored)."""

    parts: tuple[tuple[object, int, int], ...]
    width: int = 0

    @property
    def num_rows(self) -> int:
        return sum(hi - lo for _, lo, hi in self.parts)

    def refs(self) -> list:
        return [ref for ref, _, _ in self.parts]

    def ranges(self) -> "RankShare":
        """The same share without its references, to send beside them as the call's own
        arguments: a reference nested in an argument costs Ray a borrower record per call."""
        return RankShare(tuple((None, lo, hi) for _, lo, hi in self.parts), self.width)

    def fetch(self) -> tuple[dict[str, np.ndarray], float]:
        """The rows, fetched from the object store where they lie: (columns, seconds waited)."""
        import ray

        t0 = time.perf_counter()
        blocks = ray.get(self.refs())
        waited = time.perf_counter() - t0
        return self.assemble(blocks), waited

    def assemble(self, blocks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The rows out of the pieces' values (in ``parts`` order). The Supervisor passes the
        references as the step's own arguments, so Ray pulls them to the rank's node while the
        step before still runs, and they arrive here as values.

        Read-only views of the store's buffers where the share lies in one piece; copy before
        writing (``torch.tensor`` copies anyway)."""
        parts = [{k: v[lo:hi] for k, v in block.items()} for block, (_, lo, hi) in zip(blocks, self.parts)]
        if len(parts) == 1:
            columns = parts[0]
        else:
            columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        if self.width and "tokens" in columns:
            columns["tokens"] = np.ascontiguousarray(columns["tokens"][:, :self.width])
        return columns


@dataclass
class GlobalBatch:
    """One step's global batch as references: delivered positions ``[start, start + len(ids))``.

    ``ids``: sample ids in batch order; ``units``: the task's loss units of each row (their sum
    normalizes the loss, see ``raytrain_sys.train.tasks``); ``width``: as in ``RankShare``."""

    start: int
    pieces: list[Piece]
    ids: np.ndarray
    row_units: np.ndarray
    width: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def units(self) -> int:
        return int(self.row_units.sum())

    def share(self, rows: slice) -> RankShare:
        """The rank whose rows are ``rows`` (offsets in the batch): its pieces and ranges."""
        lo, hi = self.start + rows.start, self.start + rows.stop
        parts = tuple((p.ref, max(lo, p.first) - p.first, min(hi, p.stop) - p.first)
                      for p in self.pieces if p.first < hi and p.stop > lo)
        return RankShare(parts, self.width)


@dataclass(frozen=True)
class LeasePlan:
    """A lease's global batches as every rank sees them, with no references. ``steps``: a row a
    step, ``(start, units, width, end)``: the batch starts at delivered position ``start``,
    normalizes by ``units`` loss units, trims to ``width``, and lies in the pieces
    ``entries[previous step's end:end]``; ``entries``: a row each, ``(first, stop, piece)``: a
    piece's rows and its index among the lease's distinct pieces (one piece often holds the rows
    of several steps). Travels as two byte strings (``rank_plans``): one copy, not an object
    per step."""

    steps: np.ndarray  # (count, 4) int64
    entries: np.ndarray  # (pieces of every step, 3) int64

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def of(cls, batches: list[GlobalBatch]) -> tuple["LeasePlan", list]:
        """The plan of these steps' batches, and the lease's distinct piece references (in the
        order of ``piece``)."""
        index: dict[object, int] = {}
        entries = [(p.first, p.stop, index.setdefault(p.ref, len(index))) for b in batches for p in b.pieces]
        ends = np.cumsum([len(b.pieces) for b in batches], dtype=np.int64)
        steps = np.array([(b.start, b.units, b.width, end) for b, end in zip(batches, ends.tolist())],
                         dtype=np.int64).reshape(-1, 4)
        return cls(steps, np.array(entries, dtype=np.int64).reshape(-1, 3)), list(index)

    def needs(self, shares: list[slice]) -> np.ndarray:
        """Which distinct pieces each rank's rows lie in over the lease: a (ranks, pieces) bool
        array, computed for all ranks at once (rank r's rows of step s are ``start`` of step s
        plus ``shares[r]``)."""
        los = np.array([sl.start for sl in shares], dtype=np.int64)[:, None]
        his = np.array([sl.stop for sl in shares], dtype=np.int64)[:, None]
        at = np.repeat(self.steps[:, 0], np.diff(self.steps[:, 3], prepend=0))[None, :]  # each entry's step start
        firsts, stops, piece = self.entries.T
        overlap = (firsts[None, :] < at + his) & (stops[None, :] > at + los)  # (ranks, entries)
        need = np.zeros((len(shares), int(piece.max()) + 1 if len(piece) else 0), dtype=bool)
        for e, p in enumerate(piece.tolist()):  # entries, not ranks: a lease's few pieces
            need[:, p] |= overlap[:, e]
        return need


@dataclass(frozen=True)
class RankPlan:
    """One rank's lease: the shared ``plan``, its rows ``lo:hi`` of every step's global batch,
    and ``arg[p]``: the position among the call's piece arguments of the lease's piece ``p``
    (-1: not passed, its rows lie elsewhere). Iterates as the per-step plans a lease is made of:
    ``(RankShare without references, global units, argument positions of its pieces)``, each
    equal to what ``GlobalBatch.share`` deals the rank."""

    plan: LeasePlan
    lo: int
    hi: int
    arg: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[tuple[RankShare, int, tuple[int, ...]]]:
        entries, e0 = self.plan.entries.tolist(), 0
        for start, units, width, e1 in self.plan.steps.tolist():
            lo, hi = start + self.lo, start + self.hi
            parts = [(first, stop, piece) for first, stop, piece in entries[e0:e1] if first < hi and stop > lo]
            e0 = e1
            yield (RankShare(tuple((None, max(lo, f) - f, min(hi, t) - f) for f, t, _ in parts), width), units,
                   tuple(self.arg[p] for _, _, p in parts))


def rank_plans(batches: list[GlobalBatch], shares: list[slice]) -> list[tuple[tuple, list]]:
    """Per rank (``shares``' order): its plan of the lease as it travels, and the piece
    references to pass beside it (each once, in argument order). The plan travels as plain
    values, ``(steps, plan's steps as bytes, its entries as bytes, lo, hi, arg)``, the bytes the
    same for every rank: Ray packs such a call's arguments without pickling any object of ours
    (``lease_plans`` makes the ``RankPlan`` of it on the rank)."""
    plan, refs = LeasePlan.of(batches)
    need = plan.needs(shares)
    args = np.where(need, np.cumsum(need, axis=1) - 1, -1).tolist()  # per rank: piece -> its argument
    steps, entries = plan.steps.tobytes(), plan.entries.tobytes()
    return [((len(plan), steps, entries, sl.start, sl.stop, tuple(arg)),
             [refs[p] for p in np.flatnonzero(mine).tolist()]) for sl, arg, mine in zip(shares, args, need)]


def lease_plans(sent: "tuple | list") -> "RankPlan | list":
    """A lease call's plans as the rank iterates them: the ``RankPlan`` of a plan sent by
    ``rank_plans``, or the list of per-step plans as sent (rows, with data.delivery=driver)."""
    if not isinstance(sent, tuple):
        return sent
    _, steps, entries, lo, hi, arg = sent
    plan = LeasePlan(np.frombuffer(steps, dtype=np.int64).reshape(-1, 4),
                     np.frombuffer(entries, dtype=np.int64).reshape(-1, 3))
    return RankPlan(plan, lo, hi, tuple(arg))


def lease_length(sent: "tuple | list") -> int:
    """The steps of a lease call's plans, as sent."""
    return sent[0] if isinstance(sent, tuple) else len(sent)
