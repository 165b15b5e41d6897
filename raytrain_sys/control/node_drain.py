"""This node is going away: drain it, and wait until our training has left it.

``raytrain-sys node drain --reason preemption --deadline-s N --wait`` is a pod's preStop hook in
``cluster_configs/kubernetes/``: Kubernetes runs it when the pod is to end (a spot reclaim that
the node's termination handler turns into an eviction, ``kubectl drain``, a scale-down) and sends
SIGTERM only once it returns, within ``terminationGracePeriodSeconds``. It works on any machine
that runs a Ray node (maintenance on a VM too).

What it does, in order:

1. Finds this node: ``--node-id``, else the alive node whose instance id is
   ``$RAY_CLOUD_INSTANCE_ID`` (KubeRay sets it to the pod's name in every container of the
   pod, so the hook finds its own node with no argument), else the only one on this host's IP
   (``drain.local_node``). No such node: nothing to drain, it says so and succeeds.
2. Drains it with reason PREEMPTION and the deadline ``now + N`` (``drain.drain_node_result``),
   unless it already drains with an earlier deadline, which it keeps (a spot notice came first:
   ``plan_drain``). A draining node takes no new work; the Supervisor of every job with members
   there sees the drain at its next step boundary and moves them off (a shrink, or a hand-over
   to a replacement), losing no step.
3. With ``--wait``, returns once no training slot of ours is left there (``drain.training_slots_
   on``: each worker trains in its own placement group, removed when it leaves), or when the
   node is gone, or at the deadline, whichever comes first. Only the last one is a failure (exit
   1): the pod is then killed with work still on it, and the job recovers as from a lost node.

Nothing here touches a job: the drain is the message, as from the spot watcher or Ray's own
SIGTERM handler (``ray start --block``, which drains its node when the pod's SIGTERM reaches it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from raytrain_sys.control import drain

log = logging.getLogger(__name__)

# How often the wait looks for our slots: two GCS reads; a step boundary is about 1 s away at
# most (train.steps_per_call keeps leases under a second), so finer would only add reads.
DEFAULT_POLL_S = 0.5


@dataclass(frozen=True)
class DrainPlan:
    """Whether to send a drain, and the deadline the node will have."""

    send: bool
    deadline_unix_s: float
    reason: str


def plan_drain(current: Optional[drain.DrainInfo], wanted_deadline_unix_s: float) -> DrainPlan:
    """Decide the drain from the node's current one (None: not draining).

    Ray keeps one deadline per node and a new drain replaces it, so an earlier deadline
    already set (the spot watcher's, from the cloud's notice) is kept: moving it later would
    promise the jobs time the machine does not have. A later one, or none, is replaced."""
    if current is None:
        return DrainPlan(True, wanted_deadline_unix_s, "not draining yet")
    if current.deadline_unix_s is None:
        return DrainPlan(True, wanted_deadline_unix_s, "draining with no deadline: ours is sooner")
    if current.deadline_unix_s <= wanted_deadline_unix_s:
        return DrainPlan(False, current.deadline_unix_s,
                         f"already draining ({current.reason}) with an earlier deadline")
    return DrainPlan(True, wanted_deadline_unix_s,
                     f"already draining ({current.reason}) with a later deadline: ours is sooner")


@dataclass
class DrainOutcome:
    node_id: str = ""  # "" when no node was found (nothing to drain)
    reason: str = "PREEMPTION"
    plan: Optional[DrainPlan] = None
    slots_at_start: list = field(default_factory=list)
    slots_left: list = field(default_factory=list)  # still there when the wait ended
    waited_s: float = 0.0
    node_gone: bool = False
    note: str = ""

    @property
    def ok(self) -> bool:
        """Nothing of ours is left on the node (or there is no node any more)."""
        return not self.slots_left

    def summary(self) -> str:
        if not self.node_id:
            return f"nothing to drain: {self.note}"
        head = (f"node {self.node_id[:12]}: draining ({self.reason}) until {self.plan.deadline_unix_s:.0f} "
                f"({self.plan.reason}); training slots here at the start: {len(self.slots_at_start)}")
        if self.slots_left:
            return (f"{head}; deadline reached after {self.waited_s:.1f} s with "
                    f"{len(self.slots_left)} still here: {', '.join(self.slots_left)}")
        how = "the node is gone" if self.node_gone else "none left"
        return f"{head}; {how} after {self.waited_s:.1f} s"


def drain_this_node(deadline_s: float, *, reason: str = "PREEMPTION", wait: bool = True,
                    node_id: Optional[str] = None, instance_id: Optional[str] = None,
                    gcs_address: Optional[str] = None, message: str = "",
                    poll_s: float = DEFAULT_POLL_S,
                    clock: Callable[[], float] = time.time,
                    sleep: Callable[[float], None] = time.sleep) -> DrainOutcome:
    """Steps 1-3 of the module docstring. Raises ``drain.DrainError`` when the GCS cannot be
    reached or refuses the drain, ``LookupError`` when several nodes match."""
    t0 = clock()
    try:
        node = drain.local_node(node_id, instance_id, gcs_address=gcs_address)
    except drain.NodeNotFound as e:  # gone already, or never started: nothing to protect
        return DrainOutcome(note=str(e))
    current = drain.draining_nodes(gcs_address).get(node)
    plan = plan_drain(current, t0 + deadline_s)
    outcome = DrainOutcome(node_id=node, reason=reason.upper(), plan=plan)
    if plan.send:
        result = drain.drain_node_result(
            node, reason, None, message or "raytrain-sys node drain (the machine is going away)",
            deadline_unix_s=plan.deadline_unix_s, gcs_address=gcs_address)
        if not result.accepted:
            raise drain.DrainError(f"Ray refused to drain node {node}: {result.rejection_message}")
    outcome.slots_at_start = drain.training_slots_on(node, gcs_address)
    outcome.slots_left = list(outcome.slots_at_start)
    while wait and outcome.slots_left:
        if node not in drain.alive_nodes(gcs_address):
            outcome.node_gone, outcome.slots_left = True, []
            break
        if clock() >= plan.deadline_unix_s:
            break
        sleep(min(poll_s, max(0.0, plan.deadline_unix_s - clock())))
        outcome.slots_left = drain.training_slots_on(node, gcs_address)
    outcome.waited_s = clock() - t0
    log.info("%s", outcome.summary())
    return outcome
