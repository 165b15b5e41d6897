"""Prometheus metrics of a run and of the job service, through Ray's metrics API.

Owns every ``raytrain_*`` series (``ray.util.metrics``: each process's values go to its node's
metrics agent, which Prometheus scrapes through the service-discovery file Ray writes; see
``monitoring/``). Ray prefixes application metrics with its namespace, so Prometheus shows
``raytrain_loss`` as ``ray_raytrain_loss``. Emitted from where the numbers already are: the
step ledger's commit (``Steps.commit``), the checkpoint commit, the Supervisor's failures and
recoveries, and the reconciler's pass. Nothing here decides anything or is read back.

Labels are bounded: ``job`` (the spec's name), ``team`` (the service team, ``-`` outside the
service), and for per-rank series ``rank`` and ``node`` (the node's IP); failures add ``kind``
(a handful of values), and the service's waiting jobs ``cause`` (a ``WaitCause`` value, never the
sentence). No actor ids, so series survive restarts and a 512-rank job stays 512
series a metric. Ray adds its own labels (``WorkerId`` of the driver among them): the
dashboard's queries aggregate them away.

Cheap by construction: a commit only keeps a reference to the step's values and counts it;
the Ray calls (a few microseconds each) run at most every ``FLUSH_S`` seconds, with the newest
values and the counts since the last flush, and those of the per-rank series (one a rank and
part) at most every ``RANK_FLUSH_S``. Ray's agent exports every
``RAY_metrics_report_interval_ms`` (10 s by default), so finer updates would not be seen. A
metrics error is logged once and the metrics go quiet: they must never stop a run.

Every label value goes through ``label_value``: Ray's exporter encodes tag values as ASCII and
raises on anything else, so one team or job name outside ASCII would otherwise turn a run's (or
the service's) metrics off. The service's names follow ``service.bounds.NAME_RULE`` already; this
is the net under it (a team made before the rule, a spec's name). And the service's gauges are
set team by team: one team's failure is logged and skips that team, never the others.
"""

from __future__ import annotations

import logging
import math
import re
import time

log = logging.getLogger(__name__)

FLUSH_S = 1.0  # a tenth of Ray's default report interval: every export sees fresh values
# Per-rank series at Ray's default report interval: a 512-rank job's 2,000 of them take about
# 15 ms to set, which once a second would be 1.5% of the driver's time.
RANK_FLUSH_S = 10.0

LABEL_MAX_CHARS = 128  # a label is a name to group by, not a message
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

RUN_TAGS = ("job", "team")
RANK_TAGS = ("job", "team", "rank", "node")

# Step values (the keys ``Steps.commit`` sends MLflow) -> gauge name and help.
STEP_GAUGES = {
    "step_time_s": ("raytrain_step_seconds", "Wall time of the newest committed step"),
    "tokens_per_s": ("raytrain_tokens_per_second", "Trained tokens per second of the newest step"),
    "samples_per_s": ("raytrain_samples_per_second", "Rows (samples) per second of the newest step"),
    "loss": ("raytrain_loss", "Training loss of the newest committed step"),
    "lr": ("raytrain_learning_rate", "Learning rate of the newest committed step"),
    "grad_norm": ("raytrain_grad_norm", "Global gradient norm before clipping, newest step"),
    "data_wait_s": ("raytrain_data_wait_seconds", "Driver time waiting on reads for the newest step"),
    "world_size": ("raytrain_world_size", "Members of the process group"),
    "mfu": ("raytrain_mfu_ratio", "Model FLOPs utilization (resources.peak_tflops_per_worker set)"),
    "committed_step": ("raytrain_committed_step", "The ledger's committed step (goes back on a restore)"),
}

# Per-rank parts of a step (keys of the worker's result, when present) -> gauge name and help.
RANK_GAUGES = {
    "data_wait_s": ("raytrain_rank_data_wait_seconds", "Rank's time assembling its rows, one step"),
    "compute_s": ("raytrain_rank_compute_seconds", "Rank's forward and backward compute, one step"),
    "collective_s": ("raytrain_rank_collective_seconds", "Rank's exposed wait on gradient collectives"),
    "optimizer_s": ("raytrain_rank_optimizer_seconds", "Rank's clip and optimizer step"),
}

COST_GAUGES = {
    "usd": ("raytrain_cost_usd", "Dollars paid for the workers held so far (resources.cost_per_worker_hour)"),
    "worker_hours": ("raytrain_worker_hours", "Worker-hours held so far"),
    "usd_per_million_tokens": ("raytrain_cost_usd_per_million_tokens", "Dollars per million trained tokens"),
    "goodput_usd_per_million_tokens": ("raytrain_goodput_cost_usd_per_million_tokens",
                                       "Dollars per million tokens of committed steps only"),
}

_metrics: dict[str, object] = {}  # name -> metric: one object a process (a service runs many runs)


def label_value(text: object) -> str:
    """``text`` as a label value Ray exports: printable ASCII kept, any other character as its
    backslash escape (so distinct names stay distinct), at most ``LABEL_MAX_CHARS``."""
    ascii_text = str(text).encode("ascii", "backslashreplace").decode("ascii")
    return _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", ascii_text)[:LABEL_MAX_CHARS]


def _metric(kind: str, name: str, help: str, tags: tuple[str, ...], **kw):
    found = _metrics.get(name)
    if found is None:
        from ray.util import metrics

        found = _metrics[name] = getattr(metrics, kind)(name, help, tag_keys=tags, **kw)
    return found


class _Emitter:
    """Runs Ray calls; the first error turns it off (logged once)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def _safely(self, fn, *args) -> None:
        if not self.enabled:
            return
        try:
            fn(*args)
        except Exception as exc:  # metrics must never stop a run
            self.enabled = False
            log.warning("metrics disabled after an error: %s", exc)


class RunMetrics(_Emitter):
    """One run's series. ``enabled``: ``tracking.metrics``."""

    def __init__(self, job: str, team: str = "-", enabled: bool = True, clock=time.monotonic):
        super().__init__(enabled)
        self.tags = {"job": label_value(job), "team": label_value(team or "-")}
        self._clock = clock
        self._next_flush = 0.0
        self._next_rank_flush = 0.0
        self._values: dict[str, float] | None = None  # the newest step's
        self._commits = 0  # since the last flush
        self._ranks: tuple[list[list[dict]], list] | None = None  # the newest lease's results, members
        self._data = None  # (DataPlane, data cursor) of the newest step
        self._rows_sent = 0  # of the data plane's rows_read, counted so far
        self.spent_s = 0.0  # the step loop's time in committed() and ranks(), for the benchmarks

    # ------------------------------------------------------------------ per step (cheap)
    def committed(self, values: dict[str, float], data=None, data_cursor: int = 0) -> None:
        """A step was committed: ``values`` keyed as ``STEP_GAUGES``; ``data``: the DataPlane."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self._values = values
        self._commits += 1
        self._data = (data, data_cursor) if data is not None else None
        now = self._clock()
        if now >= self._next_flush:
            self._next_flush = now + FLUSH_S
            self._safely(self._flush, now >= self._next_rank_flush)
        self.spent_s += time.perf_counter() - t0

    def ranks(self, results: list[list[dict]], members: list) -> None:
        """A lease was committed: per member (rank order) its results, one a step; the last
        step's are sent at the next flush, labelled with the member's node."""
        if self.enabled:
            self._ranks = (results, members)

    def flush(self) -> None:
        """Send everything pending now (the end of a run)."""
        self._safely(self._flush, True)

    def _flush(self, with_ranks: bool) -> None:
        if self._commits:
            _metric("Counter", "raytrain_committed_steps_total", "Steps committed (redone ones again)",
                    RUN_TAGS).inc(self._commits, tags=self.tags)
            self._commits = 0
        for key, value in (self._values or {}).items():
            if key in STEP_GAUGES and not math.isnan(value):
                _metric("Gauge", *STEP_GAUGES[key], RUN_TAGS).set(value, tags=self.tags)
        if with_ranks and self._ranks is not None:
            self._next_rank_flush = self._clock() + RANK_FLUSH_S
            results, members = self._ranks
            for rank, (lease, member) in enumerate(zip(results, members)):
                tags = {**self.tags, "rank": str(rank), "node": label_value(member.info.get("ip") or member.node_id)}
                for key, (name, help) in RANK_GAUGES.items():
                    if key in lease[-1]:
                        _metric("Gauge", name, help, RANK_TAGS).set(lease[-1][key], tags=tags)
            self._ranks = None
        if self._data is not None:
            plane, cursor = self._data
            if plane.rows_read > self._rows_sent:
                _metric("Counter", "raytrain_data_rows_read_total", "Rows the data plane's read tasks delivered",
                        RUN_TAGS).inc(plane.rows_read - self._rows_sent, tags=self.tags)
                self._rows_sent = plane.rows_read
            # The depth the lease sizing sees: reads taken and those finished after them.
            _metric("Gauge", "raytrain_data_prefetch_rows", "Rows read and ready beyond the data cursor",
                    RUN_TAGS).set(plane.rows_ahead(cursor, finished_reads=True), tags=self.tags)
            _metric("Gauge", "raytrain_data_reads_in_flight", "Read tasks submitted and not yet taken",
                    RUN_TAGS).set(plane.reads_in_flight, tags=self.tags)

    # ------------------------------------------------------------------ events (rare: sent at once)
    def failure(self, kind: str) -> None:
        """A membership failure survived; ``kind``: worker_lost or worker_error."""
        self._safely(lambda: _metric("Counter", "raytrain_failures_total", "Membership failures, by kind",
                                     RUN_TAGS + ("kind",)).inc(1, tags={**self.tags, "kind": kind}))

    def redone(self, steps: int) -> None:
        """``steps`` committed steps are to be trained again (a checkpoint restored, or a resume
        after a lost driver): summary.json's ``steps_redone`` as a counter."""
        self._safely(lambda: _metric("Counter", "raytrain_steps_redone_total",
                                     "Committed steps trained again after a restore", RUN_TAGS).inc(steps, tags=self.tags))

    def recovered(self, seconds: float) -> None:
        """A rebuild ended (back to running) after ``seconds``."""
        self._timed("recovery", "recoveries", "From a failure's rebuild to running again", seconds)

    def checkpoint(self, seconds: float, size_bytes: int) -> None:
        """A checkpoint was committed: its save took ``seconds`` and holds ``size_bytes``."""
        self._timed("checkpoint_save", "checkpoints", "Checkpoint save, members' writes to the manifest", seconds)
        self._safely(lambda: _metric("Gauge", "raytrain_checkpoint_bytes", "Size of the newest checkpoint",
                                     RUN_TAGS).set(size_bytes, tags=self.tags))

    def _timed(self, what: str, events: str, help: str, seconds: float) -> None:
        """The newest duration (a gauge), and a count and a total, whose ratio is the mean. Not a
        Ray Histogram: Ray exports a histogram's sum from its buckets' midpoints, not the values."""
        def send():
            _metric("Gauge", f"raytrain_{what}_seconds", f"{help}: the newest", RUN_TAGS).set(seconds, tags=self.tags)
            _metric("Counter", f"raytrain_{what}_seconds_total", f"{help}: all of them", RUN_TAGS).inc(
                seconds, tags=self.tags)
            _metric("Counter", f"raytrain_{events}_total", f"{help}: how many", RUN_TAGS).inc(1, tags=self.tags)
        self._safely(send)

    def cost(self, cost: dict[str, float]) -> None:
        """summary.json's ``cost`` (empty when no price is configured)."""
        def send():
            for key, value in cost.items():
                if key in COST_GAUGES:
                    _metric("Gauge", *COST_GAUGES[key], RUN_TAGS).set(value, tags=self.tags)
        self._safely(send)


class ServiceMetrics(_Emitter):
    """The job service's queue and quota per team, from each reconciler pass's snapshot, and its
    jobs not running yet per team and cause."""

    def __init__(self, enabled: bool = True):
        super().__init__(enabled)
        self._waiting: set[tuple[str, str]] = set()  # (team, cause) series set above 0 last time
        self._failed_teams: set[str] = set()  # logged once each

    def observe(self, snapshot) -> None:
        self._safely(self._observe, snapshot)

    def waiting(self, jobs) -> None:
        """``raytrain_service_waiting_jobs{team, cause}`` from the jobs' stored wait reasons;
        a series that had jobs and has none now is set to 0 (a gauge keeps its last value)."""
        self._safely(self._waiting_jobs, jobs)

    def _waiting_jobs(self, jobs) -> None:
        counts = wait_counts(jobs)
        for team, cause in self._waiting | set(counts):
            _metric("Gauge", *WAITING_GAUGE, ("team", "cause")).set(counts.get((team, cause), 0),
                                                                     tags={"team": team, "cause": cause})
        self._waiting = set(counts)

    def _observe(self, snapshot) -> None:
        gauges = {key: _metric("Gauge", name, help, ("team",)) for key, (name, help) in SERVICE_GAUGES.items()}
        for team, row in team_usage(snapshot).items():
            try:
                for key, gauge in gauges.items():
                    gauge.set(row[key], tags={"team": label_value(team)})
            except Exception as exc:  # one team's series must not stop the others' (nor turn them off)
                if team not in self._failed_teams:
                    self._failed_teams.add(team)
                    log.warning("metrics of team %s skipped after an error: %s", label_value(team), exc)


SERVICE_GAUGES = {
    "queued": ("raytrain_service_queued_jobs", "Jobs waiting for workers (queued or paused, not held)"),
    "used": ("raytrain_service_quota_used_workers", "Workers the team's admitted jobs hold or are given"),
    "borrowed": ("raytrain_service_quota_borrowed_workers", "Workers used beyond the team's nominal quota"),
    "nominal": ("raytrain_service_quota_nominal_workers", "The team's nominal quota"),
}


WAITING_GAUGE = ("raytrain_service_waiting_jobs",
                 "Jobs not running yet (queued, paused, starting, resuming), by team and the cause they wait on")


def wait_counts(jobs) -> dict[tuple[str, str], int]:
    """(team, cause) -> how many of ``jobs`` (``JobRecord``s) not running yet wait on that cause
    (those with no reason written yet are left out)."""
    counts: dict[tuple[str, str], int] = {}
    for job in jobs:
        if job.state.pending and job.wait_cause is not None:
            key = (job.team, job.wait_cause.value)
            counts[key] = counts.get(key, 0) + 1
    return counts


def team_usage(snapshot) -> dict[str, dict[str, int]]:
    """Per team of the snapshot: jobs waiting, workers used (the scheduler's count: admitted
    jobs' targets), borrowed beyond nominal, and the nominal quota."""
    rows = {t.name: {"queued": 0, "used": 0, "borrowed": 0, "nominal": t.nominal_workers}
            for t in snapshot.teams}
    for job in snapshot.jobs:
        row = rows.get(job.team)
        if row is None:
            continue
        if job.state.admitted:
            row["used"] += job.target_workers
        elif job.state.waiting and not job.held:
            row["queued"] += 1
    for row in rows.values():
        row["borrowed"] = max(0, row["used"] - row["nominal"])
    return rows
