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

from raytrain_sys.control import GB, launches, slot_bundle
from raytrain_sys.control.node_agent import NodeAgents
from raytrain_sys.control.node_roles import ACCELERATOR_LABEL, MARKET_LABEL
from raytrain_sys.control.launches import find_leftovers, remove_leftover, run_name_prefix
from raytrain_sys.control.owners import this_process
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
        # run still closes its MLflow run (``JobRunner.status().released``).
        self.released = False
        # The process that drives this launch (``owners.this_process``), recorded in the GCS before
        # the first slot is asked for (``launches.record``): the agents end the launch once it is gone.
        self.owner_id = ""
        # The launch's node agents (``node_agent``): whom each rank answers to once it is up.
        self.agents = NodeAgents(self.name_prefix, spec.elastic.orphan_timeout_s)

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
        until it is up and handed to its node's agent (``mark_up``)."""
        r = self.spec.resources
        w.actor = self.actor_class.options(
            name=f"{self.name_prefix}{w.slot}", namespace=NAMESPACE, lifetime="detached", max_restarts=0,
            num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker,
            **({"memory": r.memory_per_worker_gb * GB} if r.memory_per_worker_gb else {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=w.pg,
                                                                 placement_group_bundle_index=0),
        ).remote(self.spec.to_dict(), self.owner_id)
        w.ready_ref = w.actor.prepare.remote()

    def adopt(self, adoption) -> None:
        """Drive the ranks of an adopted launch (``control.adoption.Adoption``) as this group's
        members: the same processes, placement groups, agents and process group (its
        generation), in rank order. This process owns the launch already (``adoption.find``)."""
        self.name_prefix = adoption.prefix
        self.owner_id = this_process()
        self.agents = NodeAgents(adoption.prefix, self.spec.elastic.orphan_timeout_s)
        slots: dict[tuple, list[int]] = {}
        for r in adoption.ranks:
            info = {k: r.state[k] for k in ("ip", "node_id", "pid", "create_time", "nice")}
            self.workers.append(Worker(r.slot, r.actor, r.pg, info=info, agent=r.agent))
            if r.agent is not None:
                slots.setdefault(r.agent, []).append(r.slot)
        self.agents.take(self.owner_id, adoption.agents, slots)
        for w in self.workers:
            if w.agent is None:  # its agent was still starting when the driver was lost
                self.agents.assign(w)
        self.generation = adoption.generation
        self._slots = itertools.count(max(r.slot for r in adoption.ranks) + 1)

    # ------------------------------------------------------------------ node agents
    def _record_launch(self) -> None:
        """This process drives the launch: written once, before its first slot is asked for."""
        if not self.owner_id:
            self.owner_id = self.agents.owner_id = this_process()
            launches.record(self.name_prefix, self.owner_id)

    def mark_up(self, w: Worker, info: dict) -> None:
        """``w`` is up on ``info["node_id"]``: it will answer to its node's agent
        (``NodeAgents.assign``: started now if the node has none with room), from the moment that
        agent is up."""
        w.info = info
        self.agents.assign(w)

    def _start_actors(self, workers: list[Worker]) -> None:
        """Each placed slot's worker: a warm spare taken on the bundle's node, else a new spare
        started there for it (``SpareSource.new_claimed``: a fresh process's cost, and the pool's to
        keep when the job lets it go). A spare works in the slot's bundle; it holds no resource
        of its own."""
        tables = [ray.util.placement_group_table(w.pg) for w in workers]
        node_ids = [t["bundles_to_node_id"][0] for t in tables]
        for node_id in dict.fromkeys(node_ids):  # its agent starts beside the workers, not after them
            self.agents.ensure(node_id)
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
        handed = [w.actor.hand_to.remote(self.owner_id) for w in back if w.agent is not None]
        if handed:  # a control-path call: milliseconds
            ray.wait(handed, num_returns=len(handed), timeout=HAND_BACK_WAIT_S)
        if back and self.spares.give_back([(w.actor, w.node_id) for w in back]):
            for w in back:
                with contextlib.suppress(Exception):
                    remove_placement_group(w.pg)
                self.agents.forget(w)
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
        self.agents.forget(w)

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
        self.agents.end()
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
                remove_leftover(x)
            time.sleep(0.1)
