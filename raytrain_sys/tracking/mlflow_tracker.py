"""The MLflow record of a run, written only from the driver.

One ``Tracker`` per job run. It holds an ``MlflowClient`` of its own (never the fluent API's
global state), so several trackers and threads can coexist in one process.

What a run holds, and where ``lookup()`` (hence ``raytrain-sys resume``) reads it back from:

- params: every ``spec.flat()`` field, as text (long values truncated with a marker);
- tags: git commit, spec and training hashes, run dir, checkpoint root, latest checkpoint,
  supervisor state, resume count and per-resume overrides (names below);
- metrics: the training loop's step metrics and ``checkpoint_step`` at each committed checkpoint;
- artifacts: ``spec.json`` (the latest spec, exact, read back by ``lookup``),
  ``spec.original.json`` (as first started), ``checkpoints.json``, ``events.json`` and
  ``plots/*.png`` (``monitor/plots.py``, redrawn at the first checkpoint, then at most every
  ``PLOTS_EVERY_S``, and at the end).

Writes made while training runs (metrics, tags, events, checkpoint records, plots), and the
params of a run just started, go through one background thread, in order: a slow or unreachable
MLflow never stalls the training loop. A write that still fails after a few retries is dropped
with a warning and counted (``Tracker.dropped_batches``); ``flush()`` and ``finish()`` wait for
the queue to drain.
``begin`` makes a new run as the writer's first write (the run and its spec; its params the
next writes): it returns at once, the writes made before the run exists wait behind its opening,
and a failed opening is kept for ``check_open``/``opened`` to raise (the Supervisor trains
while a new run opens). ``start`` is ``begin`` waited for; it, ``resume`` and ``lookup`` are
synchronous and raise ``TrackingError``. The store itself (checked, made once, one client per
store and process, warmed ahead of a run) is ``mlflow_store``'s; the writer thread is
``mlflow_writer``'s.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from raytrain_sys.version import __version__
from raytrain_sys.errors import TrackingError
from raytrain_sys.spec import JobSpec
from raytrain_sys.tracking import mlflow_store as ms
from raytrain_sys.tracking.mlflow_writer import Write, Writer

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- names

TAG_GIT_COMMIT = "raytrain.git_commit"
TAG_RUN_DIR = "raytrain.run_dir"
TAG_CHECKPOINT_ROOT = "raytrain.checkpoint_root"
TAG_SPEC_HASH = "raytrain.spec_hash"
TAG_TRAINING_HASH = "raytrain.training_hash"
TAG_VERSION = "raytrain.version"
TAG_LATEST_CHECKPOINT = "raytrain.latest_checkpoint"
TAG_STATE = "raytrain.state"
TAG_STATE_REASON = "raytrain.state_reason"
TAG_RESUME_COUNT = "raytrain.resume_count"


def resume_override_tag(resume_index: int, key: str) -> str:
    """Tag recording that resume number ``resume_index`` changed the param ``key``."""
    return f"raytrain.resume.{resume_index}.override.{key}"


SPEC_ARTIFACT = "spec.json"  # the latest spec; rewritten on resume
ORIGINAL_SPEC_ARTIFACT = "spec.original.json"  # the spec the run was started with
CHECKPOINTS_ARTIFACT = "checkpoints.json"
EVENTS_ARTIFACT = "events.json"
PLOTS_ARTIFACT_DIR = "plots"  # monitor/plots.py's PNGs
STACKS_ARTIFACT_DIR = "hangs"  # a hung (or replaced straggler) worker's stacks: Tracker.log_stack
# While a run trains, its plots are redrawn at its first checkpoint, then at a checkpoint at most
# this often; the end of the run always redraws them (and its last checkpoint leaves it to the end).
# A redraw costs about a CPU-second: a short run checkpointing every few steps paid one a checkpoint
# on the cores its workers train on, and its end waited for the last checkpoint's before its own.
PLOTS_EVERY_S = 30.0
CHECKPOINT_STEP_METRIC = "checkpoint_step"

TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")

TAG_PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: the UI nests a child run under its parent


# ----------------------------------------------------------------------------- helpers

def default_tracking_uri(output_dir: str) -> str:
    """The embedded default: a SQLite file in the job's output directory."""
    return f"sqlite:///{os.path.abspath(output_dir)}/mlflow.db"


def spec_tracking_uri(spec: dict) -> str:
    """Where a job spec given as a plain dict (the service's stored spec) tracks: its
    tracking.uri, else the embedded default under its output_dir."""
    uri = (spec.get("tracking") or {}).get("uri") or ""
    return uri or default_tracking_uri(spec.get("output_dir") or "runs")


def _spec_params(spec: JobSpec) -> dict[str, str]:
    return {key: ms.fit(value, ms.MAX_PARAM_VAL_LENGTH) for key, value in spec.flat().items()}


def _spec_json(spec: JobSpec) -> str:
    return json.dumps(spec.plain_dict(), indent=2, sort_keys=True)


def _read_json_artifacts(client, tracking_uri: str, run_id: str, names: list[str]) -> dict[str, Any]:
    """The parsed JSON of those ``names`` that exist at the run's artifact root."""

    def read() -> dict[str, Any]:
        present = {info.path for info in client.list_artifacts(run_id)}
        out: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="raytrain-mlflow-") as tmp:
            for name in names:
                if name in present:
                    local = client.download_artifacts(run_id, name, dst_path=tmp)
                    with open(local, encoding="utf-8") as f:
                        out[name] = json.load(f)
        return out

    return ms.call(tracking_uri, f"read the artifacts of run {run_id}", read)


def _create_run(client, tracking_uri: str, experiment: str, run_name: str, spec: JobSpec,
                tags: dict[str, str], artifact_root: str | None) -> tuple[str, str]:
    """A new run (and its experiment if missing) with its tags and the spec's artifacts: its run
    id and experiment id. A run whose spec cannot be stored is marked FAILED, then raised."""
    experiment_id = ms.ensure_experiment(client, tracking_uri, experiment, artifact_root)
    run_tags = {k: ms.fit(v, ms.MAX_TAG_VAL_LENGTH) for k, v in tags.items()}
    run_tags.update({
        TAG_SPEC_HASH: spec.spec_hash(),
        TAG_TRAINING_HASH: spec.training_hash(),
        TAG_VERSION: __version__,
        TAG_RESUME_COUNT: "0",
    })
    run = ms.call(tracking_uri, f"create a run in experiment {experiment!r}",
                  lambda: client.create_run(experiment_id, run_name=run_name or None, tags=run_tags))
    run_id = run.info.run_id
    try:
        text = _spec_json(spec)
        for name in (ORIGINAL_SPEC_ARTIFACT, SPEC_ARTIFACT):
            ms.call(tracking_uri, f"store {name} of run {run_id}",
                    lambda name=name: client.log_text(run_id, text, name))
    except TrackingError:
        # Leave no half-made run looking alive.
        try:
            client.set_terminated(run_id, "FAILED")
        except Exception:
            pass
        raise
    return run_id, experiment_id


def _chunks(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


# ----------------------------------------------------------------------------- the tracker

@dataclass
class RunRecord:
    """What ``lookup`` reads back from a run: enough to resume it."""

    run_id: str
    status: str
    spec_dict: dict[str, Any]  # the latest spec (after any resume); rebuild with spec.from_dict
    tags: dict[str, str]
    checkpoint_records: list[dict[str, Any]]  # in commit order; each has step, uri, recorded_at_s
    latest_checkpoint_uri: str  # "" when no checkpoint was recorded
    run_dir: str  # "" when the driver did not set raytrain.run_dir
    experiment_id: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)  # step, state, reason, time_s
    original_spec_dict: dict[str, Any] | None = None  # the spec the run was started with


class Tracker:
    """The driver's handle on one MLflow run. Create with ``start`` or ``resume``."""

    finish_timeout_s = 60.0  # how long finish() waits for queued writes before giving up

    def __init__(self, client, tracking_uri: str, run_id: str, experiment_id: str):
        self._client = client
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.experiment_id = experiment_id
        self._events: list[dict[str, Any]] = []
        self._checkpoints: list[dict[str, Any]] = []
        self._records_lock = threading.Lock()  # the lists are appended to and snapshotted whole
        self._finished = False
        self.open_span: tuple[float, float] | None = None  # begin(): the opening's perf_counter times
        self._plots_drawn_at: float | None = None  # the last redraw while training (plots_due)
        self._writer = Writer(client, run_id, tracking_uri)

    # --- opening a run
    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        spec: JobSpec,
        tags: dict[str, str],
        artifact_root: str | None = None,
    ) -> Tracker:
        """Create a run (and its experiment if missing) holding the spec as params and artifact,
        and return once it exists (``begin``, waited for; its params still go through the
        writer). ``artifact_root`` is where a local (sqlite) store keeps artifacts, e.g.
        ``<output_dir>/mlartifacts``; an http server decides that itself.
        """
        tracker = cls.begin(tracking_uri, experiment, run_name, spec, tags, artifact_root)
        tracker.opened()
        return tracker

    @classmethod
    def begin(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        spec: JobSpec,
        tags: dict[str, str],
        artifact_root: str | None = None,
        on_open: Callable[[Tracker], None] | None = None,
    ) -> Tracker:
        """A run (and its experiment if missing) made by the writer as its first write, holding
        the spec as an artifact (stored with the run: what a resume reads) and as params (the
        writer's next writes: on a busy core their batches were most of a start's MLflow
        seconds, 0.2-0.6 s against 0.1 s to create the run). Returns at once, ``run_id`` ""
        until the run exists; what is logged meanwhile waits behind the opening, in order.
        ``on_open(tracker)`` is called in the writer's thread once the run exists (its spec
        stored, before its params), ``open_span`` then holding when the opening began and ended
        (``time.perf_counter``). A failed opening (the store refused, an experiment deleted; an
        unreachable store is the caller's pre-flight check) is kept: ``check_open`` raises it,
        ``opened`` waits for the opening and raises it, and every write is dropped."""
        from mlflow.entities import Param

        tracker = cls(None, tracking_uri, "", "")
        began = time.perf_counter()

        def open_run() -> tuple:
            client = ms.client(tracking_uri)
            run_id, experiment_id = _create_run(client, tracking_uri, experiment, run_name, spec, tags,
                                                artifact_root)
            tracker._client, tracker.run_id, tracker.experiment_id = client, run_id, experiment_id
            tracker.open_span = (began, time.perf_counter())
            if on_open is not None:
                try:
                    on_open(tracker)
                except Exception as exc:  # the caller's bookkeeping: the run stands
                    log.warning("after MLflow run %s opened: %s", run_id, exc)
            return client, run_id

        tracker._writer.submit(Write("open", opener=open_run))
        params = [Param(k, v) for k, v in _spec_params(spec).items()]
        for chunk in _chunks(params, ms.MAX_PARAMS_TAGS_PER_BATCH):
            tracker._writer.submit(Write("params", params=chunk))
        return tracker

    def check_open(self) -> None:
        """Raise the ``TrackingError`` of a failed opening (``begin``); nothing while it opens."""
        error = self._writer.open_error
        if error is None:
            return
        if isinstance(error, TrackingError):
            raise error
        raise TrackingError(f"MLflow at {self.tracking_uri} failed to open the run: {ms.first_line(error)}; "
                            "check tracking.uri / --tracking-uri and that the store is up and writable") from error

    def opened(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the run to exist (``begin``); raise if it failed to open.
        False on timeout."""
        done = self._writer.opened.wait(timeout_s)
        self.check_open()
        return done

    @classmethod
    def resume(cls, tracking_uri: str, run_id: str, spec: JobSpec) -> Tracker:
        """Reopen the same run for a resumed job (status RUNNING again, no new run).

        New spec fields become params; fields whose value changed (e.g. a raised
        train.max_steps) cannot be re-logged as params (MLflow refuses), so they are recorded as
        tags ``raytrain.resume.<n>.override.<key>``. ``spec.json`` becomes the resumed spec.
        """
        from mlflow.entities import Param, RunTag

        client = ms.client(tracking_uri)
        run = ms.get_run(client, tracking_uri, run_id)
        resume_index = int(run.data.tags.get(TAG_RESUME_COUNT, "0") or 0) + 1
        logged = run.data.params
        new_params: list[Param] = []
        tags = {
            TAG_RESUME_COUNT: str(resume_index),
            TAG_SPEC_HASH: spec.spec_hash(),
            TAG_TRAINING_HASH: spec.training_hash(),
            TAG_VERSION: __version__,
        }
        for key, value in _spec_params(spec).items():
            if key not in logged:
                new_params.append(Param(key, value))
            elif logged[key] != value:
                tags[resume_override_tag(resume_index, key)] = ms.fit(value, ms.MAX_TAG_VAL_LENGTH)

        artifacts = _read_json_artifacts(client, tracking_uri, run_id,
                                         [CHECKPOINTS_ARTIFACT, EVENTS_ARTIFACT])
        ms.call(tracking_uri, f"reopen run {run_id}",
                lambda: client.update_run(run_id, status="RUNNING"))
        entities: list[Any] = new_params + [RunTag(k, v) for k, v in tags.items()]
        for chunk in _chunks(entities, ms.MAX_PARAMS_TAGS_PER_BATCH):
            ms.call(tracking_uri, f"log the resumed params of run {run_id}",
                    lambda chunk=chunk: client.log_batch(
                      run_id,
                      params=[e for e in chunk if isinstance(e, Param)],
                      tags=[e for e in chunk if isinstance(e, RunTag)],
                      synchronous=True,
                  ))
        ms.call(tracking_uri, f"store {SPEC_ARTIFACT} of run {run_id}",
                lambda: client.log_text(run_id, _spec_json(spec), SPEC_ARTIFACT))
        tracker = cls(client, tracking_uri, run_id, run.info.experiment_id)
        # Records are rewritten whole, so carry the earlier ones forward.
        tracker._checkpoints = list(artifacts.get(CHECKPOINTS_ARTIFACT, []))
        tracker._events = list(artifacts.get(EVENTS_ARTIFACT, []))
        return tracker

    def newest_step(self, key: str = "loss") -> int:
        """The newest step of metric ``key`` this run has (0: none): a Supervisor that adopts a
        lost driver's ranks logs only the steps after it (that driver logged the ones before)."""
        history = ms.call(self.tracking_uri, f"read the {key} history of run {self.run_id}",
                          lambda: self._client.get_metric_history(self.run_id, key))
        return max((int(m.step) for m in history), default=0)

    # --- writes while training (queued; never raise for MLflow trouble)
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)  # when measured, not when the writer sends it
        batch = [Metric(k, float(v), timestamp_ms, int(step)) for k, v in metrics.items()]
        for chunk in _chunks(batch, ms.MAX_METRICS_PER_BATCH):
            self._writer.submit(Write("batch", metrics=chunk))

    def set_tags(self, tags: dict[str, str]) -> None:
        items = [(k, ms.fit(v, ms.MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(items, ms.MAX_PARAMS_TAGS_PER_BATCH):
            self._writer.submit(Write("batch", tags=dict(chunk)))

    def log_event(self, step: int, state: str, reason: str) -> None:
        """A supervisor state transition: tag ``raytrain.state`` and the list in events.json."""
        with self._records_lock:  # held while queueing so snapshots are queued in order
            self._events.append(
                {"step": int(step), "state": state, "reason": reason, "time_s": time.time()}
            )
            self._writer.submit(Write("batch", tags={
                TAG_STATE: ms.fit(state, ms.MAX_TAG_VAL_LENGTH),
                TAG_STATE_REASON: ms.fit(reason, ms.MAX_TAG_VAL_LENGTH),
            }))
            text = json.dumps(self._events, indent=1, default=str)
            self._writer.submit(Write("text", artifact=EVENTS_ARTIFACT, text=text))

    def record_checkpoint(self, step: int, uri: str, meta: dict) -> None:
        """A committed checkpoint: metric checkpoint_step, tag latest_checkpoint, checkpoints.json."""
        from mlflow.entities import Metric

        now = time.time()
        with self._records_lock:  # held while queueing so snapshots are queued in order
            self._checkpoints.append({**meta, "step": int(step), "uri": uri, "recorded_at_s": now})
            self._writer.submit(Write(
                "batch",
                metrics=[Metric(CHECKPOINT_STEP_METRIC, float(step), int(now * 1000), int(step))],
                tags={TAG_LATEST_CHECKPOINT: ms.fit(uri, ms.MAX_TAG_VAL_LENGTH)},
            ))
            text = json.dumps(self._checkpoints, indent=1, default=str)
            self._writer.submit(Write("text", artifact=CHECKPOINTS_ARTIFACT, text=text))

    def log_stack(self, record: dict, kind: str = "hung") -> None:
        """A worker found hung (``kind`` "hung") or a straggler replaced ("straggler"): why, and
        every thread's Python stack (``liveness.hang_record``), as the text artifact
        ``hangs/step-<n>-worker-<slot>.txt`` (``hangs/step-<n>-straggler-<slot>.txt``)."""
        who = "worker" if kind == "hung" else kind
        name = f"{STACKS_ARTIFACT_DIR}/step-{record['step']}-{who}-{record['slot']}.txt"
        text = (f"{kind} worker {record['slot']} (rank {record['rank']}, pid {record.get('pid')}, node "
                f"{record.get('node', '')}) at step {record['step']}\n{record['reason']}\n\n{record['stack']}\n")
        self._writer.submit(Write("text", artifact=name, text=text))

    def plots_due(self, now: float | None = None) -> bool:
        """Whether a checkpoint should redraw the plots while the run trains: none yet, or
        ``PLOTS_EVERY_S`` since the last. The end always redraws."""
        if self._plots_drawn_at is None:
            return True
        return (time.monotonic() if now is None else now) - self._plots_drawn_at >= PLOTS_EVERY_S

    def log_plots(self, summary: dict, *, at_end: bool = True) -> None:
        """Redraw the run's plots (``plots/*.png``) from ``summary`` (a snapshot: the caller's
        record keeps changing), in a child process the writer's thread waits for; a newer call
        supersedes a pending one. ``at_end=False``: a redraw while the run trains (a checkpoint;
        ask ``plots_due`` first, before taking the snapshot)."""
        if not at_end:
            self._plots_drawn_at = time.monotonic()
        self._writer.submit(Write("plots", artifact=PLOTS_ARTIFACT_DIR, summary=summary))

    @property
    def dropped_batches(self) -> int:
        """Writes given up on after retries (metrics batches, tags, artifact rewrites)."""
        return self._writer.dropped

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write was sent (or dropped); False on timeout."""
        return self._writer.flush(timeout_s)

    # --- closing
    def finish(self, status: str) -> None:
        """Drain queued writes, then mark the run FINISHED, FAILED or KILLED.

        MLflow trouble here is a warning, not an error: the training result stands either way.
        When the server is unreachable at this point, finish returns at once instead of waiting
        for retries that cannot succeed.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status {status!r}: expected one of {', '.join(TERMINAL_STATUSES)}")
        if self._finished:
            return
        self._finished = True
        if self._writer.open_error is not None:  # no run was made; its error was raised (check_open)
            return
        if self._writer.dropped or self._writer.pending():
            try:
                ms.check_reachable(self.tracking_uri, timeout_s=5.0)
            except TrackingError as exc:
                self._writer.abandon()
                log.warning("%s; run %s keeps status RUNNING in MLflow and lost %d writes",
                            exc, self.run_id, self._writer.dropped)
                return
        if not self._writer.close(self.finish_timeout_s):
            log.warning("MLflow run %s: writes still queued after %g s were abandoned",
                        self.run_id, self.finish_timeout_s)
        if self._writer.open_error is not None:  # the opening, still queued, failed meanwhile
            return
        if self._writer.dropped:
            log.warning("MLflow run %s: %d writes were dropped (MLflow unavailable or refused "
                        "them; see the earlier warnings)", self.run_id, self._writer.dropped)
        try:
            ms.call(self.tracking_uri, f"mark run {self.run_id} {status}",
                    lambda: self._client.set_terminated(self.run_id, status))
        except TrackingError as exc:
            log.warning("%s (the run stays RUNNING in MLflow)", exc)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # --- reading back
    @staticmethod
    def lookup(tracking_uri: str, run_id: str) -> RunRecord:
        """Read a run back for ``resume``; TrackingError if it does not exist or has no spec."""
        client = ms.client(tracking_uri)
        run = ms.get_run(client, tracking_uri, run_id)
        artifacts = _read_json_artifacts(
            client, tracking_uri, run_id,
            [SPEC_ARTIFACT, ORIGINAL_SPEC_ARTIFACT, CHECKPOINTS_ARTIFACT, EVENTS_ARTIFACT],
        )
        if SPEC_ARTIFACT not in artifacts:
            raise TrackingError(
                f"MLflow run {run_id} in {tracking_uri} has no {SPEC_ARTIFACT}: it was not "
                "started by raytrain-sys; give the run id printed by `raytrain-sys run`"
            )
        tags = dict(run.data.tags)
        return RunRecord(
            run_id=run_id,
            status=run.info.status,
            spec_dict=artifacts[SPEC_ARTIFACT],
            tags=tags,
            checkpoint_records=list(artifacts.get(CHECKPOINTS_ARTIFACT, [])),
            latest_checkpoint_uri=tags.get(TAG_LATEST_CHECKPOINT, ""),
            run_dir=tags.get(TAG_RUN_DIR, ""),
            experiment_id=run.info.experiment_id,
            events=list(artifacts.get(EVENTS_ARTIFACT, [])),
            original_spec_dict=artifacts.get(ORIGINAL_SPEC_ARTIFACT),
        )


def spec_checkpoint_root(spec: dict, run_id: str | None) -> str:
    """Where a job spec given as a plain dict keeps its checkpoints: its ``checkpoint.uri``, else
    the root its MLflow run recorded (``<run dir>/checkpoints``); "" when it never started a run."""
    uri = (spec.get("checkpoint") or {}).get("uri") or ""
    if uri or not run_id:
        return uri
    return Tracker.lookup(spec_tracking_uri(spec), run_id).tags.get(TAG_CHECKPOINT_ROOT, "")
