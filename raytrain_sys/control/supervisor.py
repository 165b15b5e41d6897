"""The Supervisor: the driver-side owner of a run.

It owns membership (the worker group), the committed-step counter, the data cursor and the MLflow
run. It drives steps, counts a step as committed when every rank reported it, commits
checkpoints (workers write data, the Supervisor writes the manifest last), and records every
state transition with its reason. It never touches tensors.

States: starting -> running <-> checkpointing -> finished | failed, with restoring between
starting and running when a run resumes from a checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import ray

from raytrain_sys import __version__
from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.run_record import SAMPLE_LOG_FILE, RunSummary, git_commit
from raytrain_sys.control.worker_group import WorkerGroup, connect_ray
from raytrain_sys.data.order import deal
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.errors import (CheckpointError, SpecError, StorageError, TrainingFailed,
                                 UserError, find_user_error)
from raytrain_sys.spec import JobSpec, from_dict
from raytrain_sys.tracking import mlflow_tracker as mt
from raytrain_sys.train.tasks import task_for

log = logging.getLogger(__name__)

# Test hook: crash the driver after a checkpoint's data files are written and before its
# manifest, at this step. Used to prove that a half-written checkpoint stays invisible.
FAULT_BEFORE_MANIFEST_ENV = "RAYTRAIN_SYS_FAULT_BEFORE_MANIFEST_STEP"


class State(str, Enum):
    STARTING = "starting"
    RESTORING = "restoring"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    STOPPED = "stopped"  # paused by train.stop_at_step, resumable
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class StepReport:
    step: int  # committed steps so far (1-based index of the step just committed)
    max_steps: int
    loss: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    world_size: int
    eta_s: float


@dataclass
class RunResult:
    status: str
    run_dir: str
    committed_steps: int
    losses: list[float]
    mlflow_run_id: str
    newest_checkpoint: str
    summary_path: str
    reason: str = ""


def _resolve_dir(path: str) -> str:
    return path if path.startswith("s3://") else os.path.abspath(path)


class Supervisor:
    def __init__(self, spec: JobSpec, *, resume_run_id: str = "", run_dir: str = "",
                 on_step: Callable[[StepReport], None] | None = None):
        self.spec = spec
        self.resume_run_id = resume_run_id
        self.on_step = on_step
        self.state = State.STARTING
        self.output_dir = os.path.abspath(spec.output_dir)
        self.run_dir = run_dir or os.path.join(
            self.output_dir, f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000}")
        self.tracking_uri = spec.tracking.uri or mt.default_tracking_uri(self.output_dir)
        self.checkpoint_root = _resolve_dir(spec.checkpoint.uri or os.path.join(self.run_dir, "checkpoints"))
        self.summary = RunSummary(job=spec.name, run_dir=self.run_dir)
        self.tracker = None
        self.group: WorkerGroup | None = None
        self.data: DataPlane | None = None
        self.committed_step = 0
        self.data_cursor = 0
        self._local_cluster = False

    # ------------------------------------------------------------------ bookkeeping
    def _transition(self, state: State, reason: str) -> None:
        log.info("supervisor: %s -> %s (%s)", self.state.value, state.value, reason)
        self.state = state
        self.summary.status = state.value
        self.summary.transitions.append({"time": time.time(), "state": state.value,
                                         "reason": reason, "step": self.committed_step})
        if self.tracker is not None:
            try:
                self.tracker.log_event(self.committed_step, state.value, reason)
            except Exception as exc:
                log.warning("could not record transition in MLflow: %s", exc)
        self.summary.write()

    # ------------------------------------------------------------------ pre-flight
    def _preflight(self) -> CheckpointInfo | None:
        """Everything that can fail on bad input, checked before any Ray resource is taken."""
        spec = self.spec
        os.makedirs(self.run_dir, exist_ok=True)
        _point_latest(self.output_dir, self.run_dir)
        self.manifest = read_manifest(spec.data.path, spec.data.s3_endpoint_url)
        if self.manifest.row_len != spec.model.block_size + 1:
            raise SpecError("model.block_size",
                            f"got {spec.model.block_size}; dataset {spec.data.path} holds rows of "
                            f"{self.manifest.row_len} tokens, so block_size must be "
                            f"{self.manifest.row_len - 1} (or re-run prepare-data with --row-len)")
        self.store = open_store(self.checkpoint_root, spec.checkpoint.s3_endpoint_url)
        self.store.check_access()
        self.checkpointer = Checkpointer(self.store, spec.checkpoint.keep_last)
        self.task = task_for(spec.model.name)
        if spec.tracking.enabled:
            mt.check_reachable(self.tracking_uri)
        resume = spec.checkpoint.resume_from
        if not resume:
            return None
        if resume == "latest":
            info = self.checkpointer.latest()
            if info is None:
                log.info("checkpoint.resume_from=latest: no complete checkpoint in %s, starting fresh",
                         self.checkpoint_root)
            return info
        from raytrain_sys.checkpoint.checkpointer import open_checkpoint
        _, info = open_checkpoint(resume, spec.checkpoint.s3_endpoint_url)
        return info

    def _check_compatible(self, info: CheckpointInfo) -> None:
        meta = info.manifest
        if meta.get("training_hash") == self.spec.training_hash():
            return
        old = from_dict(meta["spec"]) if "spec" in meta else None
        diffs = []
        if old is not None:
            a, b = old.flat(), self.spec.flat()
            diffs = [k for k in a if k.split(".")[0] in ("model", "optim") and a[k] != b.get(k)]
            diffs += [k for k in ("data.seed", "data.shuffle_window", "data.shuffle_block_rows", "train.global_batch_size",
                                  "train.precision", "train.seed") if a.get(k) != b.get(k)]
        raise CheckpointError(
            f"checkpoint {info.uri} was written with different training settings "
            f"({', '.join(diffs) or 'training hash differs'}); resuming would not continue the same "
            f"run: restore those fields or start a new run")

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        spec = self.spec
        try:
            resume_info = self._preflight()
            self.summary.spec_hash = spec.spec_hash()
            self.summary.training_hash = spec.training_hash()
            self.summary.git_commit = git_commit()
            self.summary.tracking_uri = self.tracking_uri
            if resume_info is not None:
                self._check_compatible(resume_info)
                previous = RunSummary.read(self.run_dir)
                if previous is not None:
                    previous.truncate_to(resume_info.step)
                    self.summary = previous
                    self.summary.reason = ""
            self.summary.write()

            self._local_cluster = connect_ray(spec)
            self.group = WorkerGroup(spec, spec.resources.num_workers, self._local_cluster)
            self.group.start()
            self._start_tracking()
            self._transition(State.STARTING, f"{self.group.world_size} workers placed")
            self.group.form_process_group()
            if resume_info is not None:
                self._restore(resume_info)
            self.data = DataPlane(
                spec.data.path, self.manifest, spec.data.seed, spec.data.shuffle_window,
                spec.data.shuffle_block_rows,
                spec.train.global_batch_size, end_position=spec.train.max_steps * spec.train.global_batch_size,
                prefetch_steps=spec.data.prefetch_steps, s3_endpoint_url=spec.data.s3_endpoint_url)
            self._transition(State.RUNNING, f"training from step {self.committed_step}")
            self._loop()
            saved = [c["step"] for c in self.summary.checkpoints]
            if spec.checkpoint.save_on_exit and self.committed_step not in saved:
                self._checkpoint(final=True)
            if self.committed_step < spec.train.max_steps:
                self._transition(State.STOPPED, f"paused at train.stop_at_step={spec.train.stop_at_step}")
            else:
                self._transition(State.FINISHED, f"reached train.max_steps={spec.train.max_steps}")
            return self._result()
        except BaseException as exc:
            user = find_user_error(exc) if not isinstance(exc, KeyboardInterrupt) else None
            reason = str(user) if user is not None else (
                "interrupted by the user" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}")
            self.summary.reason = reason
            if self.state is not State.FAILED:
                self._transition(State.FAILED, reason)
            if user is not None:
                raise user from None
            raise
        finally:
            self._teardown()

    def _start_tracking(self) -> None:
        spec = self.spec
        if not spec.tracking.enabled:
            return
        tags = {mt.TAG_GIT_COMMIT: self.summary.git_commit, mt.TAG_RUN_DIR: self.run_dir,
                mt.TAG_CHECKPOINT_ROOT: self.checkpoint_root}
        if self.resume_run_id:
            self.tracker = mt.Tracker.resume(self.tracking_uri, self.resume_run_id, spec)
            self.tracker.set_tags(tags)
        else:
            run_name = spec.tracking.run_name or os.path.basename(self.run_dir)
            self.tracker = mt.Tracker.start(
                self.tracking_uri, spec.tracking.experiment, run_name, spec, tags,
                artifact_root=os.path.join(self.output_dir, "mlartifacts"))
        self.summary.mlflow_run_id = self.tracker.run_id

    def _restore(self, info: CheckpointInfo) -> None:
        self._transition(State.RESTORING, f"loading checkpoint {info.uri}")
        steps = ray.get([a.load_checkpoint.remote(info.uri, self.spec.checkpoint.s3_endpoint_url)
                         for a in self.group.actors()])
        assert len(set(steps)) == 1 and steps[0] == info.step, f"replicas disagree: {steps}"
        self.committed_step = info.step
        self.data_cursor = int(info.manifest["data_cursor"])
        # A resume into a new run dir has no record of earlier steps: keep "index i = step i+1".
        missing = info.step - len(self.summary.losses)
        self.summary.losses += [None] * missing
        self.summary.world_sizes += [None] * missing
        self.summary.resumed_from.append(info.uri)
        self.summary.newest_checkpoint = info.uri

    def _loop(self) -> None:
        spec = self.spec
        B = spec.train.global_batch_size
        tokens_per_step = B * spec.model.block_size  # throughput unit of the GPT task
        sample_log = (open(os.path.join(self.run_dir, SAMPLE_LOG_FILE), "a")
                      if spec.data.log_sample_ids else None)
        step_times: list[float] = []
        run_t0 = time.perf_counter()
        try:
            last = spec.train.max_steps
            if spec.train.stop_at_step:
                last = min(last, spec.train.stop_at_step)
            while self.committed_step < last:
                step = self.committed_step
                t0 = time.perf_counter()
                wait0 = self.data.wait_s
                batch, ids = self.data.global_batch(self.data_cursor)
                data_wait = self.data.wait_s - wait0
                units = self.task.units(batch)
                shares = deal(B, self.group.world_size)
                refs = [actor.train_step.remote(step, {k: v[sl] for k, v in batch.items()}, units)
                        for actor, sl in zip(self.group.actors(), shares)]
                results = self._gather(refs, step)
                # Committed: every rank finished its optimizer step.
                self.committed_step = step + 1
                self.data_cursor += B
                dt = time.perf_counter() - t0
                step_times.append(dt)
                loss = sum(r["loss_sum"] for r in results) / units
                self.summary.losses.append(loss)
                self.summary.world_sizes.append(self.group.world_size)
                self.summary.committed_steps = self.committed_step
                self.summary.samples_consumed = self.data_cursor
                self.summary.data_cursor = self.data_cursor
                if sample_log is not None:
                    sample_log.write(_sample_line(self.committed_step, ids, shares))
                # Steady state excludes the first steps (process warm-up, allocator growth).
                steady = step_times[min(3, len(step_times) - 1):]
                tps = tokens_per_step * len(steady) / max(sum(steady), 1e-9)
                metrics = {"loss": loss, "lr": results[0]["lr"], "grad_norm": results[0]["grad_norm"],
                           "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                           "data_wait_s": data_wait, "world_size": float(self.group.world_size)}
                if self.tracker is not None:  # queued: the step loop never waits on MLflow
                    self.tracker.log_metrics(self.committed_step, metrics)
                remaining = spec.train.max_steps - self.committed_step
                if self.on_step is not None:
                    self.on_step(StepReport(self.committed_step, spec.train.max_steps, loss,
                                            results[0]["lr"], tps, dt, self.group.world_size,
                                            remaining * (sum(steady) / len(steady))))
                if self.committed_step % spec.train.log_every_steps == 0:
                    self.summary.throughput = {
                        "tokens_per_s": tps, "step_time_s": sum(steady) / len(steady),
                        "data_wait_fraction": self.data.wait_s / max(time.perf_counter() - run_t0, 1e-9)}
                    self.summary.write()
                every = spec.checkpoint.every_steps
                if every and self.committed_step % every == 0 and self.committed_step < last:
                    self._checkpoint(final=False)
        finally:
            if sample_log is not None:
                sample_log.close()

    def _gather(self, refs: list, step: int) -> list[dict]:
        try:
            return ray.get(refs, timeout=self.spec.train.step_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TrainingFailed(
                f"step {step + 1} did not finish within train.step_timeout_s="
                f"{self.spec.train.step_timeout_s:g} s (a hung worker?); newest checkpoint: "
                f"{self.summary.newest_checkpoint or 'none'}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
            raise TrainingFailed(
                f"a worker died during step {step + 1} ({type(exc).__name__}); committed steps: "
                f"{self.committed_step}; resume from the newest checkpoint "
                f"({self.summary.newest_checkpoint or 'none'})"
                + (f" with `raytrain-sys resume --mlflow-run {self.tracker.run_id}`" if self.tracker else "")
            ) from None

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, final: bool) -> None:
        step = self.committed_step
        self._transition(State.CHECKPOINTING, f"{'final' if final else 'periodic'} checkpoint at step {step}")
        try:
            files = [f for part in ray.get([a.save_checkpoint.remote(
                self.checkpoint_root, self.spec.checkpoint.s3_endpoint_url, step)
                for a in self.group.actors()]) for f in part]
            if os.environ.get(FAULT_BEFORE_MANIFEST_ENV) == str(step):
                raise RuntimeError(f"injected fault before the manifest of step {step}")
            info = self.checkpointer.commit(step, files, self._checkpoint_meta())
        except Exception as exc:
            user = find_user_error(exc)
            if user is None or not isinstance(user, StorageError):
                raise
            if final:
                raise StorageError(f"final checkpoint at step {step} could not be saved: {user}") from None
            # Training state is still in memory: keep going, try again at the next interval.
            log.warning("checkpoint at step %d failed, training continues: %s", step, user)
            self._transition(State.RUNNING, f"checkpoint at step {step} failed: {user}")
            return
        self.summary.newest_checkpoint = info.uri
        self.summary.checkpoints.append({"step": step, "uri": info.uri})
        if self.tracker is not None:
            try:
                self.tracker.record_checkpoint(step, info.uri, {"data_cursor": self.data_cursor})
            except Exception as exc:
                log.warning("checkpoint %s not recorded in MLflow: %s", info.uri, exc)
        self._transition(State.RUNNING, f"checkpoint committed: {info.uri}")

    def _checkpoint_meta(self) -> dict:
        return {"data_cursor": self.data_cursor, "world_size": self.group.world_size,
                "spec_hash": self.spec.spec_hash(), "training_hash": self.spec.training_hash(),
                "git_commit": self.summary.git_commit, "raytrain_sys_version": __version__,
                "dataset_hash": self.manifest.content_hash, "spec": self.spec.to_dict(),
                "mlflow_run_id": self.summary.mlflow_run_id}

    # ------------------------------------------------------------------ end
    def _result(self) -> RunResult:
        s = self.summary
        return RunResult(s.status, self.run_dir, self.committed_step, list(s.losses), s.mlflow_run_id,
                         s.newest_checkpoint, s.path, s.reason)

    def _teardown(self) -> None:
        self.summary.finished_at = time.time()
        if self.data is not None:
            self.data.close()
        if self.group is not None:
            self.group.shutdown()
        if self.tracker is not None:
            status = {State.FINISHED: "FINISHED", State.STOPPED: "KILLED"}.get(self.state, "FAILED")
            try:
                self.tracker.finish(status)
            except Exception as exc:
                log.warning("could not close the MLflow run: %s", exc)
        self.summary.write()
        if self._local_cluster:
            ray.shutdown()


def _point_latest(output_dir: str, run_dir: str) -> None:
    """<output_dir>/latest -> the newest run dir, for `raytrain-sys sample runs/latest`."""
    link = os.path.join(output_dir, "latest")
    try:
        tmp = f"{link}.{os.getpid()}"
        os.symlink(os.path.relpath(run_dir, output_dir), tmp)
        os.replace(tmp, link)
    except OSError as exc:  # e.g. a filesystem without symlinks: only a convenience is lost
        log.debug("could not update %s: %s", link, exc)


def _sample_line(step: int, ids, shares: list[slice]) -> str:
    import json

    return json.dumps({"step": step, "ranks": [ids[sl].tolist() for sl in shares]}) + "\n"


def run_job(spec: JobSpec, *, on_step: Callable[[StepReport], None] | None = None) -> RunResult:
    """Run a job to completion on the cluster the spec names (or a local one)."""
    return Supervisor(spec, on_step=on_step).run()


def resume_job(run_id: str, *, tracking_uri: str = "", overrides: list[str] | None = None,
               output_dir: str = "runs", on_step: Callable[[StepReport], None] | None = None) -> RunResult:
    """Continue the MLflow run ``run_id`` from its newest committed checkpoint, in the same run."""
    from raytrain_sys.spec import apply_overrides

    uri = tracking_uri or mt.default_tracking_uri(os.path.abspath(output_dir))
    mt.check_reachable(uri)
    record = mt.Tracker.lookup(uri, run_id)
    raw = apply_overrides(record.spec_dict, overrides or [])
    raw.setdefault("tracking", {})["uri"] = uri
    checkpoint_root = record.tags.get(mt.TAG_CHECKPOINT_ROOT, "")
    if checkpoint_root:
        raw.setdefault("checkpoint", {})["uri"] = checkpoint_root
    raw["checkpoint"]["resume_from"] = "latest"
    # A pause point belongs to the invocation that paused; resuming runs on unless told again.
    if not any(o.startswith("train.stop_at_step=") for o in overrides or []):
        raw.setdefault("train", {})["stop_at_step"] = 0
    spec = from_dict(raw)
    run_dir = record.run_dir if record.run_dir and os.path.isdir(record.run_dir) else ""
    sup = Supervisor(spec, resume_run_id=run_id, run_dir=run_dir, on_step=on_step)
    if Checkpointer(open_store(sup.checkpoint_root, spec.checkpoint.s3_endpoint_url), 1).latest() is None:
        raise CheckpointError(f"MLflow run {run_id} has no complete checkpoint in {sup.checkpoint_root}: "
                              f"nothing to resume; start it again with `raytrain-sys run`")
    return sup.run()
