"""A sweep's runner: Ray Tune decides, the job service places, runs and restarts every trial.

Owns: the sweep's runner actor (``SweepRunner``, detached, on the safe nodes; the reconciler
starts it: ``reconcile.ensure_runners``) and the Tune driver it runs (``drive``: a new
``Tuner``, or ``Tuner.restore`` of the sweep's experiment after its runner was lost, which never
reruns a finished trial). Writes in the store: the sweep's end (finished with its best trial, or
failed); the reconciler writes the sweep's start and its runner's restarts.

The driver's part of a sweep: Tune's scheduler and callback (``scheduler``), the trainable it
runs for each trial (``proxy.trainable``), the MLflow parent run made in a thread beside Tune's
start (``tracking.ParentRun``), and at the end the best trial (``outcome``), recorded once every
trial's job has ended or is held (``wait_for_trials_to_end``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import ray

from raytrain_sys.errors import JobStateConflict
from raytrain_sys.niceness import set_niceness
from raytrain_sys.service.model import JobState, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.names import ACTOR, experiment_name
from raytrain_sys.service.sweeps.outcome import best_of, trial_table
from raytrain_sys.service.sweeps.process import CONTROL_NICENESS, log_to
from raytrain_sys.service.sweeps.proxy import trainable
from raytrain_sys.service.sweeps.scheduler import make_callback, make_scheduler
from raytrain_sys.service.sweeps.spec import spec_of, tune_space
from raytrain_sys.service.sweeps.tracking import ParentRun, record_outcome

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=0)
class SweepRunner:
    """A sweep's Tune driver, detached and named (``raytrain-sys-sweep-<id>``): it drives Tune in
    a thread, answers ``status`` meanwhile; the reconciler starts another when it is lost."""

    def __init__(self, sweep_id: int, db_url: str, base_dir: str, log_path: str = ""):
        log_to(log_path)
        set_niceness(CONTROL_NICENESS)
        self.sweep_id = sweep_id
        self.log_path = log_path
        self._error = ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(db_url, base_dir), daemon=True)
        self._thread.start()

    def _run(self, db_url: str, base_dir: str) -> None:
        try:
            drive(self.sweep_id, db_url, base_dir, self.log_path)
        except Exception as exc:  # the reconciler records it and fails the sweep
            log.exception("sweep %d: its Tune driver raised", self.sweep_id)
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()

    def status(self) -> dict:
        return {"sweep_id": self.sweep_id, "done": self._done.is_set(), "error": self._error, "pid": os.getpid()}


def drive(sweep_id: int, db_url: str, base_dir: str, log_path: str = "") -> Optional[SweepRecord]:
    """Run (or, when its experiment exists, restore and finish) the sweep's Tune experiment, then
    record its end: finished with the best trial and value. Returns the sweep as recorded, or
    None when it was no longer running (cancelled or paused meanwhile: nothing recorded)."""
    from ray import tune

    store = Store.open(db_url)
    try:
        sweep = store.sweep(sweep_id)
        log.info("sweep %d: its runner drives Tune (%.1f s after its submit)", sweep_id, time.time() - sweep.submitted_at_s)
        spec = spec_of(sweep)
        # MLflow imported here, before the two threads that would import it at once: Tune's own
        # start imports it (its usage tags load ray.air.integrations.mlflow) while the parent run's
        # thread does, and Python's import locks then raised _DeadlockError in one of them (seen
        # in benchmarks/sweep.py: the sweep failed with "its Tune driver raised").
        import mlflow  # noqa: F401

        # The parent run is made beside Tune's start and its proxies' (each proxy waits for it
        # before it submits its trial's job: ``proxy.with_parent_run``): a new SQLite MLflow store's
        # first run took 8 s at a load of 29, as long again as Tune took to start its proxies.
        parent = ParentRun(db_url, sweep)
        # Tune's own CSV, JSON and TensorBoard loggers of each trial's results are not made: the
        # trials' runs are MLflow's, and they were a writer thread per trial in this process.
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
        fn = trainable(sweep_id, db_url, base_dir, log_path)
        path = os.path.join(sweep.storage_path, experiment_name(sweep))
        if tune.Tuner.can_restore(path):
            log.info("sweep %d: restoring its Tune experiment from %s", sweep_id, path)
            tuner = tune.Tuner.restore(path, fn, resume_unfinished=True, resume_errored=True)
        else:
            tuner = tune.Tuner(
                fn, param_space=tune_space(spec),
                tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode,
                                            scheduler=make_scheduler(spec, sweep_id, db_url),
                                            num_samples=spec.num_samples),
                run_config=tune.RunConfig(name=experiment_name(sweep), storage_path=sweep.storage_path,
                                          callbacks=[make_callback(sweep_id, db_url, parent)], verbose=0))
        results = tuner.fit()
        sweep = parent.result()  # raises what its making raised
        wait_for_trials_to_end(store, sweep_id)
        table = trial_table(store, sweep_id, spec)
        best_trial, best_value = best_of(table, spec.mode)
        if best_trial is None:
            errors = sorted({str(r.error).splitlines()[-1] for r in results if r.error})
            why = f"no trial reported {spec.metric}" + (f": {'; '.join(errors)[:400]}" if errors else "")
            store.transition_sweep(sweep_id, SweepState.RUNNING, SweepState.FAILED, actor=ACTOR, reason=why)
            return store.sweep(sweep_id)
        record_outcome(sweep, spec, table, best_trial, best_value)
        try:
            return store.transition_sweep(sweep_id, SweepState.RUNNING, SweepState.FINISHED, actor=ACTOR,
                                          reason=f"{len(results)} trials ended; best {best_trial} "
                                                 f"({spec.metric} {best_value})",
                                          best_trial=best_trial, best_value=best_value)
        except JobStateConflict as exc:
            log.info("sweep %d: its end not recorded: %s", sweep_id, exc)
            return None
    finally:
        store.close()


# How long the sweep's end waits for the jobs of trials Tune ended (an ASHA stop is a cancel, which
# the reconciler carries out at the job's next boundary, or kills past its stop deadline, 120 s).
TRIALS_END_WAIT_S = 300.0


def wait_for_trials_to_end(store: Store, sweep_id: int, timeout_s: float = TRIALS_END_WAIT_S,
                           poll_s: float = 0.5) -> bool:
    """Wait until every trial's job has ended, or is paused (a trial stopped with keep_stopped):
    a sweep is not finished while a stopped trial's job still holds its workers (Tune returns as
    soon as it has stopped following the trial).
    False (and a warning) when some are still live after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = [t.id for t in store.trials(sweep_id) if not (t.state.terminal or t.state is JobState.PAUSED)]
        if not live:
            return True
        if time.monotonic() > deadline:
            log.warning("sweep %d: trial jobs %s still live %.0f s after Tune ended; the sweep's end is "
                        "recorded all the same", sweep_id, live, timeout_s)
            return False
        time.sleep(poll_s)
