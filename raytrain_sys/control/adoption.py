"""Adoption: a new Supervisor takes over the live ranks of a launch whose Supervisor died.

Since the node agents (``node_agent``), a launch's ranks answer to their node's agent, not to the
process that drives them: when that process dies (a CLI driver SIGKILLed, a job's runner lost
with its node), the ranks finish the lease they are in and wait, idle, holding the state of the
newest step they all agreed on. A lease the dead driver had sent ahead (``train.run_ahead``)
never starts on rank 0 (its call, a generator streaming to the driver, is dropped with it); on
the others it starts when its rows reached them before Ray learned that their owner (the
driver) died, else their call fails with the rows. Ranks that began it wait for rank 0 in its
first collective: such a split is completed (``completable``): the adopting Supervisor sends
the ranks that never got the lease their part of it (``Running``). The agents keep the ranks for
``elastic.orphan_timeout_s``; a Supervisor that resumes the run within that time adopts them
(``find``): it finds the launch's agents by name, takes ownership of the launch (its record in the
GCS and every agent's owner), and checks that the ranks agree:

* every rank of the process group answers (as many as its world size, ranks 0..W-1, one
  generation);
* every one is between leases with its state in its layout, at one step (waited for, at most the
  orphan timeout: a lease in flight ends first), or in the lease sent ahead that the others
  never got (completed as above).

It then drives the same processes and the same process group on from that step: no restore, no
step trained again. When they do not agree (a rank lost with the driver, ranks at different
steps), the launch is ended and the run restores its newest checkpoint, as before, with the
reason in its record (``Adoption.why``).

No torch import: the job service's runner reads it before it knows whether it adopts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import ray

from raytrain_sys.control import launches
from raytrain_sys.control.owners import owner_gone, this_process

log = logging.getLogger(__name__)

# How often the ranks are asked whether they are between leases while adoption waits for them.
POLL_S = 0.1
# How long one round of calls to the agents and ranks may take before one is taken for lost.
CALL_TIMEOUT_S = 10.0
# How long ranks may stay split (some began a lease the others never got) before it is taken
# for final: longer than a rank takes from its lease's end to its next queued call.
SPLIT_S = 1.0


@dataclass
class Rank:
    """One adopted rank: its slot, actor, placement group, its agent's key and what it said
    (``TrainWorker.adoption_state``: rank, step, node id, pid, ...)."""

    slot: int
    actor: object
    pg: object
    agent: tuple | None  # (node id, index) of the agent that holds it; None: not handed to one yet
    state: dict


@dataclass
class Running:
    """A lease the lost driver sent that only some ranks began (the split, ``agreement``): rank 0's
    call (a generator, its reports streamed to the driver) was dropped with it. The adopting
    Supervisor sends those ranks (``missing``, slots) their part of it, the same lease (id
    ``lease``, steps ``first`` .. ``first + count - 1``), and follows the others (``began``,
    slots) to its end on their control path (``TrainWorker.lease_end``)."""

    lease: int
    first: int
    count: int
    missing: list[int]
    began: list[int]


@dataclass
class Adoption:
    """A launch taken over (``ranks`` in rank order, all at ``step``), or why none was (``why``;
    ``ranks`` empty)."""

    prefix: str = ""
    agents: dict[tuple, object] = field(default_factory=dict)  # (node id, index) -> a live agent
    ranks: list[Rank] = field(default_factory=list)
    step: int = 0
    generation: int = 0
    lease: int = -1  # the newest lease id any rank began or agreed to cut: new ones are numbered after it
    why: str = ""
    waited_s: float = 0.0
    running: Running | None = None  # a lease some ranks began and the others never got: completed first

    @property
    def adopted(self) -> bool:
        return bool(self.ranks)


def orphaned_launches(run_key: str) -> list[str]:
    """The recorded launches of ``run_key`` whose owner is gone, newest first."""
    found = launches.records(launches.run_name_prefix(run_key))
    return sorted((p for p, r in found.items() if owner_gone(r["owner"])), key=lambda p: -found[p]["time"])


def agents_of(prefix: str) -> dict[tuple, object]:
    """The agents of launch ``prefix`` by (the start of their node's id, index), found by their
    names (``launches.agent_name``)."""
    from raytrain_sys.control.spares import NAMESPACE

    out = {}
    start = prefix + launches.AGENT_WORD + ":"
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] != NAMESPACE or not a["name"].startswith(start):
            continue
        node, _, index = a["name"][len(start):].rpartition(":")
        try:
            out[(node, int(index))] = ray.get_actor(a["name"], namespace=NAMESPACE)
        except ValueError:  # ended since the listing
            continue
    return out


def find(run_key: str, wait_s: float, training_hash: str,
         rows_of: Callable[[int], list[tuple[int, int]]] | None = None) -> Adoption | None:
    """Take over the newest launch of ``run_key`` whose Supervisor is gone, if its ranks agree
    (see the module's docstring); ``wait_s``: how long to wait for them to finish the lease in
    flight. On success this process owns the launch (its GCS record, every agent's owner). When
    the ranks do not agree the launch is ended here and ``why`` says what was found. None when
    no launch of the run is left whose owner is gone (a run paused or ended as asked, or one
    whose agents ended it once the orphan timeout passed).
    ``training_hash``: the resumed spec's (``JobSpec.training_hash``); ranks configured with other
    training settings (a resume that changes them) are not adopted. ``rows_of``: each rank's rows
    of a global batch (lo, hi) in a group of the given size, as the resume would deal them: a
    lease that only some ranks began is completed only when the others' rows are these (without
    it, never)."""
    found = orphaned_launches(run_key)
    if not found:
        return None
    prefix = found[0]
    me = this_process()
    agents = agents_of(prefix)
    launches.record(prefix, me)  # first: the agents must not end it while it is looked at
    for agent in agents.values():
        agent.set_owner.remote(me)
    t0 = time.monotonic()
    adoption = _look(prefix, agents, wait_s, training_hash, rows_of)
    adoption.waited_s = round(time.monotonic() - t0, 3)
    if not adoption.adopted:
        log.warning("could not adopt launch %s: %s; ending it", prefix, adoption.why)
        launches.end_launch(prefix)
    else:
        log.info("adopted launch %s: %d ranks at step %d (waited %.2f s for them)", prefix,
                 len(adoption.ranks), adoption.step, adoption.waited_s)
    return adoption


def _look(prefix: str, agents: dict[tuple, object], wait_s: float, training_hash: str,
          rows_of: Callable[[int], list[tuple[int, int]]] | None) -> Adoption:
    keyed: dict[tuple, object] = {}  # (the agent's node id, its index) -> the agent
    held: dict[int, tuple] = {}  # slot -> (actor, placement group, its agent's key or None)
    for (_, index), agent in agents.items():
        try:
            node_id = ray.get(agent.ping.remote(), timeout=CALL_TIMEOUT_S)["node_id"]
            ranks = ray.get(agent.ranks.remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001: an agent lost with its node (and its ranks with it)
            continue
        keyed[(node_id, index)] = agent
        for slot, (actor, pg) in ranks.items():
            held[slot] = (actor, pg, (node_id, index))
    # Ranks whose agent had not taken them over yet (it was starting: they answer to it and to
    # the lost driver, ``NodeAgents.assign``) are found by their names.
    for slot, (actor, pg) in named_ranks(prefix).items():
        held.setdefault(slot, (actor, pg, None))
    if not held:
        return Adoption(prefix, why="none of its workers is left")
    deadline = time.monotonic() + wait_s
    split_since = None
    while True:
        states, lost = _states(held)
        # A worker no live agent holds, on a node with no live agent of the launch: its agent
        # died (it ends within a second of that), not one still starting.
        nodes = {key[0] for key in keyed}
        lost += [slot for slot, st in states.items() if held[slot][2] is None and st["node_id"] not in nodes]
        if lost:
            return Adoption(prefix, why=f"{len(lost)} of its {len(held)} workers did not answer or lost their "
                                        f"node's agent (slots {', '.join(map(str, sorted(lost)))})")
        verdict = agreement(states, training_hash)
        running = None
        if verdict.startswith("split"):
            split_since = split_since or time.monotonic()
            if time.monotonic() - split_since < SPLIT_S:
                time.sleep(POLL_S)
                continue
            why = completable(states, rows_of(len(states)) if rows_of is not None else None)
            if why:
                return Adoption(prefix, why=f"{verdict[len('split: '):]}, and that lease cannot be completed: {why}")
            busy = sorted(slot for slot, st in states.items() if not st["idle"])
            lease, first, count = states[busy[0]]["running"][:3]
            running = Running(lease, first, count, sorted(set(states) - set(busy)), busy)
        if verdict == "" or running is not None:
            ranks = sorted((Rank(slot, held[slot][0], held[slot][1], held[slot][2], st)
                            for slot, st in states.items()), key=lambda r: r.state["rank"])
            first = ranks[0].state
            return Adoption(prefix, keyed, ranks, first["step"], first["generation"],
                            max(r.state["lease"] for r in ranks), running=running)
        split_since = None
        if not verdict.startswith("busy") or time.monotonic() >= deadline:
            return Adoption(prefix, why=verdict if not verdict.startswith("busy")
                            else f"{verdict} after {wait_s:g} s (elastic.orphan_timeout_s)")
        time.sleep(POLL_S)


def completable(states: dict[int, dict], rows: list[tuple[int, int]] | None) -> str:
    """Whether the lease that split ranks ``states`` (``agreement``'s "split") can be completed by
    sending the ranks that never got it their part: "" when it can, else why not. It can when
    the ranks that began it are in the same one (id, first step, steps), at the step the others
    hold; rank 0 is among the others (its reports went to the lost driver: only a new call to
    it can stream the lease's); and their rows are the ones the resume would give them
    (``rows``, by rank: a lease dealt unevenly, by a rebalance, cannot be dealt again)."""
    busy = {slot: s for slot, s in states.items() if not s["idle"]}
    leases = {tuple(s["running"][:3]) if s.get("running") else None for s in busy.values()}
    if len(leases) != 1 or None in leases:
        return "the ranks that began it are not all in one lease"
    lease, first, _ = leases.pop()
    if any(s["step"] != first for s in states.values()):
        return "its ranks are not all at its first step"
    if any(not s["idle"] for s in states.values() if s["rank"] == 0):
        return "rank 0 began it (its reports went to the lost driver)"
    if rows is None or any(tuple(s["running"][3:5]) != tuple(rows[s["rank"]]) for s in busy.values()):
        return "its rows were dealt otherwise than the resume would deal them"
    return ""


def named_ranks(prefix: str) -> dict[int, tuple]:
    """The live worker actors of launch ``prefix`` by slot (a worker is named ``<prefix><slot>``),
    each with its slot's placement group (named the same)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    groups = {info.get("name", ""): pg_id for pg_id, info in ray.util.placement_group_table().items()
              if info.get("state") != "REMOVED"}
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        rest = a["name"][len(prefix):] if a["name"].startswith(prefix) else ""
        if not rest.isdigit() or a["name"] not in groups:
            continue
        try:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
        except ValueError:  # ended since the listing
            continue
        out[int(rest)] = (actor, PlacementGroup(PlacementGroupID(bytes.fromhex(groups[a["name"]]))))
    return out


def _states(held: dict[int, tuple]) -> tuple[dict[int, dict], list[int]]:
    asked = {slot: actor.adoption_state.remote() for slot, (actor, _, _) in held.items()}
    states, lost = {}, []
    for slot, ref in asked.items():
        try:
            states[slot] = ray.get(ref, timeout=CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001: lost, or stuck beyond its control path
            lost.append(slot)
    return states, lost


def agreement(states: dict[int, dict], training_hash: str) -> str:
    """Whether ranks that said ``states`` (slot -> ``TrainWorker.adoption_state``) can be driven on
    as one group by a Supervisor whose spec has ``training_hash``: "" when they can; "busy: ..."
    while one is still in a lease (ask again); else why not, in words."""
    if any(s["training_hash"] != training_hash for s in states.values()):
        return "the resume changes the training settings its ranks were started with"
    worlds = {s["world_size"] for s in states.values()}
    generations = {s["generation"] for s in states.values()}
    ranks = sorted(s["rank"] for s in states.values())
    if len(worlds) != 1 or len(generations) != 1:
        return f"its ranks are of different process groups (world sizes {sorted(worlds)}, generations {sorted(generations)})"
    world = worlds.pop()
    if ranks != list(range(world)):
        return f"{len(states)} of its {world} ranks are left (ranks {ranks})"
    busy = sorted(s["rank"] for s in states.values() if not s["idle"])
    idle = [s for s in states.values() if s["idle"]]
    if busy and idle and len({s["step"] for s in states.values()}) == 1 and \
            max(s["lease"] for s in states.values() if not s["idle"]) > max(s["lease"] for s in idle):
        # The driver was lost between two leases: its next one began on some ranks, and the
        # others' calls were dropped with it (Ray drops a dead caller's queued calls). The ranks
        # that began it wait in its first step's collective for peers that never come.
        return (f"split: rank(s) {', '.join(map(str, busy))} began a lease that the others never got "
                f"(the driver was lost between two leases), and wait in it for them")
    if busy:
        return f"busy: rank(s) {', '.join(map(str, busy))} still in a lease"
    steps = sorted({s["step"] for s in states.values()})
    if len(steps) != 1:
        return f"its ranks hold different steps ({', '.join(map(str, steps))})"
    return ""
