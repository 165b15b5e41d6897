"""Tune's end of a trial as a service action on the trial's job.

Owns: what Tune's end of a trial (ASHA's stop, or its proxy's failure) does to the trial's job
(``stop_action``, pure: a cancel, a held pause with ``keep_stopped``, or nothing) and carrying it
out (``stop_trial_job``): the request written to the store (through ``requests``, as a user
would), told to the job's runner at once (``tell_runner``), and the service's reconciler woken
(``wake_service``), whose pass gives the workers to the next trial or grows the survivors.
Called by Tune's callback and by ASHA's decision (``scheduler``).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import ray

from raytrain_sys.control.spares import NAMESPACE
from raytrain_sys.errors import JobStateConflict
from raytrain_sys.service import requests
from raytrain_sys.service.model import JobRecord, JobState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.segments import newest_segment
from raytrain_sys.service.sweeps.spec import spec_of

log = logging.getLogger(__name__)

STOPPED = "stopped by the sweep's scheduler"


def stop_action(state: JobState, step: Optional[int], max_steps: int, keep_stopped: bool) -> Optional[str]:
    """What Tune's end of a trial (ASHA's stop, or its proxy's failure) does to the trial's job,
    last reported at ``step``: "cancel", "pause" (``keep_stopped``: held, resumable), or None.
    None when the job has ended or is being stopped so already (the stop is carried out at
    ASHA's decision and again when Tune ends the trial), and when the trial reached ``max_steps``
    (ASHA ends every trial at max_t: its job is finishing on its own, and a cancel would skip its
    last checkpoint)."""
    if state.terminal or state is JobState.CANCELLING:
        return None
    if keep_stopped and state in (JobState.PAUSING, JobState.PAUSED):
        return None
    if step is not None and step >= max_steps:
        return None
    return "pause" if keep_stopped else "cancel"


def stop_trial_job(store: Store, sweep_id: int, trial_id: str, step: Optional[int], why: str) -> None:
    """Carry out ``stop_action`` on the trial's newest job, and wake the service's reconciler:
    the next scheduling pass gives the job's workers to another trial now, not at its period."""
    job = newest_segment(store.trials(sweep_id), trial_id)
    if job is None:
        return  # never submitted
    spec = spec_of(store.sweep(sweep_id))
    action = stop_action(job.state, step, spec.max_steps, spec.keep_stopped)
    if action is None:
        return
    at = f" at step {step}" if step is not None else ""
    by = f"sweep {sweep_id}"
    try:
        if action == "pause":
            stopping = requests.pause(store, job.id, by=by, reason=f"{why}{at} (keep_stopped)")
        else:
            stopping = requests.cancel(store, job.id, by=by, reason=f"{why}{at}")
    except JobStateConflict as exc:  # it ended or was held meanwhile
        log.info("trial %s: %s", trial_id, exc)
        return
    log.info("trial %s: job %d %s: %s%s", trial_id, job.id, "paused" if action == "pause" else "cancelled", why, at)
    if job.state is JobState.RUNNING and stopping.state in (JobState.PAUSING, JobState.CANCELLING):
        tell_runner(stopping, by)
    wake_service()


# How long telling a stop to a spare runner waits for the spares to say which job each runs.
TELL_RUNNER_SPARE_WAIT_S = 1.0


def tell_runner(job: JobRecord, by: str) -> None:
    """The stop the store now holds (pausing or cancelling), told to the running job's runner at
    once, in the background: the reconciler's pass tells it too (the runner's pause and cancel
    are idempotent), but under load a pass comes 0.8-2 s after the wake (sweep.py, 2026-11-28:
    the store's cancel to the runner's hearing it), while the trial's job trains on."""
    def tell() -> None:
        from raytrain_sys.service.runner import ask_to_stop, find_runner

        try:
            handle = find_runner(job.id, spare_wait_s=TELL_RUNNER_SPARE_WAIT_S)
            if handle is not None:
                ask_to_stop(handle, job, by)
        except Exception as exc:  # noqa: BLE001: the reconciler's pass tells it anyway
            log.debug("job %d: stop not told to its runner at once: %s", job.id, exc)

    threading.Thread(target=tell, name=f"tell-runner-{job.id}", daemon=True).start()


def wake_service() -> None:
    """Ask the job service for a reconciler pass now (a request written through another
    process's store does not wake it); nothing when no service runs (``raytrain-sys sweep``)."""
    from raytrain_sys.service.names import SERVICE_NAME

    try:
        ray.get_actor(SERVICE_NAME, namespace=NAMESPACE).wake.remote()
    except Exception as exc:  # noqa: BLE001: no service, or one without wake: its next pass comes at its period
        log.debug("no service to wake: %s", exc)
