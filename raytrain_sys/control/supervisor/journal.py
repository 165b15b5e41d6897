"""The Supervisor's states, the moves allowed between them, and the record of each move.

Owns: ``State`` (with ``terminal`` and ``allowed``) and the shape of a transition record (the
``transitions`` entries of summary.json). ``Supervisor._transition`` is the one place a run's
state changes: it asks ``State.check_move`` first, so a move this table does not list raises
``TransitionNotAllowed`` instead of being recorded. Pure: no Ray, no I/O.
"""

from __future__ import annotations

from enum import Enum


class TransitionNotAllowed(RuntimeError):
    """A state change the table below does not list: a bug in the Supervisor's sequencing."""


class State(str, Enum):
    STARTING = "starting"
    RESTORING = "restoring"  # loading a durable checkpoint
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    REBUILDING = "rebuilding"  # a member was lost: survivors re-form the group in place
    RESIZING = "resizing"  # newcomers join at a step boundary
    DRAINING = "draining"  # members on a node marked for preemption leave at a step boundary
    WAITING = "waiting"  # below elastic.min_workers, waiting for workers
    STOPPED = "stopped"  # paused (train.stop_at_step, or a pause request), resumable
    CANCELLED = "cancelled"  # stopped at a step boundary on request; checkpoints kept
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """The run has ended: no move leaves this state."""
        return self in (State.STOPPED, State.CANCELLED, State.FINISHED, State.FAILED)

    @property
    def allowed(self) -> frozenset["State"]:
        """The states this one may move to. Every live state may also stay (a note, such as
        a skipped bad shard, recorded in the same state) and may fail."""
        if self.terminal:
            return frozenset()
        return _MOVES[self] | {self, State.FAILED}

    def check_move(self, to: "State") -> None:
        if to not in self.allowed:
            raise TransitionNotAllowed(f"supervisor state {self.value} cannot move to {to.value} "
                                       f"(allowed: {', '.join(sorted(s.value for s in self.allowed)) or 'none'})")


# Where each state leads (besides staying and failing). The recovery states reach RESTORING
# when no replica holds the state, WAITING when below the minimum world, CHECKPOINTING when
# the run stops and saves first (elastic.max_failures, elastic.below_min_timeout_s).
_MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.RESTORING, State.RUNNING}),
    # A restore inside a rebuild that loses members is retried like the rebuild: waiting for
    # workers, or saving before the run stops.
    State.RESTORING: frozenset({State.RUNNING, State.WAITING, State.CHECKPOINTING}),
    State.RUNNING: frozenset({State.CHECKPOINTING, State.REBUILDING, State.RESIZING, State.DRAINING,
                              # a drain that saved first: the leave then re-forms from RUNNING
                              State.WAITING, State.RESTORING,
                              State.STOPPED, State.CANCELLED, State.FINISHED}),
    State.CHECKPOINTING: frozenset({State.RUNNING, State.REBUILDING}),
    State.REBUILDING: frozenset({State.RUNNING, State.WAITING, State.RESTORING, State.CHECKPOINTING}),
    State.RESIZING: frozenset({State.RUNNING, State.WAITING, State.RESTORING, State.CHECKPOINTING}),
    State.DRAINING: frozenset({State.RUNNING, State.WAITING, State.RESTORING, State.CHECKPOINTING}),
    State.WAITING: frozenset({State.RUNNING, State.RESTORING, State.CHECKPOINTING}),
}


def transition_record(state: State, reason: str, step: int, at_unix_s: float,
                      detected_at_unix_s: float = 0.0, world: int | None = None) -> dict:
    """One entry of summary.json's ``transitions``; ``detected_at``: when the failure that
    caused it was seen, if earlier (the rebuild decision waits for the rest of the step's
    members); ``world``: the group's members at the move, once there is a group (a group of two
    that a warm replacement grew back to three before its first step shows here, not in the
    per-step ``world_sizes``)."""
    record = {"time": at_unix_s, "state": state.value, "reason": reason, "step": step}
    if world is not None:
        record["world"] = world
    if detected_at_unix_s:
        record["detected_at"] = detected_at_unix_s
    return record
