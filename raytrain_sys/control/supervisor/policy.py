"""The Supervisor's decisions, as pure functions of a snapshot.

Owns: the liveness and drain timings (``PING_TIMEOUT_S``, ``LIVENESS_EVERY_S``,
``DRAIN_HANDOVER_MARGIN_S``), the step deadline, the lease size, when a checkpoint or an
evaluation is due, the plan of a step boundary (``plan``: facts in, an ordered list of typed
items out; run-ahead is the same plan being empty), how a run ends, the failure budget, which
members a layout can use, and how members leave a draining node. Writes nothing:
every function takes what it needs (numbers, spec sections, members with a ``slot``) and returns
a value; the Supervisor carries it out. No Ray, no I/O, no clock of its own (``now`` is passed
in), so a table of named cases tests each one (tests/test_supervisor_policy.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from raytrain_sys.control.supervisor.requests import CANCEL, StopRequest
from raytrain_sys.errors import TrainingFailed
from raytrain_sys.spec import ElasticSpec, JobSpec, ParallelSpec

# A worker that does not answer a ping on its control path within this long is lost (stopped,
# or its node vanished). The control path runs in its own thread, so a busy step does not delay
# the answer; the margin is for a loaded machine.
PING_TIMEOUT_S = 3.0
# With peer copies on, a member still blocked this long after the lost were killed, while another
# member is out of the step, is lost too (its copies and snapshot are taken first: Membership.
# rescue): a pipeline neighbour of a rank whose collective broke waits on a socket that stays
# open, up to the collective timeout. Members all blocked are waited for (liveness.collect).
BLOCKED_WITH_COPIES_S = 5.0
# The step deadline (``step_deadline_s``) is learned once this many steady steps are known; until
# then a step has train.step_timeout_s (the run's first steps: warm-up, compilation).
DEADLINE_SAMPLES = 3
# A process group's first steps are longer (DDP's buckets are rebuilt after its first backward,
# lazy initialisations): not samples of the deadline, and given NEW_GROUP_DEADLINE_FACTOR times it.
GROUP_WARMUP_STEPS = 2
NEW_GROUP_DEADLINE_FACTOR = 3.0
# The spread of step times the deadline allows for is at least this share of their median: the
# step times it learns from are a lease's mean (its steps' spread averaged away), and a single
# step varies more.
SPREAD_FLOOR = 0.1
# Members still in a step after this long are pinged this often (see liveness.collect).
LIVENESS_EVERY_S = 1.0
# A running lease is looked at this often for a boundary come due (a pause, a resize, newcomers
# up, a straggler's verdict; drains are looked up every elastic.drain_poll_s): a cut then ends
# it at the end of the step in flight. Each look costs the driver about 0.3 ms (the facts
# gathered, the plan made), so four a second; drains are looked up once a second anyway.
BOUNDARY_POLL_S = 0.25
# The straggler window takes a running lease's reported steps this often (and at its end).
OBSERVE_EVERY_S = 1.0
# A draining node's last members keep training while successors start elsewhere, until this
# long before the drain's deadline; then the state goes through a checkpoint instead (a spot
# notice gives 120 s; a checkpoint of a small model takes well under a second).
DRAIN_HANDOVER_MARGIN_S = 20.0
# An automatic lease (train.steps_per_call = 0) carries at most this much work. Not for a
# boundary's sake (a drain, a pause or newcomers cut a lease short: ``boundary_due``), but
# because steps are committed, and recorded (on_step, MLflow, summary.json), at a lease's end:
# what a user watching the run sees is at most this old...
LEASE_S = 10.0
# ... and at most this many steps: the global batches of two leases (the running one and the
# one sent ahead) are referenced in the object store at once, and their references travel in
# the lease's calls.
MAX_LEASE_STEPS = 1000
# summary.json's refresh in the step loop (at every train.log_every_steps-th step) takes at most
# this share of the loop's time: the record grows with the ranks (rank_times_history: up to 500
# entries of N ranks each; a write encodes only what changed, 11 ms at 64 ranks and 70 ms at 512
# with 20,000 steps), and a lease's steps commit together, each tenth one asking for a write.
# The Supervisor's budget at 64 workers is 0.5% of a step (issue 26); this is a fifth of it. Live
# progress goes elsewhere (on_step, MLflow, Prometheus, the service's runner); the record is
# read once a run ended, and written at every transition and at the end regardless.
SUMMARY_SHARE = 0.001
# The per-rank step metrics (rank<r>/<part>: five a rank) go to MLflow at a rank_times refresh
# (every train.log_every_steps) at most this many a second on average: each is a row in MLflow's
# store and a part of a request its writer sends. Two ranks' ten at each refresh of steps of
# 0.1 s; at 512 ranks and GPT-2 small's steps (a refresh every 0.36 s) sending all would be
# 7,000 a second, so they go every 26 s. summary.json's rank_times and the straggler events
# are refreshed at every one regardless.
RANK_METRICS_PER_S = 100.0
# Leases through the node agents (control/node_agent.py: a lease to a node's ranks in one call
# from the driver) in automatic mode (RAYTRAIN_NODE_AGENTS=auto, the default), from this many
# members on: at 16 and 32 paced stand-ins they saved nothing at the automatic lease
# (benchmarks/control_plane.py, 2026-11-27), at 64 a third of the driver's CPU (2026-12-07), and
# on runs of 2-4 ranks the extra hop cost 25% of their wall time (2026-12-07).
NODE_AGENTS_FROM = 32


# ------------------------------------------------------------------ timing
def summary_due(now: float, last_end: float, last_cost_s: float) -> bool:
    """Whether the step loop rewrites summary.json now (a train.log_every_steps step): once the
    time since the last write ended is at least that write's cost over SUMMARY_SHARE, so that
    the refresh stays under that share of the loop whatever the number of ranks or the run's
    length (a record of 2 ms: every 2 s); transitions and the run's end write it regardless."""
    return now - last_end >= last_cost_s / SUMMARY_SHARE


def rank_metrics_due(now: float, last_sent: float, metrics: int) -> bool:
    """Whether a rank_times refresh sends its ``metrics`` per-rank metrics to MLflow: once the
    time since the last send is at least what they take of RANK_METRICS_PER_S."""
    return now - last_sent >= metrics / RANK_METRICS_PER_S


def node_agents_on(mode: str, members: int, node_run: int) -> bool:
    """Whether a run of ``node_run`` ranks on one node (members 1.., rank 0's call being the
    driver's), in a group of ``members``, gets its leases through the node's agent: ``mode`` on
    (every run) or off, or auto: from NODE_AGENTS_FROM members on, a run of at least two ranks
    (for one, the agent's call would only stand for the driver's one call)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"RAYTRAIN_NODE_AGENTS={mode!r}: auto, on or off (or 1 or 0)")
    return mode == "on" or (mode == "auto" and members >= NODE_AGENTS_FROM and node_run > 1)


def step_deadline_s(step_times: Sequence[float], spec: JobSpec, steps: int = 1, new_group: bool = False) -> float:
    """A call of ``steps`` steps that makes no progress for longer than this is hung: learned
    from the job's own steady step times (``step_times``: ``steady_step``'s samples), the median
    plus elastic.hang_factor spreads (a robust sigma: 1.4826 median absolute deviations, at
    least SPREAD_FLOOR of the median, so steps as regular as a clock still get twice their
    median at the default factor of 10), never under elastic.hang_floor_s (a machine's hiccups:
    a stall of seconds under load is no hang; a job whose steps are legitimately long raises it)
    and never over train.step_timeout_s. Until DEADLINE_SAMPLES steady steps are known (the
    run's first steps: warm-up, compilation), train.step_timeout_s; ``new_group``: a process
    group's first steps (GROUP_WARMUP_STEPS), known to be longer, get NEW_GROUP_DEADLINE_FACTOR
    times the deadline."""
    e, cap = spec.elastic, spec.train.step_timeout_s * steps
    if len(step_times) < DEADLINE_SAMPLES:
        return cap
    median = statistics.median(step_times)
    spread = max(SPREAD_FLOOR * median, 1.4826 * statistics.median(abs(t - median) for t in step_times))
    deadline = max(e.hang_floor_s, steps * (median + e.hang_factor * spread))
    return min(cap, deadline * (NEW_GROUP_DEADLINE_FACTOR if new_group else 1.0))


def steady_step(group_steps: int, after_pause: bool) -> bool:
    """Whether a committed step teaches the deadline (``step_deadline_s``) its job's step time:
    not a process group's first GROUP_WARMUP_STEPS steps (DDP builds its buckets again, lazy
    initialisations run), nor the steps of the lease right after a checkpoint or an evaluation
    (``after_pause``: caches cold, a background write beside it), which are known to be longer."""
    return group_steps > GROUP_WARMUP_STEPS and not after_pause


def lease_steps(step: int, last: int, spec: JobSpec, step_times: Sequence[float],
                ready_steps: int | None = None, group_steps: int | None = None) -> int:
    """How many steps, from ``step`` on, one call to each member carries (a lease).

    The driver pays about the same for a call of one step as for one of many (a Ray call per
    member, sent and collected): leases share that cost out. A lease never crosses a boundary
    with known work (a checkpoint or an evaluation due, the last step), so checkpoints and the
    end fall where they did; work that arrives unannounced (a drain notice, a pause, newcomers)
    cuts it short. An automatic lease holds what fits in LEASE_S, at most MAX_LEASE_STEPS, and
    no more steps than the data plane has read (``ready_steps``; at least one), so that sending
    it never waits on reads. Until three step times are known, and for the first three steps of
    a group just formed (``group_steps``: a rebuild, a resize; its first steps rebuild DDP's
    buckets), a lease is one step: a warm-up, and a recovered group confirmed by a commit soon."""
    room = last - step
    for every in boundary_intervals(spec):
        room = min(room, every - step % every)
    if spec.train.steps_per_call:
        return max(1, min(room, spec.train.steps_per_call))
    if len(step_times) < 3 or (group_steps is not None and group_steps < 3):
        return 1
    times = sorted(step_times)
    fit = int(LEASE_S / max(times[len(times) // 2], 1e-6))
    read = MAX_LEASE_STEPS if ready_steps is None else ready_steps
    return max(1, min(room, fit, MAX_LEASE_STEPS, read))


def boundary_intervals(spec: JobSpec) -> list[int]:
    """Step intervals at whose boundaries work is due (checkpoints, evaluations): where
    ``checkpoint_due`` and ``eval_due`` can be true."""
    return [e for e in (spec.checkpoint.every_steps, spec.eval.every_steps) if e]


def checkpoint_due(step: int, last: int, spec: JobSpec) -> bool:
    """A periodic checkpoint is due after ``step`` committed steps: every checkpoint.every_steps,
    before the last step (the end has its own save: ``ending``)."""
    every = spec.checkpoint.every_steps
    return bool(every) and step % every == 0 and 0 < step < last


def eval_due(committed_step: int, spec: JobSpec) -> bool:
    """An evaluation runs after every eval.every_steps committed steps (not at step 0)."""
    every = spec.eval.every_steps
    return bool(every) and committed_step > 0 and committed_step % every == 0


def evaluation_due(step: int, spec: JobSpec) -> bool:
    """An evaluation is due at a boundary: every eval.every_steps, and at train.max_steps."""
    return eval_due(step, spec) or step == spec.train.max_steps


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
    """Why step ``step`` may not be sent before the one before it is committed ("" when it may),
    from these numbers alone (no drain, request or newcomer known): the boundary plan's own
    answer (``hold_reason``), which the Supervisor asks with every fact it has."""
    facts = Facts(step, last, members=tuple(Member(i) for i in range(world_size)), target=target_size,
                  just_committed=True, evaluates=bool(spec.eval.every_steps))
    return hold_reason(facts, spec)


@dataclass(frozen=True)
class Ending:
    """How a run whose step loop ended ends: ``save`` the committed step first (if not saved
    yet), then ``state`` ("finished", "stopped" or "cancelled") for ``reason``."""

    save: bool
    state: str
    reason: str


def ending(committed_step: int, spec: JobSpec, stop: StopRequest | None, early_stop: str) -> Ending:
    """The end of a run whose step loop ended at ``committed_step``: ``stop`` the pause or cancel
    asked for (``RunRequests.stop``, or None), ``early_stop`` the reason train.early_stop gave
    (""). A pause saves (resumable from there), a cancel adds no checkpoint, otherwise
    checkpoint.save_on_exit decides; a run that reached train.max_steps is finished even if a
    stop was asked for meanwhile."""
    cancelled = stop is not None and stop.how == CANCEL
    save = not cancelled and (spec.checkpoint.save_on_exit or stop is not None)
    if early_stop and stop is None:
        return Ending(save, "finished", early_stop)
    if committed_step < spec.train.max_steps and stop is not None:
        return Ending(save, "cancelled" if cancelled else "stopped",
                      f"{stop.describe()} (at step {committed_step})")
    if committed_step < spec.train.max_steps:
        return Ending(save, "stopped", f"paused at train.stop_at_step={spec.train.stop_at_step}")
    return Ending(save, "finished", f"reached train.max_steps={spec.train.max_steps}")


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


# ------------------------------------------------------------------ the step boundary's plan
# What happens between two steps is decided here, once: the Supervisor gathers ``Facts`` (what
# the boundary's decisions depend on), asks ``plan`` and carries the items out; it plans, carries
# out the first item and plans again on the facts as they now are (an item carried out is in
# ``Facts.tried`` and not planned again at that boundary) until the plan is empty or says
# ``StopTraining``. Run-ahead asks the same function about the boundary it would skip
# (``hold_reason``): the lease after the running one is sent early only when the plan for the
# boundary between them is empty, so a prediction and the action it predicts cannot disagree.
#
# Order of a plan (each part only when its facts call for it): a checkpoint and an evaluation
# due at a step just committed; the end of the step loop (the last step, a pause or cancel asked
# for, an early stop), after which nothing else is planned; a straggler's replacement; newcomers
# on draining nodes let go, then the members there (``drain_plan``); a shrink to a requested
# ceiling, or newcomers beyond the target let go; below the target, replacements asked for and
# the ready newcomers taken in (``grows``) or benched.

# ------------------------------------------------------------------ what a boundary knows
@dataclass(frozen=True)
class Member:
    """A worker as the plan sees it: its slot and its node ("" while unknown: still starting)."""

    slot: int
    node_id: str = ""


@dataclass(frozen=True)
class Facts:
    """Everything a boundary's plan depends on, gathered once (``Supervisor._facts``)."""

    step: int  # committed steps at the boundary
    last: int  # the step loop ends here (train.max_steps, or train.stop_at_step)
    members: tuple[Member, ...] = ()  # rank order
    target: int = 0  # the world the run grows back to (target_size, under a ceiling)
    ceiling_reason: str = ""  # why a ceiling was asked for (RunRequests.resize)
    pending: tuple[Member, ...] = ()  # newcomers still starting
    ready: tuple[Member, ...] = ()  # newcomers up (on standby or just started), not members
    draining: tuple[tuple[str, float | None], ...] = ()  # (node, drain deadline in unix s or None)
    training_on: frozenset[str] = frozenset()  # draining nodes already told to train on (TrainOn)
    straggler: tuple[int, str] | None = None  # (slot, why): to replace (elastic.straggler_policy)
    redeal: tuple[int, ...] | None = None  # rows per data index a straggler's rebalance asks for
    stop: StopRequest | None = None  # a pause or cancel asked for from outside
    early_stop: str = ""  # why train.early_stop ended the run ("" while it has not)
    just_committed: bool = False  # steps were committed since the boundary before
    saved: bool = False  # a checkpoint of ``step`` exists
    evaluates: bool = False  # the run has an evaluation set (eval.every_steps)
    tried: frozenset[str] = frozenset()  # item kinds already carried out at this boundary
    now_unix_s: float = 0.0

    @cached_property  # asked once per member by the plan: made once (frozen: set in __dict__ directly)
    def drain_deadlines(self) -> dict[str, float | None]:
        return dict(self.draining)


# ------------------------------------------------------------------ what a boundary does
@dataclass(frozen=True)
class Checkpoint:
    """Save the committed step (checkpoint.every_steps); ``background``: checkpoint.async_save."""

    background: bool
    reason: str


@dataclass(frozen=True)
class Evaluate:
    """Evaluate the committed state (eval.every_steps, and at train.max_steps)."""

    reason: str


@dataclass(frozen=True)
class StopTraining:
    """End the step loop at this boundary; how the run ends is ``ending``."""

    reason: str


@dataclass(frozen=True)
class ReplaceStraggler:
    """A slow member leaves as from a draining node; a replacement is requested."""

    slot: int
    reason: str


@dataclass(frozen=True)
class Release:
    """Newcomers (starting, up or on standby) the run does not need are let go."""

    slots: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class LeaveDraining:
    """The members on draining nodes leave now, ``how``: ``Leave``, ``HandOver`` (ready
    newcomers join first and take the state over) or ``SaveThenLeave``."""

    slots: tuple[int, ...]
    how: Leave | HandOver | SaveThenLeave
    reason: str


@dataclass(frozen=True)
class TrainOnDraining:
    """The members on draining nodes train on while ``request`` more replacements start
    elsewhere (the drain plan's ``TrainOn``); ``nodes``: the draining nodes, recorded the first time."""

    nodes: tuple[str, ...]
    request: int
    reason: str


@dataclass(frozen=True)
class Redeal:
    """Deal the global batch by a new split (``rows`` per data index: a straggler's rebalance)."""

    rows: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Shrink:
    """The members above a requested ceiling (``slots``: the highest ranks) leave."""

    target: int
    slots: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class RequestWorkers:
    """Below the target world: replacements are asked for (they start in the background)."""

    reason: str


@dataclass(frozen=True)
class Grow:
    """The ready newcomers make a larger usable world: they join."""

    count: int
    reason: str


@dataclass(frozen=True)
class Bench:
    """The ready newcomers are too few for the next usable world: they wait on standby."""

    count: int
    reason: str


Item = (Checkpoint | Evaluate | StopTraining | ReplaceStraggler | Redeal | Release | LeaveDraining
        | TrainOnDraining | Shrink | RequestWorkers | Grow | Bench)
# Items that need no boundary (the members are not involved): carried out when planned, while a
# lease runs too. Every other item needs the members between two steps.
AT_ONCE = (RequestWorkers, Release, Bench)


def kind(item: Item) -> str:
    """The name ``Facts.tried`` records an item by."""
    return type(item).__name__


# ------------------------------------------------------------------ the plan
def plan(facts: Facts, spec: JobSpec) -> list[Item]:
    """What the boundary ``facts`` describe must do, in order (empty: nothing; go on training)."""
    f, tried = facts, facts.tried
    items: list[Item] = []
    if f.just_committed:
        if checkpoint_due(f.step, f.last, spec) and not f.saved and "Checkpoint" not in tried:
            items.append(Checkpoint(spec.checkpoint.async_save, f"checkpoint.every_steps="
                                    f"{spec.checkpoint.every_steps}: a checkpoint is due at step {f.step}"))
        if f.evaluates and evaluation_due(f.step, spec) and "Evaluate" not in tried:
            items.append(Evaluate(f"an evaluation is due at step {f.step}"))
    stop = _stop(f)
    if stop is not None:
        return items + [stop]
    if f.straggler is not None and "ReplaceStraggler" not in tried:
        items.append(ReplaceStraggler(f.straggler[0], f.straggler[1]))
    if f.redeal is not None and "Redeal" not in tried:
        items.append(Redeal(f.redeal, f"a straggler's rebalance: rows per data index {list(f.redeal)}"))
    drains = _drains(f, spec)
    if drains:  # the members leave (or train on) first; the world is planned again after them
        return items + drains
    return items + _resize(f, spec)


def boundary_due(facts: Facts, spec: JobSpec) -> str:
    """Why the boundary ``facts`` describe needs the members between two steps ("" when its
    plan needs no boundary: empty, or only items carried out at once, ``AT_ONCE``). A running
    lease is cut short at the earliest boundary for which this is not ""."""
    items = [i for i in plan(facts, spec) if not isinstance(i, AT_ONCE)]
    return items[0].reason if items else ""


def hold_reason(facts: Facts, spec: JobSpec) -> str:
    """Why the lease after the running one may not be sent before the boundary between them
    (run-ahead), "" when it may: run-ahead is on and the plan ``plan`` makes for that boundary,
    on the facts it will see, is empty. (A plan of items carried out at once, such as
    replacements to ask for while below the target world, keeps the boundary too: it is where
    they are carried out, and where the newcomers join; only a cut ignores them.)"""
    if not spec.train.run_ahead:
        return "train.run_ahead is off"
    items = plan(facts, spec)
    return items[0].reason if items else ""


def _stop(f: Facts) -> StopTraining | None:
    if f.step >= f.last:
        return StopTraining("the last step")
    if f.stop is not None:
        return StopTraining(f.stop.describe())
    if f.early_stop:
        return StopTraining(f.early_stop)
    return None


def _drains(f: Facts, spec: JobSpec) -> list[Item]:
    """Members on draining nodes leave with no step lost (``drain_plan``); newcomers
    there are let go first."""
    deadlines = f.drain_deadlines
    if not deadlines:
        return []
    items: list[Item] = []
    there = tuple(w.slot for w in f.pending + f.ready if w.node_id in deadlines)
    if there and "Release" not in f.tried:
        items.append(Release(there, "newcomers on draining node(s)"))
    leaving = [w for w in f.members if w.node_id in deadlines]
    if not leaving:
        return items
    known = [d for d in (deadlines[w.node_id] for w in leaving) if d]
    deadline = min(known) if known else None
    when = f"deadline in {deadline - f.now_unix_s:.0f} s" if deadline else "no deadline"
    what = f"{len(leaving)} worker(s) on draining node(s) ({when})"
    staying = len(f.members) - len(leaving)
    need = drain_floor(spec.elastic)
    ready = [w for w in f.ready if w.node_id not in deadlines] if staying < need else []
    pending = [w for w in f.pending if w.node_id not in deadlines]
    how = drain_plan(staying, len(ready), len(pending), need, deadline, f.now_unix_s)
    slots = tuple(w.slot for w in leaving)
    if isinstance(how, TrainOn):
        nodes = tuple(sorted({w.node_id for w in leaving}))
        new = how.request or not set(nodes) <= f.training_on  # replacements to ask for, or news
        if new and "TrainOnDraining" not in f.tried:
            items.append(TrainOnDraining(nodes, how.request, f"{what}: training on until a replacement "
                                                             f"is up to take the state over"))
    elif "LeaveDraining" in f.tried:
        pass
    elif isinstance(how, HandOver):
        items.append(LeaveDraining(slots, how, f"{what}: {len(ready)} newcomer(s) take the state over at "
                                               f"step {f.step}"))
    elif isinstance(how, SaveThenLeave):
        items.append(LeaveDraining(slots, how, f"{what}: no replacement in time, saving a checkpoint at "
                                               f"step {f.step} before leaving"))
    elif isinstance(how, Leave):
        items.append(LeaveDraining(slots, how, f"{what}: leaving at step {f.step}"))
    else:
        raise TypeError(f"unknown drain plan {how!r}")
    return items


def _resize(f: Facts, spec: JobSpec) -> list[Item]:
    """The world toward the target: shrink to a requested ceiling, let surplus newcomers go,
    or ask for replacements and take the ready ones in."""
    world = len(f.members)
    if world > f.target and "Shrink" not in f.tried:
        leaving = shrink_leavers(f.members, f.target)
        why = f": {f.ceiling_reason}" if f.ceiling_reason else ""
        return [Shrink(f.target, tuple(w.slot for w in leaving),
                       f"shrinking to {f.target} worker(s) at step {f.step}{why}")]
    surplus = tuple(w.slot for w in f.pending + f.ready)
    # newcomers for those training on
    successors = bool(f.draining) and any(w.node_id in f.drain_deadlines for w in f.members)
    if world >= f.target:
        if surplus and not successors and "Release" not in f.tried:
            return [Release(surplus, f"the world is at its target of {f.target}")]
        return []
    items: list[Item] = []
    if "RequestWorkers" not in f.tried:
        items.append(RequestWorkers(f"{world} worker(s), below the target of {f.target}"))
    if f.ready and "Grow" not in f.tried and "Bench" not in f.tried:
        if grows(spec.parallel, world, len(f.ready)):
            items.append(Grow(len(f.ready), f"{len(f.ready)} worker(s) ready: growing to "
                                            f"{world + len(f.ready)}"))
        else:
            items.append(Bench(len(f.ready), f"{len(f.ready)} worker(s) ready, too few for the next "
                                             f"usable world"))
    return items
