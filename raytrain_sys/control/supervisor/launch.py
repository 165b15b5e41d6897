"""Everything before the first step: a resume's record, pre-flight checks, the previous
launch's leftovers, the MLflow run, the data warm-up, and the start's record.

Owns: the run directory's ``latest`` link, the ``Preflight`` values (dataset manifest,
checkpoint store and checkpointer, task, model FLOPs per token, the checkpoint to resume), the
MLflow run's start (tags, run id into summary.json: a new run's once its tracker's writer has
opened it, which the start does not wait for), what a resume from MLflow continues
(``resumed_run``: the spec, run directory and run key its record names) and ``Phases`` (the
start's phases, their spans and what ran beside them, in summary.json). Everything that can
fail on bad input is checked here before any Ray resource is taken. Calls no other part of the
Supervisor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import ray

from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.control import adoption
from raytrain_sys.control.adoption import Adoption
from raytrain_sys.control.launches import clean_up_leftovers
from raytrain_sys.control.worker_group import connect_ray
from raytrain_sys.train.compat import check_spec_against_manifest
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.parallel.mesh import rank_data_slices
from raytrain_sys.errors import CheckpointError, SpecError, UserError
from raytrain_sys.spec import JobSpec, apply_overrides, from_dict
from raytrain_sys.tracking import mlflow_store as ms
from raytrain_sys.tracking import mlflow_tracker as mt
from raytrain_sys.extensions import resolve_task

log = logging.getLogger(__name__)


@dataclass
class Preflight:
    manifest: object  # the dataset's manifest
    store: object
    checkpointer: Checkpointer
    task: object
    flops_per_token: float  # 0: not a GPT, no MFU
    resume_info: CheckpointInfo | None  # the checkpoint the run continues from, if any
    # Why the run resumes from an older checkpoint than asked (checkpoint.on_corrupt=previous),
    # for MLflow once the run is open; "" when it resumes from the one asked for.
    fallback: str = ""
    eval_set: tuple | None = None  # (uri, manifest) of the evaluation set, with eval.every_steps


@dataclass
class Resumed:
    """What a resume from MLflow continues: the run's spec (with the overrides), its run
    directory ("" when it is not on this machine) and the run key of the launch it follows."""

    spec: JobSpec
    run_dir: str
    previous_key: str


def resumed_run(run_id: str, tracking_uri: str = "", overrides: list[str] | None = None,
                output_dir: str = "runs", objects: dict | None = None) -> Resumed:
    """The run ``run_id`` as its MLflow record names it, to continue from its newest checkpoint:
    its spec (``overrides`` applied; ``objects``: dotted field -> the Python object it was given
    for an extension point, which the record names but cannot hold), its checkpoint root and run
    directory. A pause point belongs to the invocation that paused: the resumed run trains on
    unless ``train.stop_at_step`` is given again."""
    uri = tracking_uri or mt.default_tracking_uri(os.path.abspath(output_dir))
    ms.check_reachable(uri)
    record = mt.Tracker.lookup(uri, run_id)
    raw = apply_overrides(record.spec_dict, overrides or [])
    for dotted, obj in (objects or {}).items():
        section, _, name = dotted.partition(".")
        raw.setdefault(section, {})[name] = obj
    raw.setdefault("tracking", {})["uri"] = uri
    checkpoint_root = record.tags.get(mt.TAG_CHECKPOINT_ROOT, "")
    if checkpoint_root:
        raw.setdefault("checkpoint", {})["uri"] = checkpoint_root
    raw["checkpoint"]["resume_from"] = "latest"
    if not any(o.startswith("train.stop_at_step=") for o in overrides or []):
        raw.setdefault("train", {})["stop_at_step"] = 0
    run_dir = record.run_dir if record.run_dir and os.path.isdir(record.run_dir) else ""
    previous_key = os.path.basename(record.run_dir.rstrip("/")) if record.run_dir else ""
    return Resumed(from_dict(raw), run_dir, previous_key)


def check_resumable(spec: JobSpec, checkpoint_root: str, run_id: str, adoption: Adoption | None = None) -> None:
    """A resume that adopts no live workers (``adoption``) needs a complete checkpoint:
    ``CheckpointError`` naming the run otherwise (and why nothing was adopted)."""
    if adoption is not None and adoption.adopted:
        return
    if Checkpointer(open_store(checkpoint_root, spec.checkpoint.s3_endpoint_url), 1).latest() is None:
        why = f" (and {adoption.why})" if adoption is not None else ""
        raise CheckpointError(f"MLflow run {run_id} has no complete checkpoint in {checkpoint_root}{why}: "
                              f"nothing to resume; start it again with `raytrain-sys run`")


def resolve_dir(path: str) -> str:
    return path if path.startswith("s3://") else os.path.abspath(path)


def preflight(spec: JobSpec, output_dir: str, run_dir: str, checkpoint_root: str,
              tracking_uri: str) -> Preflight:
    """Everything that can fail on bad input, checked before any Ray resource is taken."""
    os.makedirs(run_dir, exist_ok=True)
    _point_latest(output_dir, run_dir)
    manifest = read_manifest(spec.data.path, spec.data.s3_endpoint_url)
    check_spec_against_manifest(spec, manifest)
    store = open_store(checkpoint_root, spec.checkpoint.s3_endpoint_url)
    store.check_access()
    checkpointer = Checkpointer(store, spec.checkpoint.keep_last)
    task = resolve_task(spec)
    if spec.eval.every_steps and spec.eval.metric != "loss" and not hasattr(task, "eval_sums"):
        raise SpecError("eval.metric", f"got {spec.eval.metric!r}, which the task does not report (it "
                                       f"has no eval_sums); use loss, or a task that reports it "
                                       f"(raytrain_sys.train.tasks.Classify)")
    from raytrain_sys.models import model_flops_per_token
    from raytrain_sys.train.check import check_job_inputs

    # The model, the task and the rows meet once here, on a few rows, before any Ray resource.
    check_job_inputs(spec, manifest, task)
    flops_per_token = model_flops_per_token(spec.model) if spec.model.name == "gpt" else 0
    eval_set = None
    if spec.eval.every_steps:
        from raytrain_sys.data.evalset import open_eval_set

        eval_set = open_eval_set(spec)
    if spec.tracking.enabled:
        ms.check_reachable(tracking_uri)
    found = Preflight(manifest, store, checkpointer, task, flops_per_token, None, eval_set=eval_set)
    resume = spec.checkpoint.resume_from
    if not resume:
        return found
    if resume == "latest":
        found.resume_info = checkpointer.latest()
        if found.resume_info is None:
            log.info("checkpoint.resume_from=latest: no complete checkpoint in %s, starting fresh",
                     checkpoint_root)
            return found
    else:
        from raytrain_sys.checkpoint.checkpointer import open_checkpoint
        checkpointer, found.resume_info = open_checkpoint(resume, spec.checkpoint.s3_endpoint_url)
    check_intact(spec, checkpointer, found)
    return found


def check_intact(spec: JobSpec, checkpointer: Checkpointer, found: Preflight) -> None:
    """The checkpoint to resume from, checked before anything starts (its files there, of their
    recorded sizes). A bad one is refused naming the newest intact older checkpoint, or, with
    resume_from=latest and checkpoint.on_corrupt=previous, replaced by it (``fall_back``)."""
    info = found.resume_info
    problems = checkpointer.problems(info)
    if problems:
        found.resume_info, found.fallback = fall_back(
            spec, checkpointer, info, f"checkpoint {info.uri} is damaged ({'; '.join(problems)})")


def fall_back(spec: JobSpec, checkpointer: Checkpointer, info: CheckpointInfo, what: str
              ) -> tuple[CheckpointInfo, str]:
    """``info`` cannot be resumed from (``what`` says why; found before the start, or when its
    files were loaded). With resume_from=latest and checkpoint.on_corrupt=previous: the newest
    intact older checkpoint, and the note that says so; every committed checkpoint newer than
    it is set aside (kept, invisible), so that the run can write those steps again. Otherwise
    a CheckpointError naming that older checkpoint (its path and step) and the spec field that
    resumes from it."""
    older = checkpointer.newest_intact(before_step=info.step)
    if older is not None and spec.checkpoint.resume_from == "latest" and spec.checkpoint.on_corrupt == "previous":
        newer = [c for c in checkpointer.list_complete() if c.step > older.step]
        for damaged in newer:
            why = what if damaged.step == info.step else "; ".join(checkpointer.problems(damaged))
            checkpointer.set_aside(damaged, why or "newer than a damaged one")
        note = (f"{what}: resuming from the newest intact older one, {older.uri} "
                f"(checkpoint.on_corrupt=previous); set aside: "
                f"{', '.join(os.path.basename(c.uri.rstrip('/')) for c in newer)}")
        log.warning("%s", note)
        return older, note
    if older is None:
        raise CheckpointError(f"{what}, and no older checkpoint under {checkpointer.store.uri} is intact: "
                              f"start the run afresh (no checkpoint.resume_from)")
    how = ("set checkpoint.on_corrupt: previous in the spec (or --set checkpoint.on_corrupt=previous) to "
           "resume from it" if spec.checkpoint.resume_from == "latest"
           else f"resume from it (checkpoint.resume_from={older.uri})")
    raise CheckpointError(f"{what}; the newest intact older checkpoint is {older.uri} (step {older.step}): {how}")


def clean_up_previous_launch(spec: JobSpec, previous_run_key: str) -> list:
    """A resumed run first removes whatever its lost driver left on the cluster, and refuses
    to start while that driver is still alive (see ``clean_up_leftovers``)."""
    if not previous_run_key:
        return []
    if not (ray.is_initialized() or spec.resources.ray_address or os.environ.get("RAY_ADDRESS")):
        # A local cluster started now holds nothing of an earlier driver; the one that
        # driver started ended with it.
        return []
    connect_ray(spec)
    try:
        return clean_up_leftovers(previous_run_key)
    except UserError:
        raise
    except Exception as exc:  # cannot read the cluster's tables: Ray's own clean-up remains
        log.warning("could not look for leftovers of run %s: %s", previous_run_key, exc)
        return []


def adopt_previous_launch(spec: JobSpec, previous_run_key: str) -> Adoption | None:
    """A resumed run first tries to take over the live ranks its lost driver left (``adoption``):
    None when nothing of an earlier driver is left running (or the run is resumed on no running
    cluster), else the ``Adoption``, adopted or with the reason it is not."""
    if not previous_run_key or not (ray.is_initialized() or spec.resources.ray_address
                                    or os.environ.get("RAY_ADDRESS")):
        return None
    connect_ray(spec)
    try:
        def rows_of(world: int) -> list[tuple[int, int]]:  # as Steps deals a new group's rows
            return [(sl.start, sl.stop) for sl in
                    rank_data_slices(spec.parallel, world, spec.train.global_batch_size, None)]

        return adoption.find(previous_run_key, spec.elastic.orphan_timeout_s, spec.training_hash(), rows_of)
    except Exception as exc:  # noqa: BLE001: the cluster's tables unreadable: the checkpoint remains
        log.warning("could not look for a launch of run %s to adopt: %s", previous_run_key, exc)
        return Adoption(why=f"could not look for its launch ({type(exc).__name__}: {exc})")


def start_tracking(spec: JobSpec, summary: RunSummary, tracking_uri: str, resume_run_id: str,
                   run_dir: str, output_dir: str, checkpoint_root: str):
    """The run's MLflow tracker (None with tracking off); its run id goes into ``summary``.
    A resume reopens its run here (its record was read before). A new run is opened by the
    tracker's writer (``Tracker.begin``): this returns at once, training starts while it opens,
    and its run id reaches ``summary`` in the writer's thread once the run exists; the step loop
    raises a failed opening (``Tracker.check_open``)."""
    if not spec.tracking.enabled:
        return None
    tags = {mt.TAG_GIT_COMMIT: summary.git_commit, mt.TAG_RUN_DIR: run_dir,
            mt.TAG_CHECKPOINT_ROOT: checkpoint_root}
    if resume_run_id:
        tracker = mt.Tracker.resume(tracking_uri, resume_run_id, spec)
        tracker.set_tags(tags)
        summary.mlflow_run_id = tracker.run_id
        return tracker

    def opened(tracker) -> None:
        summary.mlflow_run_id = tracker.run_id

    run_name = spec.tracking.run_name or os.path.basename(run_dir)
    if spec.tracking.parent_run_id:
        tags[mt.TAG_PARENT_RUN] = spec.tracking.parent_run_id
    return mt.Tracker.begin(tracking_uri, spec.tracking.experiment, run_name, spec, tags,
                            artifact_root=os.path.join(output_dir, "mlartifacts"), on_open=opened)


class InBackground:
    """``fn()`` in a thread of its own, started by ``start``; ``result`` (which starts it if
    nothing did) joins it and returns its value or raises its error, in the caller's thread.
    ``seconds``: how long ``fn`` ran, once it has returned (the start's ``start_beside``);
    ``span``: when it began and ended (``time.perf_counter``), once it has returned."""

    def __init__(self, fn, name: str):
        self._fn, self._name = fn, name
        self._thread: threading.Thread | None = None
        self._value, self._error = None, None
        self.seconds: float | None = None
        self.span: tuple[float, float] | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def done(self) -> bool:
        """``fn`` has returned (or raised): ``result`` does not wait."""
        return self.span is not None

    def start(self) -> "InBackground":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._value = self._fn()
        except BaseException as exc:  # noqa: BLE001: raised in result(), in the caller's thread
            self._error = exc
        finally:
            t1 = time.perf_counter()
            self.seconds, self.span = round(t1 - t0, 3), (t0, t1)

    def join(self, timeout: float | None = None) -> None:
        """Wait for ``fn`` to return (at most ``timeout`` s); nothing when it was never started."""
        if self._thread is not None:
            self._thread.join(timeout)

    def result(self):
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Phases:
    """The start's phases for ``RunSummary.start_phases``: each call records the seconds since
    the previous one under its name; ``add`` records phases timed elsewhere (which the next
    call's interval then leaves out); ``end`` adds the total. Each phase's [start_s, end_s] from
    the start's beginning goes to ``start_spans`` too, beside what ran in the background of the
    start (``beside``: its span there, its seconds in ``start_beside``)."""

    BESIDE = {"mlflow_run": "tracking", "first_read": "first_read"}  # span name -> start_beside's

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.spans: dict[str, list[float]] = {}
        self.beside_s: dict[str, float] = {}
        self.t0 = self.last = time.perf_counter()

    def record(self, summary: RunSummary) -> None:
        summary.start_phases, summary.start_spans, summary.start_beside = self.phases, self.spans, self.beside_s

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self._phase(name, self.last, now)
        self.last = now

    def _phase(self, name: str, start: float, end: float) -> None:
        self.phases[name] = round(end - start, 3)
        self.spans[name] = [round(start - self.t0, 3), round(end - self.t0, 3)]

    def add(self, timed: dict[str, float]) -> None:
        for name, seconds in timed.items():
            self._phase(name, self.last, self.last + seconds)
            self.last += seconds

    def beside(self, name: str, span: tuple[float, float], seconds: float) -> None:
        self.spans[name] = [round(span[0] - self.t0, 3), round(span[1] - self.t0, 3)]
        self.beside_s[self.BESIDE[name]] = round(seconds, 3)

    def end(self) -> None:
        self.phases["total"] = round(time.perf_counter() - self.t0, 3)


def warm_data(spec: JobSpec, data: DataPlane, cursor: int) -> InBackground | None:
    """Read the first global batch in the background (the plane caches it). Only where a
    read has no side effect: with data.on_bad_shard=skip a bad shard changes the stream's
    ledger, which belongs to the step loop. An error here is met again, and reported, by
    the step that needs the batch."""
    if spec.data.on_bad_shard != "fail":
        return None

    def read() -> None:
        try:
            data.global_batch_refs(cursor)
        except Exception as exc:
            log.debug("data warm-up: %s (the first step will report it)", exc)

    return InBackground(read, "data-warm-up").start()


def _point_latest(output_dir: str, run_dir: str) -> None:
    """<output_dir>/latest -> the newest run dir, for `raytrain-sys sample runs/latest`."""
    link = os.path.join(output_dir, "latest")
    try:
        tmp = f"{link}.{os.getpid()}"
        os.symlink(os.path.relpath(run_dir, output_dir), tmp)
        os.replace(tmp, link)
    except OSError as exc:  # e.g. a filesystem without symlinks: only a convenience is lost
        log.debug("could not update %s: %s", link, exc)
