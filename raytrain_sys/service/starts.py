"""How a start is going: why a starting or resuming job is not running yet, and when to give its
start up.

Owns: the wait reason of a job in starting or resuming (its ``WaitCause`` and sentence, from the
step its runner reports: ``JobRunner.status().start_step``), and the decision to give a start
up: ``watch_start`` returns ``Starting`` (still going: here is why it is not running) or
``GiveUp`` (back to the queue, or failed once ``max_start_returns`` starts in a row were given
up); ``give_up`` is the same decision for a start the run itself abandoned (its workers could
not be placed within ``resources.start_timeout_s``: ``service/finish.py`` asks it). The reconciler
carries them out (kill the runner, then one guarded transition) and writes the reasons. Pure: no
Ray, no store, no clock.

A start's steps, as the runner reports them, and the cause each one shows:

=============  ================  =====================================================
runner step    cause             what it waits for
=============  ================  =====================================================
(admitted)     provisioning      autoscaling: its nodes, until its workers are placed
(no answer)    runner_start      its runner process (a Ray actor) to start and answer
supervisor     runner_start      its runner to build the run (the spec; a resume's record)
preparing      run_start         pre-flight checks, the Ray connection, the first data reads
placement      placement         the cluster to place its workers' slots (placement groups)
workers        worker_start      worker processes, the MLflow run, the process group, 1st batch
restore        restore           its checkpoint to load (a resume)
=============  ================  =====================================================

A job admitted against capacity being provisioned (autoscaling: ``Admit.provisioning``) shows
``provisioning`` from its admission until its workers are placed (the runner's steps up to
``placement`` included: the nodes are coming), bounded by the service's
``provisioning_timeout_s`` (minutes: a cloud's node start), never by ``start_stall_s``; its run
waits as long for its placement (its ``resources.start_timeout_s`` is set to it at launch).
Past it, the start is given up like any other (back to the queue, counted in
``max_start_returns``): a job never bounces between queued and starting while its nodes come.

"No progress" is a start that stays in one cause longer than ``start_stall_s``: the cause's
since (stored with the job) or, when later, the moment this service began watching the start (a
service restart gives every start a fresh bound: the time the service was away is not the
start's). A restore is not bounded here: loading a large checkpoint is the run's own work, and it
fails by itself when its storage does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from raytrain_sys.service.model import JobState, WaitCause

STEP_CAUSES = {
    "supervisor": WaitCause.RUNNER_START,
    "preparing": WaitCause.RUN_START,
    "placement": WaitCause.PLACEMENT,
    "workers": WaitCause.WORKER_START,
    "restore": WaitCause.RESTORE,
}
BOUNDED = frozenset({WaitCause.RUNNER_START, WaitCause.RUN_START, WaitCause.PLACEMENT, WaitCause.WORKER_START})
# The runner's steps before its workers are placed: a provisioning start stays "provisioning" through them.
BEFORE_PLACED = frozenset({None, "supervisor", "preparing", "placement"})
NO_ANSWER = "its runner has not answered yet (a Ray actor being created: its process starts and imports torch)"


@dataclass(frozen=True)
class StartView:
    """What the reconciler knows of one start: the job as stored, and since when it watches it."""

    state: JobState  # starting or resuming
    workers: int  # admitted (its target)
    checkpoint_step: Optional[int]  # the newest committed checkpoint (what a resume loads)
    cause: Optional[WaitCause]  # the reason stored with the job
    reason: Optional[str]
    since_s: Optional[float]  # the stored cause's since, or when this service first watched it if later
    start_returns: int  # starts given up in a row before this one


@dataclass(frozen=True)
class Starting:
    """The start goes on; this is why it is not running yet."""

    cause: WaitCause
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """End this start: back to where the job waited (queued, or paused for a resume), or failed."""

    to: JobState
    cause: WaitCause
    reason: str
    start_returns: int  # the job's count after this one


def admitted_reason(workers: int, provisioning_timeout_s: Optional[float] = None) -> str:
    """A just-admitted job's reason, written with its admission (its runner is being made); with
    ``provisioning_timeout_s``: admitted against capacity being provisioned."""
    n = f"{workers} worker{'' if workers == 1 else 's'}"
    if provisioning_timeout_s is not None:
        return (f"admitted on {n} against capacity being provisioned: waiting for the autoscaler's nodes "
                f"(at most {provisioning_timeout_s / 60:g} min, provisioning_timeout_s)")
    return f"admitted on {n}: its runner is starting"


def step_reason(step: str, view: StartView, max_start_returns: int) -> Starting:
    """Why the start is not running yet at ``step`` (a runner's ``start_step``)."""
    cause = STEP_CAUSES.get(step)
    if cause is None:
        raise ValueError(f"unknown start step {step!r} (known: {', '.join(STEP_CAUSES)})")
    n = f"{view.workers} worker{'' if view.workers == 1 else 's'}"
    reason = {
        "supervisor": ("its runner is building the run (finding its checkpoint to resume)"
                       if view.state is JobState.RESUMING else "its runner is building the run"),
        "preparing": "the run is preparing: pre-flight checks, the Ray connection, its first data reads",
        "placement": f"waiting for the cluster to place its {n}: Ray has not found room for them yet",
        "workers": f"its {n} {'is' if view.workers == 1 else 'are'} placed and starting: worker processes, "
                   f"the MLflow run, the process group, the first batch",
        "restore": ("loading its checkpoint" + (f" at step {view.checkpoint_step}"
                                                 if view.checkpoint_step is not None else "")),
    }[step]
    if view.start_returns:
        reason += f" (start {view.start_returns + 1} of at most {max_start_returns + 1})"
    return Starting(cause, reason)


def watch_start(view: StartView, step: Optional[str], now_s: float, start_stall_s: float,
                max_start_returns: int, provisioning_timeout_s: float = 600.0) -> Union[Starting, GiveUp]:
    """How a start is going, given the step its runner reports (None: it did not answer this
    pass, so the stored reason stands): ``Starting`` with its reason, or ``GiveUp`` when it has
    stayed in one bounded cause for ``start_stall_s`` (``provisioning_timeout_s`` for
    ``provisioning``, which lasts until its workers are placed)."""
    if view.cause is WaitCause.PROVISIONING and step in BEFORE_PLACED:
        now = Starting(WaitCause.PROVISIONING, view.reason or admitted_reason(view.workers, provisioning_timeout_s))
    elif step is None:
        now = Starting(view.cause or WaitCause.RUNNER_START, view.reason or NO_ANSWER)
    else:
        now = step_reason(step, view, max_start_returns)
    bound, name = ((provisioning_timeout_s, "provisioning_timeout_s") if now.cause is WaitCause.PROVISIONING
                   else (start_stall_s, "start_stall_s"))
    bounded = now.cause in BOUNDED or now.cause is WaitCause.PROVISIONING
    stalled = bounded and now.cause is view.cause and view.since_s is not None and now_s - view.since_s >= bound
    if not stalled:
        return now
    what = "its nodes did not come" if now.cause is WaitCause.PROVISIONING else "no progress"
    return give_up(view.state, view.start_returns, now.cause, f"{now.reason}: {what} for {bound:g} s ({name})",
                   max_start_returns)


def give_up(state: JobState, start_returns: int, cause: WaitCause, why: str, max_start_returns: int) -> GiveUp:
    """End a start of a job in ``state`` (starting or resuming) after ``start_returns`` starts in
    a row given up: back to the queue (a resume: to paused) while fewer than
    ``max_start_returns`` were, else failed. Never a bounce forever."""
    returns = start_returns + 1
    if start_returns >= max_start_returns:
        return GiveUp(JobState.FAILED, cause, f"could not start: {why}; {returns} starts in a row given up "
                                              f"(max_start_returns {max_start_returns})", returns)
    back = JobState.PAUSED if state is JobState.RESUMING else JobState.QUEUED
    return GiveUp(back, cause, f"{why}; back in the queue ({returns} of {max_start_returns} returns before "
                               f"it fails)", returns)


__all__ = ["StartView", "Starting", "GiveUp", "STEP_CAUSES", "BOUNDED", "admitted_reason", "step_reason",
           "watch_start", "give_up"]
