"""The worker group: Ray actors, one per slot, each in a one-bundle placement group.

A slot's bundle holds the spec's CPUs, GPUs and memory per worker, and selects the nodes of the
job's flavor (``resources.market``, ``resources.accelerator_type``: Ray's own node labels, see
``node_roles``) when the spec names one: the job service's jobs run on the flavor they were
admitted on, and every newcomer of a grow or a replacement lands there too.

It owns actors and their placement groups; it does not decide membership or commit steps (the
Supervisor does). The first gang is all or nothing: every slot's placement group must be ready
within the start timeout, or all are removed and the start fails with a clear error.
Afterwards a slot can be added (a replacement or a newcomer, prepared in the background while
the others train) or removed (dead, hung, or on a draining node) one at a time, which is why
each worker has its own one-bundle placement group rather than a share of one gang-wide group.
``shutdown`` leaves no actor and no placement group behind, whatever happened.

Nothing of a launch dies with the process that drives it (issue 56): the slots' placement groups
and the workers are detached, and each worker answers to its node's agent once it is up
(``node_agent``: a claim, ``TrainWorker.hand_to``; before that, to this process, which started
or took it). The agents end the launch when its owner (this process, recorded in the GCS by
``launches.record``) has been gone for ``elastic.orphan_timeout_s``; a run that ends as asked
ends them itself (``shutdown``). Everything is named after the run
(``raytrain-sys:<run_key>:<launch>:``) so that a resumed run can find and remove what an earlier
launch left (``clean_up_leftovers``: at once when that launch's owner is gone).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                            PlacementGroupSchedulingStrategy)

from raytrain_sys.control import GB, NAME_PREFIX, launches, slot_bundle
from raytrain_sys.control.node_agent import RANKS_PER_AGENT, NodeAgent, agent_with_room
from raytrain_sys.control.node_roles import ACCELERATOR_LABEL, MARKET_LABEL
from raytrain_sys.control.owners import JOB_OWNER, owner_gone, this_process
from raytrain_sys.control.spares import NAMESPACE, SpareSource, slots_take_spares
from raytrain_sys.control.worker import RENDEZVOUS_TIMEOUT_S, TrainWorker
from raytrain_sys.errors import ClusterCapacityError, UserError
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)

def selector_of(spec: JobSpec) -> dict[str, str]:
    """The label selector of a spec's worker slots: ``resources.market`` (unless any) and
    ``resources.accelerator_type`` (unless empty), as Ray's node labels name them."""
    r = spec.resources
    selector = {MARKET_LABEL: r.market} if r.market != "any" else {}
    if r.accelerator_type:
        selector[ACCELERATOR_LABEL] = r.accelerator_type
    return selector


def run_name_prefix(run_key: str) -> str:
    """The prefix of every actor and placement group name of one run (all its launches)."""
    return f"{NAME_PREFIX}:{run_key}:"


def connect_ray(spec: JobSpec, warm_workers_per_node: int = 0) -> bool:
    """Connect to the cluster the spec or environment names, or start a local one.

    Returns True when this call started a local cluster (the caller then owns its shutdown).
    ``warm_workers_per_node``: keep that many warm worker processes (torch imported) idle on
    each node for this process's runs (``control.spares``, a pool of this driver's own, ended
    with it): a notebook's second run starts its workers in a fraction of a second, not seconds.
    """
    started = _connect(spec)
    if warm_workers_per_node > 0:
        from raytrain_sys.control.spares import start_pool

        start_pool(warm_workers_per_node, home=True)
    return started


def _connect(spec: JobSpec) -> bool:
    if ray.is_initialized():
        return False
    address = spec.resources.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        check_ray_auth(address)
        # No runtime_env here: under `ray job submit` it would replace the job's own (its
        # working_dir); workers set their thread count themselves.
        ray.init(address=address, log_to_driver=True)
        return False
    num_cpus = spec.resources.local_num_cpus or os.cpu_count() or 1
    if spec.resources.num_workers * spec.resources.cpus_per_worker > num_cpus:  # no cluster started
        raise _local_capacity_error("CPU", num_cpus, spec.resources.num_workers, spec.resources.cpus_per_worker)
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(spec.resources.cpus_per_worker)))}}
    try:
        # address="local" never attaches to some other cluster that happens to run on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 runtime_env=runtime_env, log_to_driver=True)
    except Exception as exc:  # Ray's own: a process of the node did not start (in time)
        with contextlib.suppress(Exception):
            ray.shutdown()  # whatever of the node did start
        raise local_start_error(exc) from None
    return True


def local_start_error(exc: BaseException) -> UserError:
    """Ray's failure to start the local cluster, as one line saying what to do. On a loaded
    machine a node's processes can miss Ray's waits (its GCS port file, 30 s by default; the
    raylet's registration, 30 s, fixed), and Ray raises a bare RuntimeError or Exception with
    its traceback."""
    said = " ".join(str(exc).split())[:300] or type(exc).__name__
    return UserError(f"the local Ray cluster did not start ({said}); on a busy machine try again when it is "
                     f"less loaded, or wait longer for Ray's GCS (RAY_gcs_server_port_wait_time_s=120), or "
                     f"start Ray yourself (`ray start --head`) and give its address (RAY_ADDRESS or "
                     f"resources.ray_address)")


RAY_TOKEN_SOURCES = "$RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token"


def check_ray_auth(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once, in one line, when the cluster at ``address`` wants Ray's auth token and
    this process does not send it (or sends another). Ray 2.60 turns token authentication on for
    clusters started with ``ray start --head`` when a token exists, but ``ray.init(address=...)``
    sends the token only under RAY_AUTH_MODE=token; without it Ray retries for about 20 s and
    raises a bare ``ConnectionError``. The probe is one key-value read from the cluster's GCS
    (``ray._raylet.GcsClient``, what Ray's own CLI uses; not a public API: tests/test_bad_input.py
    fails if it stops answering this way). An unreachable address is left to ``ray.init``."""
    import socket
    import threading

    if "://" in address or address in ("auto", "local"):
        return  # Ray Client, or "the cluster on this machine": ray.init resolves it
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=2.0).close()
    except (OSError, ValueError):
        return  # nothing listens there: ray.init says so
    outcome: dict = {}

    def probe() -> None:
        try:
            from ray._raylet import GcsClient

            GcsClient(address=address).internal_kv_get(b"raytrain-sys:auth-probe", None, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001: only an authentication refusal matters here
            outcome["error"] = exc

    thread = threading.Thread(target=probe, daemon=True, name="ray-auth-probe")
    thread.start()
    thread.join(timeout_s + 1.0)
    if not isinstance(outcome.get("error"), ray.exceptions.AuthenticationError):
        return
    mode = os.environ.get("RAY_AUTH_MODE", "")
    if mode != "token":
        default = os.path.expanduser("~/.ray/auth_token")
        here = ("$RAY_AUTH_TOKEN is set here" if os.environ.get("RAY_AUTH_TOKEN") else
                f"$RAY_AUTH_TOKEN_PATH names {os.environ['RAY_AUTH_TOKEN_PATH']}"
                if os.environ.get("RAY_AUTH_TOKEN_PATH") else
                f"{default} exists here" if os.path.exists(default) else
                f"{default} does not exist here: copy the head's")
        raise UserError(f"the Ray cluster at {address} requires its auth token and this process sends none: "
                        f"set RAY_AUTH_MODE=token (the token is read from {RAY_TOKEN_SOURCES}; {here})")
    raise UserError(f"the Ray cluster at {address} refused this process's auth token (RAY_AUTH_MODE=token, "
                    f"read from {RAY_TOKEN_SOURCES}): use the cluster's own (`ray get-auth-token` on its head)")


def _local_capacity_error(res: str, have: float, num_workers: int, per_worker: float) -> ClusterCapacityError:
    return ClusterCapacityError(
        f"the local Ray cluster has {have:g} {res} in total but the group needs {num_workers * per_worker:g} "
        f"(resources.num_workers={num_workers} x {per_worker:g} {res} per worker): "
        f"lower resources.num_workers, or raise resources.local_num_cpus / connect to a "
        f"bigger cluster with resources.ray_address")


@ray.remote(num_cpus=0, max_retries=0)
def _reap_process(pid: int, create_time: float) -> bool:
    """Kill ``pid`` on this node if it is still the process that started at ``create_time``
    (a pid can be reused once its process is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if create_time and abs(proc.create_time() - create_time) > 0.01:
            return False
        proc.kill()
        return True
    except psutil.NoSuchProcess:
        return False


@dataclass
class Worker:
    """One slot: its actor, its placement group and where it runs."""

    slot: int  # stable id for logs and tests; never reused within a run
    actor: Any
    pg: Any
    info: dict = field(default_factory=dict)  # ip, node_id, pid once started
    ready_ref: Any = None  # prepare() call: completes when the actor is up with its model built
    spare: bool = False  # a warm spare adopted from the pool: given back to it when it leaves healthy
    placed_ref: Any = None  # a newcomer started once its slot is placed (``start_placed``): pg.ready()
    requested_at: float = field(default_factory=time.monotonic)
    agent: tuple | None = None  # the key of its node's agent (``WorkerGroup.agents``), once it is up

    @property
    def node_id(self) -> str:
        return self.info.get("node_id", "")


# How long a warm spare given back is waited for to answer to its driver again (a control-path
# call: milliseconds) before its agent may end.
HAND_BACK_WAIT_S = 2.0


class WorkerGroup:
    # The Ray actor class each slot runs. A hook for benchmarks/control_plane.py, which puts
    # stand-ins that answer at once here to time the Supervisor's own step loop; it must offer
    # TrainWorker's methods (prepare, free_port, ping, setup_group, train_step, ...).
    actor_class = TrainWorker

    def __init__(self, spec: JobSpec, local_cluster: bool, run_key: str = "", spares: SpareSource | None = None):
        self.spec = spec
        self.local_cluster = local_cluster
        # Warm spares for the first gang (raytrain_sys.control.spares): CPU slots only.
        usable = self.actor_class is TrainWorker and slots_take_spares(spec.resources.gpus_per_worker)
        self.spares = spares if usable else None
        self.spares_used = 0
        self.start_phases: dict[str, float] = {}  # start(): seconds to place the slots, then to start the workers
        # Names: run key (shared by every launch of the run, so a resume finds its predecessor's
        # leftovers), then a launch id (two launches never reuse a name), then the slot.
        self.run_key = run_key or spec.name
        self.name_prefix = run_name_prefix(self.run_key) + uuid.uuid4().hex[:8] + ":"
        self.workers: list[Worker] = []  # members of the current process group, rank order
        self.pending: list[Worker] = []  # requested, not yet members
        # Up, but left out of the process group: the parallel degrees need a world size that
        # these would not make (tp x pp = 2 and 3 workers: one waits for a partner).
        self.standby: list[Worker] = []
        self.generation = 0
        self._slots = itertools.count()
        # Set once ``shutdown`` has returned: every actor and placement group of this launch is
        # gone (or given up on), so a job service may hand the slots to the next job while the
        # run still closes its MLflow run (``JobRunner.status()["released"]``).
        self.released = False
        # The process that drives this launch (``owners.this_process``), recorded in the GCS before
        # the first slot is asked for (``launches.record``): the agents end the launch once it is gone.
        self.owner_id = ""
        # Node agents (``node_agent``): (node id, index) -> its handle; the slots each one holds;
        # its first answer's reference (``hand_over``); how many each node has had.
        self.agents: dict[tuple, Any] = {}
        self._agent_slots: dict[tuple, set[int]] = {}
        self._agent_ready: dict[tuple, Any] = {}
        self._agents_made: dict[str, int] = {}
        self._to_hand: dict[tuple, list[Worker]] = {}  # ranks up, waiting for their agent to be (``hand_over``)
        self._handed: set[int] = set()  # slots handed to their agent

    # ------------------------------------------------------------------ resources
    def _bundle(self) -> dict[str, float]:
        r = self.spec.resources
        return slot_bundle(r.cpus_per_worker, r.gpus_per_worker, r.memory_per_worker_gb)

    def _selector(self) -> dict[str, str]:
        """The node labels a slot's bundle asks (``node_roles``: Ray's own market and accelerator
        labels): the job's flavor when it names one (``resources.market``,
        ``resources.accelerator_type``; the job service sets them to the flavor it admitted the
        job on), else none."""
        return selector_of(self.spec)

    def _check_capacity(self, num_workers: int) -> None:
        """Fail at once when no amount of waiting helps: a cluster we started cannot grow."""
        if not self.local_cluster:
            return
        selector = self._selector()
        if selector:  # a node this process started has no market or accelerator label of ours
            field = "resources.market" if MARKET_LABEL in selector else "resources.accelerator_type"
            raise ClusterCapacityError(
                f"the local Ray cluster's node has no label {', '.join(f'{k}={v}' for k, v in selector.items())}: "
                f"{field} asks for nodes it does not have; leave resources.market 'any' and "
                f"resources.accelerator_type empty, or connect to a cluster that labels its nodes "
                f"(resources.ray_address)")
        total = ray.cluster_resources()
        for res, per_worker in self._bundle().items():
            need, have = per_worker * num_workers, total.get(res, 0.0)
            if need > have:
                raise _local_capacity_error(res, have, num_workers, per_worker)

    def request(self, start_actor: bool = True) -> Worker:
        """Ask for one more worker; it starts in the background (see ``ready_pending``). With
        ``start_actor`` False only its placement group is asked for (``_start_actors``). A run
        that takes warm spares starts it once its slot is placed (``start_placed``): on a spare
        of that node when the pool has one, which goes back to the pool when it leaves healthy."""
        slot = next(self._slots)
        self._record_launch()
        selector = self._selector()
        # Detached: the slot outlives this process (its node's agent removes it when the launch
        # ends without it).
        pg = placement_group([self._bundle()], strategy="STRICT_PACK", name=f"{self.name_prefix}{slot}",
                             lifetime="detached", bundle_label_selector=[selector] if selector else None)
        worker = Worker(slot, None, pg)
        if start_actor and self.spares is None:
            self._start_fresh(worker)
        elif start_actor:
            worker.placed_ref = pg.ready()
        self.pending.append(worker)
        return worker

    def start_placed(self) -> None:
        """Start the newcomers whose slots were placed since the last look (``request``)."""
        waiting = [w for w in self.pending if w.actor is None and w.placed_ref is not None]
        if not waiting:
            return
        done, _ = ray.wait([w.placed_ref for w in waiting], num_returns=len(waiting), timeout=0)
        placed = [w for w in waiting if w.placed_ref in done]
        if placed:
            self._start_actors(placed)

    def started_pending(self) -> list[Worker]:
        """The newcomers whose actors are started (``start_placed`` first: those whose slots
        were placed since the last look start now)."""
        self.start_placed()
        return [w for w in self.pending if w.ready_ref is not None]

    def await_pending(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) until every newcomer asked for is up, starting each as its
        slot is placed (``start_placed``); they stay pending for ``ready_pending`` to take. True
        when all of them are up."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            started = self.started_pending()
            unplaced = [w.placed_ref for w in self.pending if w.ready_ref is None and w.placed_ref is not None]
            if unplaced:
                ray.wait(unplaced, num_returns=1, timeout=min(left, 1.0))
                continue
            if not started:
                return True
            done, _ = ray.wait([w.ready_ref for w in started], num_returns=len(started), timeout=left)
            return len(done) == len(started)
        return False

    def _start_fresh(self, w: Worker) -> None:
        """A new worker process in the slot's placement group: detached, claimed by this process
        until it is up and handed to its node's agent (``_up``)."""
        r = self.spec.resources
        w.actor = self.actor_class.options(
            name=f"{self.name_prefix}{w.slot}", namespace=NAMESPACE, lifetime="detached", max_restarts=0,
            num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker,
            **({"memory": r.memory_per_worker_gb * GB} if r.memory_per_worker_gb else {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=w.pg,
                                                                 placement_group_bundle_index=0),
        ).remote(self.spec.to_dict(), self.owner_id)
        w.ready_ref = w.actor.prepare.remote()

    # ------------------------------------------------------------------ node agents
    def _record_launch(self) -> None:
        """This process drives the launch: written once, before its first slot is asked for."""
        if not self.owner_id:
            self.owner_id = this_process()
            launches.record(self.name_prefix, self.owner_id)

    def mark_up(self, w: Worker, info: dict) -> None:
        """``w`` is up on ``info["node_id"]``: it will answer to its node's agent (started now if
        the node has none with room), from the moment that agent is up (``hand_over``)."""
        w.info = info
        key = self._agent_for(w.node_id)
        w.agent = key
        self._agent_slots[key].add(w.slot)
        self._to_hand.setdefault(key, []).append(w)
        self.hand_over()

    def hand_over(self) -> None:
        """Ranks waiting for their agent go to it once it is up (it answered its first call):
        each is claimed by it from then on (``TrainWorker.hand_to``) and the agent holds it
        (``keep``). Until then a rank stays its driver's: a rank never depends on an agent that
        is not up (one that cannot start there, a node draining say, would end it). An agent
        that failed to start is forgotten; its ranks stay the driver's."""
        for key in [k for k, ws in self._to_hand.items() if ws]:
            ref = self._agent_ready.get(key)
            if ref is None or not ray.wait([ref], timeout=0)[0]:
                continue
            waiting = self._to_hand.pop(key)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                log.warning("node agent %d on node %s did not start (%s): its %d rank(s) stay this process's",
                            key[1], key[0][:8], type(exc).__name__, len(waiting))
                self.agents.pop(key, None)
                self._agent_ready.pop(key, None)
                for w in waiting:
                    w.agent = None
                self._agent_slots.pop(key, None)
                continue
            agent = self.agents[key]
            for w in waiting:
                w.actor.hand_to.remote(agent._actor_id.hex())
            agent.keep.remote({w.slot: (w.actor, w.pg) for w in waiting})
            self._handed.update(w.slot for w in waiting)

    def await_agents(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the agents that ranks wait for to be up, then hand those
        ranks over: a run's first lease, so that its leases go through the agents from the start
        (their start began as the slots were placed, beside the workers' own)."""
        refs = [self._agent_ready[k] for k, ws in self._to_hand.items() if ws and k in self._agent_ready]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self.hand_over()

    def handed(self, key: tuple, slots: list[int]) -> bool:
        """Whether every one of ``slots`` answers to the agent of ``key`` (so that the agent can
        take their leases)."""
        return key in self.agents and all(s in self._handed and s in self._agent_slots[key] for s in slots)

    def _agent_for(self, node_id: str) -> tuple:
        """The key of an agent of ``node_id`` with room for one more rank (at most
        ``RANKS_PER_AGENT``), started if there is none."""
        key = agent_with_room({k: len(v) for k, v in self._agent_slots.items()}, node_id, RANKS_PER_AGENT)
        if key is not None:
            return key
        index = self._agents_made.get(node_id, 0)
        self._agents_made[node_id] = index + 1
        key = (node_id, index)
        where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)} if node_id else {}
        agent = NodeAgent.options(name=launches.agent_name(self.name_prefix, node_id, index), namespace=NAMESPACE,
                                  lifetime="detached", **where).remote(
            self.name_prefix, node_id, self.owner_id, self.spec.elastic.orphan_timeout_s)
        self.agents[key], self._agent_slots[key] = agent, set()
        self._agent_ready[key] = agent.ping.remote()  # answers once the agent is up
        log.info("node agent %d started on node %s", index, node_id[:8] or "?")
        return key

    def agent_lost(self, agent) -> None:
        """An agent found dead (its call failed): its ranks died with it (their claim); a later
        rank of its node gets a new one."""
        for key in [k for k, a in self.agents.items() if a is agent]:
            del self.agents[key]
            self._agent_slots.pop(key, None)
            self._agent_ready.pop(key, None)
            self._to_hand.pop(key, None)

    def _forget_rank(self, w: Worker) -> None:
        """``w`` left: no longer its agent's to end. An agent left with no rank ends (it would
        keep a drained node from ending when its last slot goes, as Ray ends an idle drained
        node): a later rank of its node starts another."""
        self._handed.discard(w.slot)
        if w.agent is None:
            return
        slots = self._agent_slots.get(w.agent, set())
        slots.discard(w.slot)
        self._to_hand[w.agent] = [x for x in self._to_hand.get(w.agent, []) if x.slot != w.slot]
        agent = self.agents.get(w.agent)
        if agent is None:
            return
        try:
            if slots:
                agent.drop.remote([w.slot])
            else:
                ray.kill(agent, no_restart=True)
                self.agent_lost(agent)
        except Exception:  # noqa: BLE001: the agent is gone: nothing to tell
            pass

    def _end_agents(self) -> None:
        for agent in self.agents.values():
            try:
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001: gone already
                pass
        self.agents, self._agent_slots, self._agent_ready, self._to_hand = {}, {}, {}, {}
        self._handed = set()

    def _start_actors(self, workers: list[Worker]) -> None:
        """Each placed slot's worker: a warm spare taken on the bundle's node, else a new spare
        started there for it (``SpareSource.new_claimed``: a fresh process's cost, and the pool's to
        keep when the job lets it go). A spare works in the slot's bundle; it holds no resource
        of its own."""
        tables = [ray.util.placement_group_table(w.pg) for w in workers]
        node_ids = [t["bundles_to_node_id"][0] for t in tables]
        for node_id in dict.fromkeys(node_ids):  # its agent starts beside the workers, not after them
            if not any(key[0] == node_id for key in self.agents):
                self._agent_for(node_id)
        spec_dict = self.spec.to_dict()
        for w, node_id, spare in zip(workers, node_ids, self.spares.take(node_ids)):
            self.spares_used += spare is not None
            # None: the pool had none there; a spare of the slot's own, which the pool keeps later
            w.actor, w.spare = spare or self.spares.new_claimed(node_id), True
            w.ready_ref = w.actor.adopt.remote(spec_dict)

    def ready_pending(self, timeout_s: float = 0.0) -> list[Worker]:
        """Workers that are up and not members: standby ones, then pending ones whose actor
        is up (moved out of ``standby`` and ``pending``)."""
        ready, self.standby = self.standby, []
        started = self.started_pending()
        if not started:
            return ready
        refs = [w.ready_ref for w in started]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for w in started:
            if w.ready_ref in done:
                if not w.info:
                    try:
                        self.mark_up(w, ray.get(w.ready_ref))
                    except ray.exceptions.RayError as exc:  # died while starting: drop, ask again later
                        log.warning("worker slot %d failed to start: %s", w.slot, exc)
                        self.pending.remove(w)
                        self._release(w)
                        continue
                self.pending.remove(w)
                ready.append(w)
        return ready

    def drop_stale_pending(self, timeout_s: float) -> list[Worker]:
        """Release requested workers that are not up after ``timeout_s``: e.g. placed on a node
        that vanished, which Ray declares dead only after its health checks (about 15-30 s).
        Their slots are requested again."""
        now = time.monotonic()
        stale = [w for w in self.pending if now - w.requested_at > timeout_s]
        for w in stale:
            log.warning("worker slot %d not up after %.0f s: requesting another", w.slot, timeout_s)
        self.remove(stale)
        return stale

    def start(self, num_workers: int, on_placed: Callable[[], None] | None = None) -> None:
        """The first gang: all ``num_workers`` up within the start timeout, or none.
        ``on_placed``: called once every slot is placed, before the workers start in them."""
        self._check_capacity(num_workers)
        for _ in range(num_workers):
            self.request(start_actor=self.spares is None)
        timeout = self.spec.resources.start_timeout_s
        t0 = time.perf_counter()
        pgs = [w.pg.ready() for w in self.pending]
        ready, _ = ray.wait(pgs, num_returns=len(pgs), timeout=timeout)
        self.start_phases = {"placement": time.perf_counter() - t0}
        if len(ready) < len(pgs):
            total, avail = ray.cluster_resources(), ray.available_resources()
            self.shutdown()
            on = f" on nodes labelled {self._selector()}" if self._selector() else ""
            raise ClusterCapacityError(
                f"the cluster could not hold {num_workers} workers x {self._bundle()}{on} within "
                f"{timeout:g} s (resources.start_timeout_s); cluster total CPU={total.get('CPU', 0):g} "
                f"GPU={total.get('GPU', 0):g}, available CPU={avail.get('CPU', 0):g}: lower "
                f"resources.num_workers or add nodes")
        if on_placed is not None:
            on_placed()
        if self.spares is not None:
            self._start_actors(self.pending)
        started = self.ready_pending(timeout_s=timeout + 60)
        if self.spares is not None and len(started) < num_workers:
            # A spare that died between its claim and its adoption: its slot once more, fresh.
            for _ in range(num_workers - len(started)):
                self._start_fresh(self.request(start_actor=False))
            started += self.ready_pending(timeout_s=timeout + 60)
        if len(started) < num_workers:
            self.shutdown()
            raise ClusterCapacityError(f"only {len(started)} of {num_workers} workers started")
        self.workers = started
        self.start_phases["workers"] = time.perf_counter() - t0 - self.start_phases["placement"]

    # ------------------------------------------------------------------ membership
    def remove(self, workers: list[Worker], healthy: bool = False) -> None:
        """Kill and release workers (dead, hung or draining); the others keep running. With
        ``healthy`` (a shrink lets them go), warm spares go back to the pool instead."""
        for w in workers:
            if w in self.workers:
                self.workers.remove(w)
            if w in self.pending:
                self.pending.remove(w)
            if w in self.standby:
                self.standby.remove(w)
        self._let_go(workers, healthy)

    def _let_go(self, workers: list[Worker], healthy: bool) -> None:
        """Warm spares that leave healthy go back to the pool, answering to this process again
        first (``TrainWorker.hand_to``, waited for: their agent may end next); the rest are
        killed, and every slot removed."""
        back = [w for w in workers if healthy and w.spare and w.node_id and self.spares is not None]
        handed = [w.actor.hand_to.remote(self.owner_id) for w in back if w.slot in self._handed]
        if handed:  # a control-path call: milliseconds
            ray.wait(handed, num_returns=len(handed), timeout=HAND_BACK_WAIT_S)
        if back and self.spares.give_back([(w.actor, w.node_id) for w in back]):
            for w in back:
                with contextlib.suppress(Exception):
                    remove_placement_group(w.pg)
                self._forget_rank(w)
            workers = [w for w in workers if w not in back]
        for w in workers:
            self._release(w)

    def reap(self, workers: list[Worker]) -> None:
        """SIGKILL the processes of workers that stopped answering, from their own node.

        ``ray.kill`` of a process that cannot answer (stopped, wedged) takes effect only after
        Ray's own timeout, about 5 s on Ray 2.60; until then its peers stay blocked in their
        collective, since a silent peer closes no socket. A 0-CPU task pinned to the node
        kills it at once (about the time a Ray worker process takes to start there). Fire and
        forget: on a vanished node the task never runs, and nothing is left to kill.
        """
        for w in workers:
            if not w.node_id or "pid" not in w.info:
                continue
            _reap_process.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                w.node_id, soft=False)).remote(w.info["pid"], w.info.get("create_time", 0.0))

    def add(self, workers: list[Worker]) -> None:
        self.workers.extend(workers)

    def bench(self, workers: list[Worker]) -> None:
        """Take members out of the process group but keep them up, for a later, larger world."""
        for w in workers:
            self.workers.remove(w)
            self.standby.append(w)

    def _release(self, w: Worker) -> None:
        try:
            if w.actor is not None:
                ray.kill(w.actor, no_restart=True)
        except Exception:  # already dead
            pass
        try:
            remove_placement_group(w.pg)
        except Exception:
            pass
        self._forget_rank(w)

    # ------------------------------------------------------------------ process group
    def form_process_group(self, timeout_s: float = 120.0) -> list[dict]:
        """New generation: a fresh master port on rank 0's node; every member (re)joins.
        Returns each member's ``setup_group`` answer, in rank order."""
        self.generation += 1
        master = self.workers[0]
        port = ray.get(master.actor.free_port.remote(), timeout=timeout_s)
        refs = [w.actor.setup_group.remote(rank, len(self.workers), master.info["ip"], port,
                                           self.generation)
                for rank, w in enumerate(self.workers)]
        try:
            results = ray.get(refs, timeout=timeout_s)
        except Exception:
            # A member failed (died?) while the others may still wait in this generation's
            # rendezvous: let them leave it (they fail once its timeout passes) so that the
            # next attempt does not queue behind them.
            ray.wait(refs, num_returns=len(refs), timeout=RENDEZVOUS_TIMEOUT_S + 10.0)
            raise
        log.info("process group generation %d formed: world=%d backend=%s master=%s:%d",
                 self.generation, len(self.workers), results[0]["backend"], master.info["ip"], port)
        return results

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def held(self) -> int:
        """Slots the run holds (each a placement group, paid for): members, newcomers still
        starting, members on standby."""
        return len(self.workers) + len(self.pending) + len(self.standby)

    def actors(self) -> list[Any]:
        return [w.actor for w in self.workers]

    # ------------------------------------------------------------------ end
    def shutdown(self, wait_s: float = 10.0, healthy: bool = False) -> None:
        """Kill every actor and remove every placement group of this launch, and wait (up to
        ``wait_s``) until Ray reports them gone: ``ray.kill`` only asks. With ``healthy`` (the
        run ended as it was asked to), warm spares go back to the pool instead of being killed;
        then the agents end, and the launch's record goes."""
        self._let_go(self.workers + self.pending + self.standby, healthy)
        self.workers, self.pending, self.standby = [], [], []
        self._end_agents()
        if self.owner_id:
            launches.forget(self.name_prefix)
        try:
            self._wait_gone(wait_s)
        finally:
            self.released = True

    def _wait_gone(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                left = [x for x in find_leftovers(self.run_key) if x.name.startswith(self.name_prefix)]
            except Exception as exc:  # e.g. the cluster itself is gone: nothing to wait for
                log.debug("could not list leftovers: %s", exc)
                return
            if not left:
                return
            if time.monotonic() >= deadline:
                log.warning("still present %g s after shutdown: %s", wait_s,
                            ", ".join(f"{x.kind} {x.name}" for x in left))
                return
            for x in left:  # e.g. a worker that was still starting when it was killed
                _remove(x)
            time.sleep(0.1)


# ---------------------------------------------------------------------- leftovers of a lost driver
@dataclass
class Leftover:
    """An actor or placement group of some earlier launch of a run that is still there."""

    kind: str  # "actor" | "placement_group"
    name: str
    job_id: str  # the Ray job (driver) that created it
    namespace: str = ""
    pg_id: str = ""


def find_leftovers(run_key: str) -> list[Leftover]:
    """Actors not dead and placement groups not removed whose names belong to ``run_key``.

    Reads the GCS tables directly: no dashboard needed, as on a locally started cluster.
    """
    from ray._private import state

    prefix = run_name_prefix(run_key)
    found = []
    named = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)}
    if named:
        for info in state.actors().values():
            name = info.get("Name") or ""
            if name in named and info.get("State") != "DEAD":
                found.append(Leftover("actor", name, info["JobID"], namespace=named[name]))
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            # A placement group id ends with the id of the job that created it (4 bytes).
            found.append(Leftover("placement_group", info["name"], pg_id[-8:], pg_id=pg_id))
    return found


def _live_jobs() -> dict[str, dict]:
    from ray._private import state

    return {j["JobID"]: j for j in state.state.job_table() if not j.get("IsDead")}


def _remove(left: Leftover) -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    try:
        if left.kind == "actor":
            ray.kill(ray.get_actor(left.name, namespace=left.namespace), no_restart=True)
        else:
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(left.pg_id))))
    except ValueError:  # gone between the listing and now
        pass


def clean_up_leftovers(run_key: str, grace_s: float = 10.0, poll_s: float = 0.2) -> list[Leftover]:
    """Remove what earlier launches of ``run_key`` left behind; return what was removed.

    A launch's owner is recorded in the GCS (``launches``): a launch whose owner is gone is
    ended at once (``launches.end_launch``: its agents end their ranks, its slots are removed),
    before its agents' own ``elastic.orphan_timeout_s`` would. Leftovers of no recorded launch
    (a leak, another tool's) are removed once the Ray job that made them is dead; Ray removes a
    dead driver's non-detached actors by itself within about 0.3 s, which the grace period
    covers. Leftovers whose owner (or job) stays alive through the grace period mean the earlier
    driver still runs: resuming would train the same run twice, so that is an error.
    """
    me = this_process()
    my_job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + grace_s
    removed: dict[tuple[str, str], Leftover] = {}
    ended: set[str] = set()
    while True:
        left, held, live = [], [], None
        found = find_leftovers(run_key)
        owners = {}  # launch prefix -> its recorded owner (None: no record), read once a look
        for x in found:
            prefix = launches.launch_prefix(x.name)
            if prefix not in owners:
                owners[prefix] = launches.owner_of(prefix) if prefix else None
        gone = {p for p, owner in owners.items() if owner is not None and owner_gone(owner)}
        for prefix in gone - ended:
            log.warning("ending launch %s of run %s: its driver (%s) is gone", prefix, run_key, owners[prefix])
            launches.end_launch(prefix)
            ended.add(prefix)
        for x in found:
            prefix = launches.launch_prefix(x.name)
            owner = owners.get(prefix) or (prefix in ended and "ended") or None
            if owner == me or (owner is None and x.job_id == my_job):
                continue  # this process's own launch, or this job's own of no recorded launch
            left.append(x)
            if prefix in ended:
                removed[(x.kind, x.name)] = x  # ended: what is still listed goes meanwhile
            elif owner is not None:
                held.append((x, owner))
            else:
                live = _live_jobs() if live is None else live
                if x.job_id in live:
                    held.append((x, JOB_OWNER + x.job_id))
                else:  # removal is asynchronous: ask again only once
                    if (x.kind, x.name) not in removed:
                        log.warning("removing %s %s left by Ray job %s, whose driver is gone",
                                    x.kind.replace("_", " "), x.name, x.job_id)
                        _remove(x)
                    removed[(x.kind, x.name)] = x
        if not left:
            return list(removed.values())
        if time.monotonic() >= deadline:
            if held:
                live = _live_jobs()
                drivers = ", ".join(sorted({_driver_words(owner, live) for _, owner in held}))
                raise UserError(
                    f"run {run_key} is still running: {len(held)} of its workers/placement groups "
                    f"belong to the live {drivers}; stop that driver (Ctrl-C, or `ray job "
                    f"stop`) and resume again")
            raise UserError(
                f"could not remove {len(left)} actors/placement groups left by an earlier driver "
                f"of run {run_key} within {grace_s:g} s ({', '.join(x.name for x in left)}); "
                f"check the cluster's state (`ray list actors`, `ray list placement-groups`)")
        time.sleep(poll_s)


def _driver_words(owner: str, live: dict[str, dict]) -> str:
    """An owner id as the error names it: a Ray job with its driver's pid and host, or an actor."""
    if not owner.startswith(JOB_OWNER):
        return f"actor {owner}"
    job = owner[len(JOB_OWNER):]
    info = live.get(job, {})
    return f"Ray job {job} (driver pid {info.get('DriverPid')} on {info.get('DriverIPAddress')})"
