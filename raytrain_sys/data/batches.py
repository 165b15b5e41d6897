"""What the driver hands a rank instead of rows: object references and row ranges.

Read tasks (``raytrain_sys.data.plane``) put their rows in Ray's object store as *pieces*: each
piece holds the rows of delivered-stream positions ``[first, stop)``, columns as numpy arrays.
The driver keeps only the references and the small per-row metadata (sample ids, loss units),
so a step's global batch is a list of ``(piece, row range)``; ``GlobalBatch.share`` deals a
rank its slice of it the same way, and the rank fetches the pieces itself (``RankShare.fetch``),
node to node, never through the driver. Which rows make a global batch, and which of them a rank
gets, is decided elsewhere (``data.order`` and ``parallel.mesh.rank_data_slices``); this module
only turns positions into references.

No Ray import at module level: the driver's tests build these without a cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
