"""Tune's scheduler and callback of a sweep: where Tune's decisions reach the service.

Owns: the scheduler Tune runs the sweep with (``make_scheduler``: ASHA, whose stop is carried out
at its decision; synchronous PBT; FIFO) and the callback that turns Tune's decisions into service
actions (``make_callback``): a trial's end becomes a stop of its job (``stops.stop_trial_job``),
and each rung a trial passes (ASHA's milestones reached while it runs on: ``rungs_passed``) is
written to its job's ``rung``, so the scheduler grows it before trials that passed fewer.
Importing it imports no Ray Tune: the classes are made in the functions.
"""

from __future__ import annotations

import logging
from typing import Optional

from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.spec import SweepSpec, pbt_mutations, spec_of
from raytrain_sys.service.sweeps.stops import STOPPED, stop_trial_job
from raytrain_sys.service.sweeps.tracking import ParentRun

log = logging.getLogger(__name__)


def rungs_passed(step: int, grace: int, factor: int, max_t: int) -> int:
    """ASHA's milestones (grace, grace x factor, ...) below max_t that a trial reporting ``step``
    has reached: it was promoted past each one it runs on from."""
    rung, milestone = 0, grace
    while milestone < max_t and step >= milestone:
        rung += 1
        milestone *= factor
    return rung


def make_callback(sweep_id: int, db_url: str, parent: Optional[ParentRun] = None):
    """The Tune callback that turns Tune's decisions into service actions (a class made here so
    that importing this module does not import Ray Tune); with ``parent``, it ends the
    experiment (raising) at Tune's next step once making the parent run failed: the proxies
    would wait for it. Tune pickles the callback (and its class, made here: no closure over
    ``parent``, whose thread would not pickle)."""
    from ray.tune import Callback

    class ServiceActions(Callback):
        def __init__(self):
            self._store: Optional[Store] = None
            self._rungs: dict[str, int] = {}
            self._parent: Optional[ParentRun] = None

        def on_step_begin(self, iteration, trials, **info):
            if self._parent is not None and self._parent.error is not None:
                raise self._parent.error

        @property
        def store(self) -> Store:
            if self._store is None:
                self._store = Store.open(db_url)
            return self._store

        def __getstate__(self):  # Tune pickles its callbacks with the experiment: no open store, no thread
            return {"_store": None, "_rungs": dict(self._rungs), "_parent": None}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            log.info("trial %s: %s at step %s (job %s, checkpoint step %s)", trial.trial_id,
                     {k: v for k, v in result.items() if k.startswith("eval_")}, result.get("step"),
                     result.get("job_id"), result.get("checkpoint_step"))
            spec = spec_of(self.store.sweep(sweep_id))
            if spec.scheduler.type != "asha":
                return
            rung = rungs_passed(int(result.get("step", 0)), spec.scheduler.grace_period_steps,
                                spec.scheduler.reduction_factor, spec.max_steps)
            if rung > self._rungs.get(trial.trial_id, 0) and "job_id" in result:
                self._rungs[trial.trial_id] = rung
                self.store.set_rung(int(result["job_id"]), rung)

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._ended(trial, STOPPED)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._ended(trial, "its trial proxy failed")

        def _ended(self, trial, why: str) -> None:
            step = int(trial.last_result["step"]) if trial.last_result and "step" in trial.last_result else None
            stop_trial_job(self.store, sweep_id, trial.trial_id, step, why)

    actions = ServiceActions()
    actions._parent = parent
    return actions


def make_scheduler(spec: SweepSpec, sweep_id: Optional[int] = None, db_url: str = ""):
    """Tune's scheduler of the sweep. ASHA's stops are carried out at its decision
    (``stops.stop_trial_job``, with ``sweep_id`` and ``db_url``): Tune would end the trial only after
    the result's checkpoint (a pointer, at a checkpoint step) is saved."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    s = spec.scheduler
    if s.type == "asha":
        if sweep_id is None:
            return ASHAScheduler(time_attr="step", max_t=spec.max_steps, grace_period=s.grace_period_steps,
                                 reduction_factor=s.reduction_factor)

        class StopsAtDecision(ASHAScheduler):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self._store: Optional[Store] = None

            def __getstate__(self):  # pickled with the Tuner: no open store
                return {**self.__dict__, "_store": None}

            def on_trial_result(self, tune_controller, trial, result):
                decision = super().on_trial_result(tune_controller, trial, result)
                if decision == self.STOP:
                    if self._store is None:
                        self._store = Store.open(db_url)
                    stop_trial_job(self._store, sweep_id, trial.trial_id, result.get("step"), STOPPED)
                return decision

        return StopsAtDecision(time_attr="step", max_t=spec.max_steps, grace_period=s.grace_period_steps,
                               reduction_factor=s.reduction_factor)
    if s.type == "pbt":
        # Synchronous: the population is ranked once every trial has reached the interval, so every
        # trial ranked in the upper quantile holds a checkpoint (a trial waiting for the others is
        # paused with its newest pointer). Tune's asynchronous PBT gives a trial a checkpoint only if
        # it ranked in the upper quantile when it itself reached the interval, and skips an exploit
        # from a donor that ranked first, alone ("Skip exploit"). Pausing a proxy pauses no job.
        return PopulationBasedTraining(time_attr="step", perturbation_interval=s.perturbation_interval_steps,
                                       hyperparam_mutations=pbt_mutations(spec), quantile_fraction=s.quantile_fraction,
                                       resample_probability=s.resample_probability, synch=True)
    return FIFOScheduler()
