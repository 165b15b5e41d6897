"""The Supervisor's decisions, as pure functions of a snapshot.

Owns: the liveness and drain timings (``PING_TIMEOUT_S``, ``LIVENESS_EVERY_S``,
``DRAIN_HANDOVER_MARGIN_S``), the step deadline, when a step may be sent ahead, the failure
budget, which members a layout can use, and how members leave a draining node. Writes nothing:
every function takes what it needs (numbers, spec sections, members with a ``slot``) and returns
a value; the Supervisor carries it out. No Ray, no I/O, no clock of its own (``now`` is passed
in), so a table of named cases tests each one (tests/test_supervisor_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from raytrain_sys.errors import TrainingFailed
from raytrain_sys.spec import ElasticSpec, JobSpec, ParallelSpec

# A worker that does not answer a ping on its control path within this long is lost (stopped,
# or its node vanished). The control path runs in its own thread, so a busy step does not delay
# the answer; the margin is for a loaded machine.
PING_TIMEOUT_S = 3.0
# Members still in a step after this long are pinged this often (see liveness.collect).
LIVENESS_EVERY_S = 1.0
# A draining node's last members keep training while successors start elsewhere, until this
# long before the drain's deadline; then the state goes through a checkpoint instead (a spot
# notice gives 120 s; a checkpoint of a small model takes well under a second).
DRAIN_HANDOVER_MARGIN_S = 20.0
# An automatic lease (train.steps_per_call = 0) carries at most this much work, so that a
# boundary with work arriving (a drain notice, a pause, newcomers) waits at most this long: well
# inside a spot notice (30 s on GCP, 120 s on AWS) and the service's pause goal (checkpoint + 2 s)...
LEASE_S = 1.0
# ... and at most this many steps (the data plane reads two leases ahead of the members).
MAX_LEASE_STEPS = 8


# ------------------------------------------------------------------ timing
def step_deadline_s(step_times: Sequence[float], spec: JobSpec, steps: int = 1) -> float:
    """A call of ``steps`` steps slower than this is hung: a multiple of recent step times,
    with a floor."""
    e = spec.elastic
    if len(step_times) < 3:  # first steps include warm-up: use the generous limit
        return spec.train.step_timeout_s * steps
    times = sorted(step_times)
    return min(spec.train.step_timeout_s * steps,
               max(e.hang_floor_s, e.hang_factor * times[len(times) // 2] * steps))


def lease_steps(step: int, last: int, spec: JobSpec, step_times: Sequence[float]) -> int:
    """How many steps, from ``step`` on, one call to each member carries (a lease).

    The driver pays about the same for a call of one step as for one of eight (a Ray call per
    member, sent and collected): leases share that cost out when steps are short. A lease never
    crosses a boundary with known work (a checkpoint due, the last step), so checkpoints and the
    end fall where they did; work that arrives unannounced (a drain notice, a pause, newcomers)
    waits for the lease's end, which is why an automatic lease holds at most LEASE_S of steps.
    Until three step times are known (warm-up) a lease is one step."""
    room = last - step
    for every in boundary_intervals(spec):
        room = min(room, every - step % every)
    if spec.train.steps_per_call:
        return max(1, min(room, spec.train.steps_per_call))
    if len(step_times) < 3:
        return 1
    times = sorted(step_times)
    fit = int(LEASE_S / max(times[len(times) // 2], 1e-6))
    return max(1, min(room, fit, MAX_LEASE_STEPS))


def boundary_intervals(spec: JobSpec) -> list[int]:
    """Step intervals at whose boundaries work is due (checkpoints, evaluations)."""
    return [e for e in (spec.checkpoint.every_steps, spec.eval.every_steps) if e]


def eval_due(committed_step: int, spec: JobSpec) -> bool:
    """An evaluation runs after every eval.every_steps committed steps (not at step 0)."""
    every = spec.eval.every_steps
    return bool(every) and committed_step > 0 and committed_step % every == 0


@dataclass(frozen=True)
class EarlyStop:
    """``eval.metric`` has not improved for train.early_stop.patience evaluations: stop."""

    reason: str


def early_stop(history: Sequence[float], higher_is_better: bool, patience: int,
               min_delta: float) -> EarlyStop | None:
    """After the newest evaluation in ``history`` (the metric, oldest first): stop when the last
    ``patience`` evaluations did not beat the best one before them by more than ``min_delta``."""
    if not patience or len(history) <= patience:
        return None
    sign = 1.0 if higher_is_better else -1.0
    before = max(sign * v for v in history[:-patience])
    recent = max(sign * v for v in history[-patience:])
    if recent > before + min_delta:
        return None
    best = sign * before
    return EarlyStop(f"early stop: eval metric {sign * recent:.6g} in the last {patience} evaluations "
                     f"did not improve on {best:.6g} by more than {min_delta:g}")


def is_better(value: float, best: float | None, higher_is_better: bool) -> bool:
    """A new best: strictly better than the best so far (the first evaluation always is)."""
    if best is None:
        return True
    return value > best if higher_is_better else value < best


def collective_timeout_s(step_deadline_s: float) -> float:
    """The timeout of the workers' collectives during a step: just past the moment the
    Supervisor acts on a hung or silent member. A peer whose machine vanished closes no socket;
    without this, the survivors would wait in their all-reduce for the timeout the group was
    formed with (minutes) and be given up as lost too, leaving only the checkpoint."""
    return step_deadline_s + LIVENESS_EVERY_S + PING_TIMEOUT_S


# ------------------------------------------------------------------ run-ahead
def run_ahead_hold(step: int, last: int, spec: JobSpec, world_size: int, target_size: int) -> str:
    """Why step ``step`` may not be sent before the one before it is committed ("" when nothing
    in the boundary between them needs it): sending early must change nothing but the time.
    The drain lookup, the one part that needs the cluster, is the Supervisor's
    (``Supervisor._may_run_ahead``), and only when this returns ""."""
    if not spec.train.run_ahead:
        return "train.run_ahead is off"
    if step >= last:
        return "the last step"
    every = spec.checkpoint.every_steps
    if every and step % every == 0:
        return "a checkpoint is due at the boundary"
    if eval_due(step, spec):
        return "an evaluation is due at the boundary"
    if world_size < target_size:
        return "the boundary may take newcomers in"
    return ""


# ------------------------------------------------------------------ failure budget
@dataclass(frozen=True)
class Continue:
    """The failure is within elastic.max_failures per elastic.failure_window_s: recover."""


@dataclass(frozen=True)
class Stop:
    """Too many failures: stop the run (saving the committed state first), for ``reason``."""

    reason: str


def failure_budget(failure_times: Sequence[float], now: float, elastic: ElasticSpec,
                   reason: str) -> tuple[list[float], Continue | Stop]:
    """Count a membership failure seen at ``now`` (unix seconds): the failure times still in
    the window (this one included) and the decision."""
    kept = [t for t in failure_times if now - t < elastic.failure_window_s] + [now]
    if len(kept) > elastic.max_failures:
        return kept, Stop(f"{len(kept)} membership failures within elastic.failure_window_s="
                          f"{elastic.failure_window_s:g} s (elastic.max_failures={elastic.max_failures}); "
                          f"last: {reason}")
    return kept, Continue()


# ------------------------------------------------------------------ world sizes
def target_size(spec: JobSpec, ceiling: int | None = None) -> int:
    """The world the run grows back to: the spec's, under a ``ceiling`` asked for from outside
    (the job service's shrink, ``RunRequests.resize``), never below the minimum world."""
    target = spec.elastic.max_workers or spec.resources.num_workers
    if ceiling is not None:
        target = min(target, max(ceiling, min_world(spec)))
    return target


def shrink_leavers(members: Sequence, target: int) -> list:
    """The members that leave when the world shrinks to ``target``: the highest ranks, so rank
    0 (the one that reports for each data shard first) and the order of the rest stay."""
    return list(members[target:]) if len(members) > target else []


def min_world(spec: JobSpec) -> int:
    """Below this many members the run waits for workers. The parallel degrees set a floor of
    their own: tp x pp ranks hold one copy of the model."""
    return max(1, spec.elastic.min_workers, spec.parallel.world_granularity())


def standby_for_layout(members: Sequence, held: dict[int, int], committed_step: int,
                       parallel: ParallelSpec) -> list:
    """The members the parallel degrees cannot use in the largest usable world, to wait on
    standby for a larger one; holders of the committed step are kept first (then in member
    order). Raises when no usable world exists at all."""
    usable = parallel.usable_world_size(len(members))
    if usable == len(members):
        return []
    if usable == 0:
        raise TrainingFailed(f"{len(members)} workers cannot hold one copy of the model with "
                             f"parallel.tp x parallel.pp = {parallel.tp * parallel.pp}"
                             f"; raise elastic.min_workers to at least that")
    ordered = sorted(members, key=lambda w: held.get(w.slot) != committed_step)
    return ordered[usable:]


def grows(parallel: ParallelSpec, members: int, ready: int) -> bool:
    """Whether ``ready`` newcomers make a larger usable world than ``members``; if not, they
    wait on standby."""
    return parallel.usable_world_size(members + ready) > members


# ------------------------------------------------------------------ drains
@dataclass(frozen=True)
class Leave:
    """Enough members stay: the draining ones leave at this boundary."""


@dataclass(frozen=True)
class HandOver:
    """Too few would stay, but ready newcomers make up the difference: they join and take the
    state over in memory, then the draining members leave."""


@dataclass(frozen=True)
class TrainOn:
    """Too few would stay and the notice leaves time: keep training on the draining node while
    ``request`` more replacements start elsewhere."""

    request: int


@dataclass(frozen=True)
class SaveThenLeave:
    """Too few would stay and time is short: save a checkpoint, then leave."""


DrainPlan = Leave | HandOver | TrainOn | SaveThenLeave


def drain_floor(elastic: ElasticSpec) -> int:
    """Fewer members than this cannot carry the run once a drained node's members leave."""
    return max(1, elastic.min_workers)


def drain_plan(staying: int, ready: int, pending: int, need: int,
               deadline_unix_s: float | None, now_unix_s: float) -> DrainPlan:
    """How members on nodes marked for preemption leave, with no step lost. ``staying``:
    members not on a draining node; ``ready``: newcomers up and not on one (looked up only when
    fewer than ``need``, the ``drain_floor``, stay); ``pending``: replacements still starting;
    ``deadline_unix_s``: the earliest drain deadline of the leaving members (None: none)."""
    if staying >= need:
        return Leave()
    if staying + ready >= need:
        return HandOver()
    if deadline_unix_s is None or deadline_unix_s - now_unix_s > DRAIN_HANDOVER_MARGIN_S:
        return TrainOn(request=max(0, need - staying - pending))
    return SaveThenLeave()
