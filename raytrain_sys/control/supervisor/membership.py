"""Who is in the group, and how the members come to hold the committed step.

Owns: who is in the group. It is the one part of the Supervisor that changes it (newcomers
requested, taken in or benched, lost and leaving members out, newcomers let go; ``WorkerGroup``
itself owns the actors): the others return requests for it (``liveness``'s lost members, the
boundary plan's items, ``policy.standby_for_layout``). Also forming a process group
(``layout_replicated``, which only it writes) and equalizing state across a new world: a
broadcast from a holder in a replicated layout, pieces through Ray's object store in a sharded
one, including the pieces of members that left a draining node (only it writes
``departing_pieces``) and, with peer copies (raytrain_sys.control.peer_copies), the copies the
members hold of the lost ones' blocks, their own snapshots, and those a lost member still
answering handed over before it was killed (``rescue``); it names each member's peer (and
writes summary.json's ``peer_copies``). It records no state transition, saves or loads no
checkpoint and calls no other part of the Supervisor: ``rebuild`` returns ``Reformed``, ``BelowMinimum`` (the Supervisor
waits for workers, ``wait_for``), ``NeedsRestore`` (the members cannot hold the committed step:
the Supervisor loads a checkpoint, after ``regroup`` when every holder is gone) or ``MustStop``.

State across membership changes: survivors keep their model and optimizer objects; a new
process group (new generation, new master port) is formed over the members and the ready
newcomers. In a replicated layout (plain DDP) a newcomer receives the state by broadcast from
a survivor that holds the committed step; in a sharded one every member of the new world
receives just the parts of the holders' pieces that fall in its own blocks (no one holds the
whole state). If the holders do not cover the state (the only shard of something died), only a
durable checkpoint can continue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import ray

import raytrain_sys.control.supervisor.policy as policy
from raytrain_sys.control import peer_copies
from raytrain_sys.control.supervisor.probe import ping_all
from raytrain_sys.control.worker import RENDEZVOUS_TIMEOUT_S, cut_departed, index_departed
from raytrain_sys.control.worker_group import Worker, WorkerGroup
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)


class MembersLost(Exception):
    """Members found dead or silent while the group re-forms."""

    def __init__(self, dead: list["Worker"], silent: list["Worker"]):
        super().__init__(", ".join([f"worker {w.slot} died" for w in dead]
                                   + [f"worker {w.slot} silent" for w in silent]) or "no answer")
        self.dead, self.silent = dead, silent


@dataclass(frozen=True)
class Reformed:
    """A new process group over ``members``, every one holding the committed step."""

    members: list


@dataclass(frozen=True)
class NoHolders:
    """Every replica of the committed step is gone (they died during this rebuild)."""

    members: list


@dataclass(frozen=True)
class Uncovered:
    """The holders of the committed step do not hold all of it (``gaps``: missing tensors)."""

    members: list
    gaps: list[str]


@dataclass(frozen=True)
class Lost:
    """Members died or went silent while the group re-formed; they were dropped: try again."""

    error: MembersLost


@dataclass(frozen=True)
class AllLost:
    """No member is left: only a durable checkpoint can continue the run."""


@dataclass(frozen=True)
class BelowMinimum:
    """Members and ready newcomers are fewer than the smallest world the run may train in."""

    have: int
    need: int


@dataclass(frozen=True)
class NeedsRestore:
    """The members cannot hold the committed step: ``gaps``, the tensors the survivors' pieces
    miss (the only shard of something died); empty when no member holds the step at all."""

    members: list
    gaps: list[str]


@dataclass(frozen=True)
class MustStop:
    reason: str


# Attempts at re-forming the group (each drops the members found lost) before the run stops.
REFORM_ATTEMPTS = 5
# How long a lost member may take to say which peer copies it holds (one still answering pings).
PING_RESCUE_S = 5.0


class Membership:
    def __init__(self, spec: JobSpec, group: WorkerGroup, target_size: Callable[[], int] | None = None,
                 summary=None):
        self.spec, self.group = spec, group
        self.summary = summary  # the run's record: its peer_copies (each rank's peer, a copy's bytes)
        # The world to grow back to (the Supervisor's: the spec's, under a requested ceiling).
        self.target_size = target_size or (lambda: policy.target_size(spec))
        # Whether every member holds a whole copy (plain DDP): then any one of them can save it.
        self.layout_replicated = True
        self.departing_pieces: list = []  # state of members leaving a draining node
        self.peers: list[int] = []  # each rank's peer (peer copies), [] when it keeps none
        self.copy_bytes = 0  # the largest rank's copy, estimated when the peers are named
        # What the newest re-form in a sharded layout took state from ("survivors", "peer copies"):
        self.last_sources: list[str] = []
        self.benched: list[Worker] = []  # members the newest re-form benched (still sources of state)
        self.rescued: list[tuple[int, object]] = []  # (step, pieces) of lost members' copies (rescue)

    # ------------------------------------------------------------------ who is in
    def by_slot(self, slots) -> list[Worker]:
        """The members with these slots, in rank order."""
        wanted = set(slots)
        return [w for w in self.group.workers if w.slot in wanted]

    def request_replacements(self) -> None:
        """Replacements are requested at once; they start in the background. Newcomers not up
        after resources.start_timeout_s are let go and asked for again. Newcomers up and on
        standby (too few for the next usable world) count as asked for: a slot more for them
        would be one the world has no place for (an autoscaler would grow a node for it)."""
        g = self.group
        g.drop_stale_pending(self.spec.resources.start_timeout_s)
        self.request(self.target_size() - len(g.workers) - len(g.pending) - len(g.standby))

    def request(self, count: int) -> None:
        for _ in range(max(0, count)):
            self.group.request()

    def ready(self) -> list[Worker]:
        """Newcomers up and not members (on standby, or started), with their node, without
        taking them in (``take_ready``): what a boundary's facts list."""
        g = self.group
        up = []
        started = g.started_pending()
        if started:
            done, _ = ray.wait([w.ready_ref for w in started], num_returns=len(started), timeout=0)
            for w in started:
                if w.ready_ref in done and not w.info:
                    try:
                        g.mark_up(w, ray.get(w.ready_ref))
                    except ray.exceptions.RayError:
                        continue  # died while starting: take_ready lets it go
                up += [w] if w.ready_ref in done and w.info else []
        return list(g.standby) + up

    def take_ready(self) -> list[Worker]:
        """The newcomers that are up, out of the standby and pending lists (to add or bench)."""
        return self.group.ready_pending(timeout_s=0.0)

    def add(self, workers: list[Worker]) -> None:
        self.group.add(workers)

    def bench(self, workers: list[Worker]) -> None:
        """Newcomers too few for the next usable world wait on standby."""
        self.group.standby += workers

    def remove(self, workers: list[Worker]) -> None:
        """Members lost or leaving out of the group: killed and released."""
        self.group.remove(workers)

    def release(self, slots) -> None:
        """Newcomers (starting, up or on standby) the run does not need: let go."""
        wanted = set(slots)
        self.group.remove([w for w in self.group.pending + self.group.standby if w.slot in wanted])

    def release_newcomers(self, healthy: bool = False) -> None:
        self.group.remove(self.group.pending + self.group.standby, healthy)

    def wait_for(self, need: int, timeout_s: float) -> bool:
        """Take newcomers in as they come up until there are ``need`` members (True), or
        nothing is pending any more, or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while len(self.group.workers) + len(self.group.pending) and time.monotonic() < deadline:
            ready = self.group.ready_pending(timeout_s=1.0)
            self.group.add(ready)
            if len(self.group.workers) >= need:
                return True
            self.request_replacements()
        return False

    def survivors_held(self) -> dict[int, int]:
        """Steps held by the members; members that died or stopped answering meanwhile (a
        second fault during the first one's recovery) are removed as well."""
        held, dead, silent = ping_all(self.group.workers)
        if dead or silent:
            log.warning("lost during the rebuild: %s",
                        ", ".join(f"worker {w.slot}" for w in dead + silent))
            self.group.reap(silent)
            self.group.remove(dead + silent)
        return held

    def rescue(self, lost: list[Worker]) -> None:
        """Lost members that still answer (blocked in a collective after their peers were lost:
        they are killed next) may hold peer copies and snapshots the rebuild needs: those go
        into the object store first, owned here, so they outlive the processes."""
        if not self.peers or not lost:
            return
        asked = [(w, w.actor.held_copies.remote()) for w in lost]
        done, _ = ray.wait([ref for _, ref in asked], num_returns=len(asked), timeout=PING_RESCUE_S)
        for w, ref in asked:
            try:
                copies = ray.get(ref) if ref in done else []
            except ray.exceptions.RayError:
                continue  # dead: what it held is gone
            self.rescued += [(c[3], w.actor.rescue_copy.remote(tuple(c))) for c in copies]
        refs = [ref for _, ref in self.rescued]
        ray.wait(refs, num_returns=len(refs), timeout=60)
        if refs:
            log.info("kept %d peer copies and snapshots of %d lost members before they go", len(refs), len(lost))

    def drop(self, lost: MembersLost) -> None:
        """Lost members out. Nobody lost (a timeout): the same members are tried again; a
        healthy one is never dropped, it may hold the only copy of the state."""
        self.group.reap(lost.silent)
        self.group.remove(lost.dead + lost.silent)

    def leave(self, leaving: list[Worker], committed_step: int, healthy: bool = False) -> None:
        """Members leave (a draining node, a shrink, a straggler): in a sharded layout their
        shards may be the only copy, so their pieces go into the object store first (the node
        lives until its deadline) for the re-formed group to take; then they leave (with
        ``healthy``, a shrink's, warm spares back to the pool)."""
        if not self.layout_replicated:
            held, _, _ = ping_all(leaving)
            self.departing_pieces = [w.actor.state_pieces.remote() for w in leaving
                                     if held.get(w.slot) == committed_step]
            # Stored before the leavers are killed: a kill fails the calls it finds queued.
            ray.wait(self.departing_pieces, num_returns=len(self.departing_pieces), timeout=60)
        self.group.remove(leaving, healthy)

    # ------------------------------------------------------------------ forming the group
    def form_group(self, timeout_s: float = 120.0) -> list[dict]:
        results = self.group.form_process_group(timeout_s=timeout_s)
        self.layout_replicated = all(r["replicated"] for r in results)
        self._name_peers(timeout_s)
        return results

    def adopt(self, replicated: bool, timeout_s: float = 120.0) -> None:
        """The group of an adopted launch (``control.adoption``) is formed already: its layout is
        the one its members hold, and each member's peer (peer copies) is named again."""
        self.layout_replicated = replicated
        self._name_peers(timeout_s)

    def _name_peers(self, timeout_s: float) -> None:
        """Peer copies (``checkpoint.peer_copies``) in a sharded layout: each member's peer, on
        another node when there is one (``peer_copies.peer_ring``); in auto mode, only where
        every node has the host memory for them (``peer_copies.room``)."""
        workers = self.group.workers
        degrees = self.spec.parallel.degrees(len(workers))
        if self.layout_replicated or not peer_copies.wanted(self.spec.checkpoint.peer_copies, degrees):
            self.peers = []
            if self.summary is not None:
                self.summary.peer_copies = {}
            return
        nodes = [w.node_id for w in workers]
        memory = ray.get([w.actor.memory_bytes.remote() for w in workers], timeout=timeout_s)
        available = ray.get([w.actor.host_memory_available.remote() for w in workers], timeout=timeout_s)
        self.copy_bytes = max(peer_copies.copy_bytes(m["param_bytes"], self.spec.optim.name) for m in memory)
        short = [n for n, free in zip(nodes, available) if not peer_copies.room(self.copy_bytes, nodes.count(n), free)]
        if short and self.spec.checkpoint.peer_copies < 0:
            self.peers = []
            why = (f"peer copies off: about {peer_copies.COPIES_HELD} x {self.copy_bytes / 2**20:.0f} MB a rank "
                   f"would take more than {peer_copies.HOST_SHARE:.0%} of the memory available on node "
                   f"{short[0][:8]}; set checkpoint.peer_copies: 1 to keep them anyway")
            log.warning(why)
            if self.summary is not None:
                self.summary.peer_copies = {"off": why}
            return
        self.peers = peer_copies.peer_ring(nodes)
        ray.get([w.actor.set_peer.remote(workers[p].actor, p, self.group.generation)
                 for w, p in zip(workers, self.peers)], timeout=timeout_s)
        same = sum(nodes[r] == nodes[p] for r, p in enumerate(self.peers))
        if self.summary is not None:
            self.summary.peer_copies = {"peers": self.peers, "bytes_per_copy_estimate": self.copy_bytes}
        log.info("peer copies: each rank's blocks go to a peer after every step (rank -> peer: %s); "
                 "about %.1f MB a copy, held by the peer and as a snapshot by the rank%s",
                 ", ".join(f"{r}->{p}" for r, p in enumerate(self.peers)), self.copy_bytes / 2**20,
                 f"; {same} on their own node (a lost node loses those copies)" if same else "")

    def rebuild(self, committed_step: int, source_slot: int | None = None
                ) -> Reformed | BelowMinimum | NeedsRestore | MustStop:
        """The group re-formed around the members that are left (replacements asked for, the
        ready ones taken in), every member holding the committed step; members lost meanwhile
        are dropped and the group re-formed again, REFORM_ATTEMPTS times at most."""
        need = policy.min_world(self.spec)
        for _ in range(REFORM_ATTEMPTS):
            self.request_replacements()
            have = len(self.group.workers) + len(self.ready())
            if have < need:
                return BelowMinimum(have, need)
            outcome = self.reform(committed_step, source_slot)
            if isinstance(outcome, Lost):
                continue
            if isinstance(outcome, (NoHolders, AllLost)):
                return NeedsRestore([], [])
            if isinstance(outcome, Uncovered):
                return NeedsRestore(outcome.members, outcome.gaps)
            return outcome
        return MustStop(f"could not re-form the process group after {REFORM_ATTEMPTS} attempts")

    def regroup(self) -> BelowMinimum | None:
        """No member holds the committed step: a fresh group of new workers (and whoever is
        left) to load a checkpoint into; ``BelowMinimum`` while too few are up."""
        self.departing_pieces, self.rescued = [], []
        self.request_replacements()
        have, need = len(self.group.workers) + len(self.ready()), policy.min_world(self.spec)
        if have < need:
            return BelowMinimum(have, need)
        self.group.add(self.take_ready())
        self.form_group(timeout_s=120.0)
        return None

    def reform(self, committed_step: int, source_slot: int | None = None
               ) -> Reformed | NoHolders | Uncovered | Lost | AllLost:
        """New process group over the members + the newcomers that are up; equalize state from
        a member that holds the committed step (``source_slot`` when it still can). Members
        lost meanwhile are dropped (``Lost``: try again; ``AllLost`` when none is left)."""
        self.group.add(self.group.ready_pending(timeout_s=0.0))
        members = list(self.group.workers)
        self.last_sources = []
        try:
            try:
                return self._reform(members, committed_step, source_slot)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                raise MembersLost(*ping_all(members)[1:]) from None
        except MembersLost as lost:
            log.warning("re-forming the group failed (%s); dropping %d lost workers", lost,
                        len(lost.dead + lost.silent))
            self.drop(lost)
            return Lost(lost) if self.group.workers else AllLost()

    def _reform(self, members: list[Worker], committed_step: int,
                source_slot: int | None) -> Reformed | NoHolders | Uncovered:
        # Members known lost now (e.g. a node gone since the last step) would stall
        # the rendezvous until its timeout: leave them out from the start.
        held, dead, silent = ping_all(members)
        if dead or silent:
            raise MembersLost(dead, silent)
        everyone, held_before = members, held
        members = self._fit_to_layout(members, held, committed_step)
        # Members benched for the layout still hold state (theirs, and peer copies): sources too.
        self.benched = [w for w in everyone if w.slot not in {m.slot for m in members}]
        results = self.form_group(timeout_s=RENDEZVOUS_TIMEOUT_S + 30.0)
        held, dead, silent = ping_all(members)
        if dead or silent:
            raise MembersLost(dead, silent)
        holders = [w.slot for w in members if held[w.slot] == committed_step]
        sharded = any(r["stashed"] for r in results) or not all(r["replicated"] for r in results)
        if not holders and not (sharded and (any(s == committed_step for s, _ in self.rescued)
                                             or self._copies_at(everyone, committed_step))):
            return NoHolders(members)
        if sharded:
            gaps = self._share_state_as_pieces(members, {**held_before, **held}, committed_step)
            if gaps:
                return Uncovered(members, gaps)
        elif len(set(held.values())) > 1:
            src_slot = source_slot if source_slot in holders else holders[0]
            src = next(i for i, w in enumerate(members) if w.slot == src_slot)
            ray.get([w.actor.sync_state.remote(src) for w in members], timeout=120)
        held, dead, silent = ping_all(members)
        if dead or silent:
            raise MembersLost(dead, silent)
        assert set(held.values()) == {committed_step}, \
            f"members hold {held} after the state sync, committed {committed_step}"
        return Reformed(members)

    def _copies_at(self, members: list[Worker], step: int) -> list[tuple[Worker, tuple]]:
        """The peer copies of ``step`` the members hold, and their own snapshots of it (a member
        that ran the next optimizer step but not its agreement holds a later step): (holder,
        (kind, generation, source, step))."""
        held = ray.get([w.actor.held_copies.remote() for w in members], timeout=60)
        return [(w, tuple(c)) for w, copies in zip(members, held) for c in copies if c[3] == step]

    def _fit_to_layout(self, members: list[Worker], held: dict[int, int], committed_step: int) -> list[Worker]:
        """The members the parallel degrees can use: the largest usable world, holders of the
        committed step first; the rest wait on standby for a larger world."""
        extra = policy.standby_for_layout(members, held, committed_step, self.spec.parallel)
        if not extra:
            return members
        self.group.bench(extra)
        log.info("%d worker(s) on standby: parallel degrees need a world of %d, not %d",
                 len(extra), len(members) - len(extra), len(members))
        return [w for w in self.group.workers]

    def _share_state_as_pieces(self, members: list[Worker], held: dict[int, int], step: int) -> list[str]:
        """Members re-cut for a new layout take their blocks of the state the holders of the
        committed step hold (and the pieces of members that just left a draining node), by
        blocks (raytrain_sys.parallel.reshard): each member plans from the sources' indexes
        which parts it needs of whom, each source cuts those parts, and each member copies them
        in, chunk by chunk; no one holds the whole state. The Supervisor reads shapes and
        offsets only: the parts go by reference. Returns what the sources do not cover (empty: all is covered,
        and loaded), e.g. the only shard of some layer died; then nothing is loaded."""
        sources = [*members, *self.benched]  # the members benched by this re-form hold state too
        holders = [w for w in sources if held.get(w.slot) == step]
        # The indexes (shapes and offsets) are fetched here, not passed on as references: a
        # member's calls wait in order behind one whose arguments are not ready yet, its pings
        # included, and a departed member's index takes a task's start.
        indexes = ray.get([w.actor.piece_index.remote() for w in holders], timeout=300)
        # Peer copies of this step that members hold, after the members' own state: a block
        # comes from the first source that has it, so a copy fills only what no survivor holds.
        # (a holder's own snapshot of the step is its live state again: not a source)
        copies = [(w, c) for w, c in self._copies_at(sources, step) if not (c[0] == "own" and w in holders)]
        copy_indexes = ray.get([w.actor.piece_index.remote(c) for w, c in copies], timeout=300)
        rescued = [ref for s, ref in self.rescued if s == step]
        self.departing_pieces, self.rescued = self.departing_pieces + rescued, []
        departed = []
        departed_indexes = [index_departed.remote(ref) for ref in self.departing_pieces]
        for ref, index in zip(self.departing_pieces, departed_indexes):
            try:
                indexes.append(ray.get(index, timeout=300))
                departed.append(ref)
            except ray.exceptions.RayError as exc:  # the leaver died before its pieces were stored
                log.warning("the pieces of a member that left are lost: %s", type(exc).__name__)
        self.departing_pieces = departed
        indexes += copy_indexes
        plans = ray.get([w.actor.plan_reshard.remote(step, *indexes) for w in members], timeout=300)
        missing = sorted({k for plan in plans for k in plan["missing"]})
        if missing:
            return missing
        n_own = len(holders) + len(departed)
        used = {j for plan in plans for j, chunks in enumerate(plan["chunks"]) if chunks}
        rescued_ids = {id(ref) for ref in rescued}
        copied = {j for j, ref in enumerate(departed, len(holders)) if id(ref) in rescued_ids}
        copied |= set(range(n_own, len(indexes)))
        self.last_sources = (["survivors"] if used - copied else []) + (["peer copies"] if used & copied else [])

        def cut(j: int, chunks: list) -> list:  # one reference a chunk, from source j
            if j < len(holders):
                refs = holders[j].actor.cut_pieces.options(num_returns=len(chunks)).remote(chunks)
            elif j < n_own:
                refs = cut_departed.options(num_returns=len(chunks)).remote(
                    self.departing_pieces[j - len(holders)], chunks)
            else:
                w, c = copies[j - n_own]
                refs = w.actor.cut_pieces.options(num_returns=len(chunks)).remote(chunks, c)
            return [refs] if len(chunks) == 1 else refs

        received = [[ref for j, chunks in enumerate(plan["chunks"]) if chunks for ref in cut(j, chunks)]
                    for plan in plans]
        ray.get([w.actor.load_pieces.remote(step, refs) for w, refs in zip(members, received)],
                timeout=300)
        del received
        self.departing_pieces = []
        return []
