"""A node's agent: the ranks of one launch on one node answer to it, not to the driver.

One agent per node per launch (at most ``RANKS_PER_AGENT`` ranks each: a node of 8 GPUs has
one), started by the launch's ``WorkerGroup`` when the first of its ranks there is up.
**Detached** and named after the launch and the node (``launches.agent_name``), 0 CPUs, pinned
to its node: it outlives the process that drives the run (the Supervisor: a CLI driver, a
notebook, a job's runner), so that losing that process no longer ends the ranks.

What it owns:

* **Its node's ranks.** A rank is a detached actor *claimed* by its agent once it is up
  (``TrainWorker.hand_to``: the claim the warm spares already use, ``owners.owner_gone``): the
  rank ends itself within about a second of its agent's death, never with the driver's. (Ray's
  own ownership would do the same for an actor the agent created, but creating a
  ``TrainWorker`` there would import torch into every agent.) The agent keeps each rank's handle
  and placement group (``keep``, ``drop``).
* **Its leases.** The driver sends one call per agent per lease (``lease``): the plan's bytes
  once, each rank's rows and piece map, the node's piece references once; the agent submits
  its ranks' calls itself and keeps their references for its most recent leases (``refs``),
  which the Supervisor asks for only on the failure path. A rank's leases come from one caller
  (its agent), in the order sent, so run-ahead still queues lease k + 1 behind lease k. Rank 0's
  call stays the driver's own (its reports are how the driver follows the lease).
* **The launch's end when its owner is gone.** The launch's owner (``launches.owner_of``: the
  Supervisor's process) is watched; one gone for ``elastic.orphan_timeout_s`` with no new
  owner (``set_owner``: a Supervisor that adopts the launch) ends the agent's ranks, removes the
  launch's placement groups and ends the agent: nothing of a run outlives its driver by more
  than that bounded wait. A run that ends as asked ends its agents itself (``WorkerGroup.shutdown``).

An agent that dies (its node lost) takes its ranks with it, which a node's loss means anyway;
the calls it made read as ``OwnerDiedError`` (``liveness.collect``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import ray

log = logging.getLogger(__name__)

# A node's GPUs: the agent's fan-out is one node's ranks, as on a real node (and the stand-in
# benchmark, which runs every rank on one Ray node, gets the agents a fleet of 8-GPU nodes would).
RANKS_PER_AGENT = 8
# Leases whose call references an agent keeps: the Supervisor asks only for the running lease's
# and the one sent ahead of it.
KEPT_LEASES = 8
# How often the agent looks at its launch's owner.
OWNER_POLL_S = 1.0


# "control": drop, set_owner, ping and end answer while a lease call submits (the default group
# runs one call at a time, in the order sent: the leases, and ``keep`` before them).
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"control": 4})
class NodeAgent:
    def __init__(self, prefix: str, node_id: str, owner_id: str, orphan_timeout_s: float,
                 poll_s: float = OWNER_POLL_S):
        self.prefix, self.node_id = prefix, node_id
        self._owner = owner_id
        self._orphan_timeout_s = float(orphan_timeout_s)
        self._ranks: dict[int, object] = {}  # slot -> the rank's actor handle
        self._groups: dict[int, object] = {}  # slot -> its placement group
        self._leases: OrderedDict[int, list] = OrderedDict()  # lease id -> its calls' references
        self._lock = threading.Lock()
        self._ending = threading.Event()
        threading.Thread(target=self._watch_owner, args=(poll_s,), name="owner-watch", daemon=True).start()

    # ------------------------------------------------------------------ its ranks
    def keep(self, ranks: dict[int, tuple]) -> int:
        """Ranks of this node that answer to this agent from now on (slot -> (actor, placement
        group)); returns how many it holds. In the default group, as the leases: a lease sent
        after it finds its ranks here."""
        with self._lock:
            for slot, (actor, group) in ranks.items():
                self._ranks[slot], self._groups[slot] = actor, group
            return len(self._ranks)

    @ray.method(concurrency_group="control")
    def drop(self, slots: list[int]) -> int:
        """Ranks that left (killed, or given back to the warm spares' pool): no longer this
        agent's to end. Returns how many it still holds."""
        with self._lock:
            for slot in slots:
                self._ranks.pop(slot, None)
                self._groups.pop(slot, None)
            return len(self._ranks)

    @ray.method(concurrency_group="control")
    def set_owner(self, owner_id: str) -> None:
        """The Supervisor's process that drives the launch from now on."""
        self._owner = owner_id

    @ray.method(concurrency_group="control")
    def ping(self) -> dict:
        """The agent's node, its owner, its ranks' slots, and its process's CPU seconds so far."""
        times = os.times()
        with self._lock:
            return {"node_id": self.node_id, "owner": self._owner, "slots": sorted(self._ranks),
                    "pid": os.getpid(), "cpu_s": times.user + times.system}

    @ray.method(concurrency_group="control")
    def ranks(self) -> dict[int, tuple]:
        """The ranks this agent holds: slot -> (actor, placement group), for a Supervisor that
        adopts the launch (``control.adoption``)."""
        with self._lock:
            return {slot: (actor, self._groups.get(slot)) for slot, actor in self._ranks.items()}

    @ray.method(concurrency_group="control")
    def end(self) -> int:
        """End this agent's ranks, remove their placement groups, then the agent itself
        (the launch ended, or its owner is gone). Returns how many ranks it ended."""
        return self._end(sweep=False, why="")

    # ------------------------------------------------------------------ leases
    def lease(self, lease: int, first: int, count: int, steps: bytes, entries: bytes, timeout_s: float,
              ranks: list[tuple], pieces: list) -> int:
        """Submit lease ``lease`` to each of ``ranks`` (``(slot, lo, hi, arg, which, after)``: its
        rows, its plan's piece -> argument map, and which of the node's ``pieces`` it is passed,
        in order, as ``data.batches.rank_plans`` makes a rank's call; ``after``: None, or the
        reference of the rank's call of the lease before, which was the driver's own: this call
        is sent only once that one ended, so the rank runs them in order). Returns at once."""
        refs = [self._ranks[slot].train_steps.remote(first, (count, steps, entries, lo, hi, arg), timeout_s,
                                                     *(pieces[k] for k in which), lease=lease,
                                                     **({"after": after} if after is not None else {}))
                for slot, lo, hi, arg, which, after in ranks]
        self._leases[lease] = refs
        while len(self._leases) > KEPT_LEASES:
            self._leases.popitem(last=False)
        return len(refs)

    @ray.method(concurrency_group="control")
    def refs(self, lease: int) -> list | None:
        """The references of lease ``lease``'s calls, in the order its ``ranks`` were sent (None
        when it is no longer kept)."""
        return self._leases.get(lease)

    # ------------------------------------------------------------------ its end
    def _watch_owner(self, poll_s: float) -> None:
        """End the launch once its owner has been gone for the orphan timeout (a new owner set
        meanwhile, by adoption, keeps it)."""
        from raytrain_sys.control.owners import owner_gone

        gone_since = None
        while not self._ending.wait(poll_s):
            owner = self._owner
            if not owner_gone(owner):
                gone_since = None
                continue
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= self._orphan_timeout_s:
                self._end(sweep=True, why=f"its driver ({owner}) has been gone for {self._orphan_timeout_s:g} s "
                                          f"(elastic.orphan_timeout_s) and no Supervisor took the run over")
                return

    def _end(self, sweep: bool, why: str) -> int:
        """Kill this agent's ranks and remove their placement groups (with ``sweep``, every
        placement group of the launch: slots still starting when its owner died belong to no
        agent); then the process exits."""
        from ray.util.placement_group import remove_placement_group

        self._ending.set()
        with self._lock:
            ranks, groups = dict(self._ranks), dict(self._groups)
            self._ranks, self._groups = {}, {}
        if why:
            log.warning("node agent %s: ending %d ranks of launch %s: %s", self.node_id[:8], len(ranks),
                        self.prefix, why)
        for actor in ranks.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001: gone already
                pass
        for group in groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001: removed already
                pass
        if sweep:
            from raytrain_sys.control import launches

            try:
                launches.end_launch(self.prefix, agents_first=False)
            except Exception as exc:  # noqa: BLE001: what is left is a resume's to remove
                log.warning("node agent %s: could not end the rest of launch %s: %s", self.node_id[:8],
                            self.prefix, exc)
        # Exit after this call answers: the caller (WorkerGroup.shutdown, end_launch) waits on it.
        threading.Timer(0.2, os._exit, args=(0,)).start()
        return len(ranks)


def agent_with_room(held: dict[tuple, int], node_id: str, per_agent: int = RANKS_PER_AGENT) -> tuple | None:
    """Which agent a rank that came up on ``node_id`` answers to: of the agents ``held`` ((node,
    index) -> how many ranks it holds), the one of that node with the lowest index that holds
    fewer than ``per_agent``; None when the node has none with room (a new one is started)."""
    free = sorted(key for key, n in held.items() if key[0] == node_id and n < per_agent)
    return free[0] if free else None


class NodeAgents:
    """The node agents of one launch, on the driver's side: which agent each rank answers to
    (``assign``: its node's, at most ``RANKS_PER_AGENT`` each), the hand-over once that agent is up
    (``hand_over``), and the agents' end (``forget``: an agent left with no rank, ``end``: all).
    Owned by the launch's ``WorkerGroup``; ``Steps`` sends the leases through ``handles``."""

    def __init__(self, prefix: str, orphan_timeout_s: float):
        self.prefix, self.orphan_timeout_s = prefix, orphan_timeout_s
        self.owner_id = ""  # the launch's owner (WorkerGroup._record_launch), the agents' to watch
        self.handles: dict[tuple, object] = {}  # (node id, index) -> the agent's handle
        self._slots: dict[tuple, set[int]] = {}  # ... -> the slots assigned to it
        self._ready: dict[tuple, object] = {}  # ... -> its first answer (it is up)
        self._made: dict[str, int] = {}  # node id -> agents started there (a name is never reused)
        self._to_hand: dict[tuple, list] = {}  # ... -> ranks up, waiting for it to be up
        self._handed: set[int] = set()  # slots that answer to their agent

    def take(self, owner_id: str, agents: dict[tuple, object], slots: dict[tuple, list[int]]) -> None:
        """The agents of an adopted launch (``control.adoption``; key: (node id, index)) and the
        slots each holds: they answer to ``owner_id`` (which set itself their owner) from now on."""
        self.owner_id = owner_id
        for key, agent in agents.items():
            self.handles[key], self._slots[key] = agent, set(slots.get(key, ()))
            self._ready[key] = agent.ping.remote()  # up: a rank assigned to it is handed over at once
            self._handed |= self._slots[key]
            self._made[key[0]] = max(self._made.get(key[0], 0), key[1] + 1)

    def ensure(self, node_id: str) -> None:
        """``node_id`` has an agent (started now if not): called as a slot there is placed, so
        that the agent starts beside the rank's own process, not after it."""
        if not any(key[0] == node_id for key in self.handles):
            self._start(node_id)

    def assign(self, w) -> None:
        """Worker ``w`` (up on ``w.node_id``) answers to its node's agent with room (``w.agent``
        its key), from the moment that agent is up."""
        key = agent_with_room({k: len(v) for k, v in self._slots.items()}, w.node_id) or self._start(w.node_id)
        w.agent = key
        self._slots[key].add(w.slot)
        self._to_hand.setdefault(key, []).append(w)
        self.hand_over()
        if w.slot not in self._handed and self.owner_id and key in self.handles:
            # Its agent is still starting: the rank answers to its driver *and* its agent from
            # now on, ending only once both are gone, so that a driver lost before the agent is
            # up no longer takes the rank with it (the agent, once up, ends it after the orphan
            # timeout or a new Supervisor adopts it); hand_over makes it the agent's alone.
            w.actor.hand_to.remote((self.owner_id, self.handles[key]._actor_id.hex()))

    def _start(self, node_id: str) -> tuple:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from raytrain_sys.control.launches import agent_name
        from raytrain_sys.control.spares import NAMESPACE

        index = self._made.get(node_id, 0)
        self._made[node_id] = index + 1
        key = (node_id, index)
        where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)} if node_id else {}
        agent = NodeAgent.options(name=agent_name(self.prefix, node_id, index), namespace=NAMESPACE,
                                  lifetime="detached", **where).remote(self.prefix, node_id, self.owner_id,
                                                                       self.orphan_timeout_s)
        self.handles[key], self._slots[key] = agent, set()
        self._ready[key] = agent.ping.remote()  # answers once the agent is up
        log.info("node agent %d started on node %s", index, node_id[:8] or "?")
        return key

    def hand_over(self) -> None:
        """Ranks waiting for their agent go to it once it is up (it answered its first call):
        each is claimed by it from then on (``TrainWorker.hand_to``) and the agent holds it
        (``keep``). Until then a rank stays its driver's: a rank never depends on an agent that
        is not up (one that cannot start, on a node that began draining say, would end it). An
        agent that failed to start is forgotten; its ranks stay the driver's."""
        for key in [k for k, ws in self._to_hand.items() if ws]:
            ref = self._ready.get(key)
            if ref is None or not ray.wait([ref], timeout=0)[0]:
                continue
            waiting = self._to_hand.pop(key)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                log.warning("node agent %d on node %s did not start (%s): its %d rank(s) stay the driver's",
                            key[1], key[0][:8], type(exc).__name__, len(waiting))
                for w in waiting:
                    w.agent = None
                self._drop_agent(key)
                continue
            agent = self.handles[key]
            for w in waiting:
                w.actor.hand_to.remote(agent._actor_id.hex())
            agent.keep.remote({w.slot: (w.actor, w.pg) for w in waiting})
            self._handed.update(w.slot for w in waiting)

    def handed(self, key: tuple, slots: list[int]) -> bool:
        """Whether every one of ``slots`` answers to the agent of ``key`` (which can then take
        their leases)."""
        return key in self.handles and all(s in self._handed and s in self._slots[key] for s in slots)

    def holds(self, w) -> bool:
        """Whether worker ``w`` answers to an agent."""
        return w.slot in self._handed

    def lost(self, agent) -> None:
        """An agent found dead (a call to it failed): its ranks died with it (their claim); a
        later rank of its node gets a new one."""
        for key in [k for k, a in self.handles.items() if a is agent]:
            self._drop_agent(key)

    def _drop_agent(self, key: tuple) -> None:
        self.handles.pop(key, None)
        self._ready.pop(key, None)
        self._to_hand.pop(key, None)
        self._handed -= self._slots.pop(key, set())

    def forget(self, w) -> None:
        """Worker ``w`` left (killed, or given back to the pool): no longer its agent's to end.
        An agent left with no rank ends (it would keep a drained node from ending once its last
        slot goes, as Ray ends an idle drained node); a later rank of its node starts another."""
        self._handed.discard(w.slot)
        key = w.agent
        if key is None or key not in self.handles:
            return
        self._slots[key].discard(w.slot)
        if key in self._to_hand:
            self._to_hand[key] = [x for x in self._to_hand[key] if x.slot != w.slot]
        agent = self.handles[key]
        try:
            if self._slots[key]:
                agent.drop.remote([w.slot])
            else:
                ray.kill(agent, no_restart=True)
                self._drop_agent(key)
        except Exception:  # noqa: BLE001: the agent is gone: nothing to tell
            pass

    def end(self) -> None:
        """Every agent of the launch ends (its ranks were ended or given back before)."""
        for agent in self.handles.values():
            try:
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001: gone already
                pass
        self.handles, self._slots, self._ready, self._to_hand, self._handed = {}, {}, {}, {}, set()
