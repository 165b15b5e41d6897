"""Per-rank step times and stragglers: which rank makes the step slow, and what to do about it.

Owns: ``rank_times``, ``rank_times_history`` and ``stragglers`` in summary.json, the per-rank
step metrics sent to MLflow (``rank<r>/<part>``, at most ``policy.RANK_METRICS_PER_S`` a
second), the straggler events (log line, MLflow event and ``raytrain.straggler`` tag) and the
gauge ``raytrain_straggler_flagged`` (labels job, team, rank, node; 1 while a rank is
flagged). Calls no other part of the Supervisor: ``observe_reports`` reads
the per-rank results of committed steps (rank 0's reports, every rank's parts of a step as one
array; the window keeps them as arrays, a rank's record is made only when
``rank_times`` is refreshed), ``decide`` returns what the policy asks
(``Rebalance``, ``Replace`` or None) and the Supervisor carries it out.

Each rank reports where its step went (``TrainWorker.train_step``: data wait, compute,
exposed collective wait, optimizer). A slow rank shows high compute and little collective wait,
its peers the reverse. ``find_stragglers`` (pure) flags a rank whose mean compute over the
window (``elastic.straggler_window_steps``) exceeds the median of its peers' by
``elastic.straggler_margin``, and then tells why: if its compute per loss unit (per token) is
normal, it simply got more work (longer or more rows: a data imbalance, left alone); if that
is high too, the rank is slow (a slow node, acted on by ``elastic.straggler_policy``).

``rebalance`` deals the slow rank fewer rows of the same global batch, in proportion to each
data index's measured speed (rows per compute second): the loss is weighted by units, so the
gradient is the same. The row counts are recorded in the event (``rows``); they hold until the
group is re-formed, when the even split comes back. Sample order and the data cursor are not
touched (a step's global batch is the same slice of the order, dealt differently), so resume
and replay stay exactly-once whatever split was used.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.control.supervisor.policy import rank_metrics_due
from raytrain_sys.control.worker import AGREED
from raytrain_sys.data.order import weighted_rows
from raytrain_sys.parallel.mesh import data_index_of_rank
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)

PARTS = ("data_wait_s", "compute_s", "collective_s", "optimizer_s")  # TrainWorker.train_step's
# A step's record in the window: one row per rank, these columns (an array, not a dict per rank:
# the window is kept for every rank at every step).
COLUMNS = (*PARTS, "rows", "units")
_REPORTED = [AGREED.index(k) for k in COLUMNS[:-1]]  # the columns of a report's ``ranks`` table
HISTORY_MAX = 500  # rank_times_history entries; when full, every other one is dropped
# Steps after a group forms that the straggler window skips: the first step builds DDP's buckets
# (and compiles, with train.compile), the second still pays for it on some ranks.
WARMUP_STEPS = 2
SLOW, IMBALANCE = "slow_rank", "data_imbalance"


@dataclass(frozen=True)
class RankMeans:
    """One rank's means over the straggler window."""

    compute_s: float
    units: float  # loss units (tokens) of its rows per step
    rows: float


@dataclass(frozen=True)
class Flagged:
    rank: int
    kind: str  # SLOW or IMBALANCE
    ratio: float  # its compute over the median of its peers'
    per_unit_ratio: float  # the same per loss unit


def peer_medians(values: np.ndarray) -> np.ndarray:
    """For each element, the median of the others (``statistics.median``'s: the middle one, or
    the mean of the middle two), for all of them in one sort rather than one sort each."""
    n = len(values)
    if n < 2:
        return np.full(n, np.nan)  # no others
    order = np.argsort(values, kind="stable")
    v = values[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)  # each element's place in the sorted values

    def peer(k: int) -> np.ndarray:  # the k-th smallest of the others, per element
        return np.where(k < pos, v[k], v[min(k + 1, n - 1)])

    m = n - 1
    return peer(m // 2) if m % 2 else (peer(m // 2 - 1) + peer(m // 2)) / 2


def find_stragglers(means: list[RankMeans], margin: float) -> list[Flagged]:
    """Ranks whose mean compute exceeds the median of their peers' by ``margin``, each with
    its kind: ``slow_rank`` when its compute per loss unit exceeds its peers' median by the same
    margin, else ``data_imbalance`` (it got more units: longer or more rows). The peers' median,
    not the group's: with two ranks the group's median would include the rank itself."""
    out = []
    if margin <= 0 or len(means) < 2:
        return out
    compute = np.array([m.compute_s for m in means], dtype=np.float64)
    per_unit = compute / np.maximum(np.array([m.units for m in means], dtype=np.float64), 1e-9)
    median, unit_median = peer_medians(compute), peer_medians(per_unit)
    for r in np.flatnonzero((median > 0) & (compute > (1.0 + margin) * median)).tolist():
        per_unit_ratio = float(per_unit[r] / unit_median[r]) if unit_median[r] > 0 else 1.0
        kind = SLOW if per_unit_ratio > 1.0 + margin else IMBALANCE
        out.append(Flagged(r, kind, float(compute[r] / median[r]), per_unit_ratio))
    return out


def rebalanced_rows(means: list[RankMeans], degrees: dict[str, int], global_batch_size: int) -> list[int]:
    """Rows per data index in proportion to measured speed (rows per compute second); a data
    index is as fast as the slowest of its ranks (TP and PP peers share its rows)."""
    speed: dict[int, float] = {}
    for r, m in enumerate(means):
        index = data_index_of_rank(degrees, r)
        s = m.rows / max(m.compute_s, 1e-9)
        speed[index] = min(speed.get(index, s), s)
    return weighted_rows(global_batch_size, [speed[i] for i in sorted(speed)])


@dataclass(frozen=True)
class Rebalance:
    rows: list[int]  # per data index, for the dispatches from now on
    flagged: Flagged


@dataclass(frozen=True)
class Replace:
    rank: int  # to drain at the next step boundary
    flagged: Flagged


class Stragglers:
    def __init__(self, spec: JobSpec, summary: RunSummary, tracker, team: str = "-"):
        self.spec, self.summary, self.tracker, self.team = spec, summary, tracker, team
        e = spec.elastic
        self._window: deque[list[dict]] = deque(maxlen=max(e.straggler_window_steps, spec.train.log_every_steps))
        self._nodes: list[str] = []  # per rank, of the current group
        self._generation = -1
        self._since_formed = 0  # steps observed since the group (re)formed
        self._flagged: dict[int, str] = {}  # rank -> node, while flagged (the gauge is 1)
        self._remeasure = False  # a rebalance cleared the window: the next full one re-judges it
        self._gauge = None
        self._gauge_set: dict[int, tuple[str, float]] = {}  # rank -> (node, value) last set
        self._metrics_sent = float("-inf")  # the per-rank metrics' last send to MLflow (monotonic)

    # ------------------------------------------------------------------ per-step records
    def observe_reports(self, sent, reports: list[dict], generation: int) -> None:
        """A lease about to be committed: ``sent`` the dispatch (members, shares, batches),
        ``reports`` rank 0's reports of its steps (``TrainWorker._agree``: every rank's parts as
        one array a step), with no record per rank. Refreshes ``rank_times`` at every
        train.log_every_steps."""
        self._observe(sent, [r["ranks"][:, _REPORTED] for r in reports], generation)

    def _observe(self, sent, parts: list[np.ndarray], generation: int) -> None:
        if generation != self._generation:
            self._reset(generation)
        self._nodes = [w.info.get("ip") or w.node_id for w in sent.members]
        every = self.spec.train.log_every_steps
        units = lease_units(sent.batches, sent.shares)
        for i in range(len(sent.batches)):
            self._since_formed += 1
            if self._since_formed > WARMUP_STEPS:
                self._window.append(np.column_stack([parts[i], units[i]]))
            step = sent.step + i + 1
            if step % every == 0 and self._window:
                self._refresh(step, list(self._window)[-every:])

    def _reset(self, generation: int) -> None:
        self._generation, self._since_formed, self._remeasure = generation, 0, False
        self._window.clear()
        for rank, node in self._flagged.items():
            self._set_gauge(rank, node, 0.0)
        self._flagged = {}

    def _refresh(self, step: int, steps: list[np.ndarray]) -> None:
        mean = _mean(steps)
        ranks = {}
        for r, row in enumerate(mean[:, :len(PARTS)].tolist()):
            parts = dict(zip(PARTS, row))
            ranks[str(r)] = {"node": self._nodes[r] if r < len(self._nodes) else "", **parts,
                             "step_s": sum(parts.values())}
        self.summary.rank_times = ranks
        for r, t in ranks.items():  # 0 for every rank not flagged: a straggler panel shows them all
            self._set_gauge(int(r), t["node"], 1.0 if int(r) in self._flagged else 0.0, if_changed=True)
        history = self.summary.rank_times_history
        if len(history) >= HISTORY_MAX:
            del history[1::2]
        history.append({"step": step, "ranks": ranks})
        now = time.monotonic()
        if self.tracker is not None and rank_metrics_due(now, self._metrics_sent, len(ranks) * (len(PARTS) + 1)):
            self._metrics_sent = now
            self.tracker.log_metrics(step, {f"rank{r}/{k}": v for r, t in ranks.items()
                                            for k, v in t.items() if k != "node"})

    # ------------------------------------------------------------------ the decision
    def decide(self, step: int) -> Rebalance | Replace | None:
        """After the commit of ``step``: flag stragglers over a full window (records, gauge, log,
        MLflow) and return what ``elastic.straggler_policy`` asks for a slow rank."""
        e = self.spec.elastic
        if len(self._window) < e.straggler_window_steps or e.straggler_margin <= 0:
            return None
        window = list(self._window)[-e.straggler_window_steps:]
        world = len(window[0])
        mean = _mean(window)[:, [COLUMNS.index(k) for k in ("compute_s", "units", "rows")]]
        means = [RankMeans(*row) for row in mean.tolist()]
        found = find_stragglers(means, e.straggler_margin)
        for rank in [r for r in self._flagged if r not in {f.rank for f in found}]:
            self._set_gauge(rank, self._flagged.pop(rank), 0.0)
        action = None
        # The first full window under a new split: a rank still too slow is rebalanced again.
        remeasured, self._remeasure = self._remeasure, False
        for f in found:
            if f.rank in self._flagged and not (remeasured and f.kind == SLOW):
                continue  # flagged already: one event per episode
            node = self._nodes[f.rank] if f.rank < len(self._nodes) else ""
            what, rows = "none", None
            if f.kind == SLOW and action is None and e.straggler_policy == "rebalance":
                rows = rebalanced_rows(means, self.spec.parallel.degrees(world), self.spec.train.global_batch_size)
                action, what = Rebalance(rows, f), "rebalance"
            elif f.kind == SLOW and action is None and e.straggler_policy == "replace":
                action, what = Replace(f.rank, f), "replace"
            self._record(step, f, node, what, rows)
        if isinstance(action, Rebalance):
            # The new split is measured afresh: the rank stays flagged until a full window shows
            # it keeping up (then its gauge falls to 0), or is rebalanced again.
            self._window.clear()
            self._remeasure = True
        return action

    def _record(self, step: int, f: Flagged, node: str, action: str, rows: list[int] | None) -> None:
        self._flagged[f.rank] = node
        self._set_gauge(f.rank, node, 1.0)
        event = {"step": step, "rank": f.rank, "node": node, "kind": f.kind, "ratio": round(f.ratio, 3),
                 "action": action}
        if rows is not None:
            event["rows"] = rows  # the split of the global batch per data index from here on
        self.summary.stragglers.append(event)
        e = self.spec.elastic
        why = ("compute per token normal: it got more tokens" if f.kind == IMBALANCE
               else f"compute per token {f.per_unit_ratio:.2f}x its peers'")
        text = (f"straggler: rank {f.rank} on {node} computes {f.ratio:.2f}x its peers' median over "
                f"{e.straggler_window_steps} steps ({f.kind}: {why}); action: {action}"
                + (f", rows per data index {rows}" if rows else ""))
        log.warning("%s (step %d)", text, step)
        if self.tracker is not None:
            try:
                self.tracker.log_event(step, "running", text)
                self.tracker.set_tags({"raytrain.straggler": text})
            except Exception as exc:  # MLflow trouble never stops training
                log.warning("could not record the straggler in MLflow: %s", exc)

    def _set_gauge(self, rank: int, node: str, value: float, if_changed: bool = False) -> None:
        """``if_changed``: only when the rank's series or value is not what was set last (a Ray
        gauge keeps its last value; setting every rank's at each refresh was the largest part of
        the driver's per-step CPU in Python at 256 ranks: docs/SCALING.md)."""
        if not self.spec.tracking.metrics:  # every series off (tracking.metrics)
            return
        if if_changed and self._gauge_set.get(rank) == (node, value):
            return
        self._gauge_set[rank] = (node, value)
        try:
            if self._gauge is None:
                from ray.util.metrics import Gauge

                self._gauge = Gauge("raytrain_straggler_flagged",
                                    description="1 while the rank is flagged as a straggler",
                                    tag_keys=("job", "team", "rank", "node"))
            self._gauge.set(value, tags={"job": self.spec.name, "team": self.team, "rank": str(rank),
                                         "node": node})
        except Exception as exc:  # metrics are a view; never a reason to stop
            log.debug("could not set raytrain_straggler_flagged: %s", exc)


def lease_units(batches, shares: list[slice]) -> np.ndarray:
    """Each rank's loss units of each step of a lease, a (steps, ranks) float array: one running
    sum over the lease's batches' row units (not a sum per rank, nor one per step)."""
    upto = np.zeros((len(batches), len(batches[0].row_units) + 1), dtype=np.int64)
    np.cumsum(np.stack([b.row_units for b in batches]), axis=1, dtype=np.int64, out=upto[:, 1:])
    starts = np.array([sl.start for sl in shares])
    stops = np.array([sl.stop for sl in shares])
    return (upto[:, stops] - upto[:, starts]).astype(np.float64)


def _mean(steps: list[np.ndarray]) -> np.ndarray:
    """The steps' records averaged, each element summed in step order (as a running sum would)."""
    total = steps[0].copy()
    for s in steps[1:]:
        total += s
    return total / len(steps)


__all__ = ["peer_medians", "Stragglers", "find_stragglers", "rebalanced_rows", "Rebalance", "Replace", "RankMeans",
           "Flagged", "SLOW", "IMBALANCE"]
