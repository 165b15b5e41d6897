"""Warm spares: worker processes started ahead of any job, torch imported, waiting on each node.

A job's first gang otherwise waits for each worker process to start and import torch and our
code (about 2 s a worker on a 2-core machine, more under load), on top of its runner's own
start. A spare is a ``TrainWorker`` created with no job (``TrainWorker(None)``): one process,
imports done, nothing built. A gang start takes one per placed slot from the pool and makes it
the slot's worker (``claim``, then ``adopt(spec)``), so its first step waits only for the model
build and the process group.

Ownership, because a spare must outlive its pool but never its job:

* Spares are **detached** and named ``raytrain-sys-spare-<id>`` (namespace ``raytrain-sys``):
  a pool that restarts finds its idle spares again by name, and a pool that dies takes no
  running job's workers with it.
* A spare is **claimed** by the actor that will adopt it (a job's runner) before it is handed
  out: from then on a thread in the spare pings that actor and ends the process when it is
  dead. A runner killed mid-start or mid-run therefore leaves no worker behind, as a worker
  it created itself would not (Ray ends a non-detached actor with its owner).
* **0 logical CPUs**: an idle spare holds no slot. The slot a spare works in is the job's
  one-bundle placement group, as for any worker; the spare is taken on that bundle's node. The
  scheduler's accounting does not change: idle spares are spare processes, not capacity.
* **Given back**: a spare that leaves its job healthy (the run ended, finished, paused or
  cancelled, or a shrink let it go) goes back to the pool (``give_back``): it destroys its
  process groups, drops DTensor's and torch.compile's caches and every attribute of the job
  (``TrainWorker.recycle``), and waits idle on its node for the next job, in place of a new
  spare still importing there (ended: its imports would take the CPU that jobs train on). The
  pool starts a node's replacements only ``REFILL_DELAY_S`` after a take there, so that a short
  job (a sweep's trial) gives its processes back before new ones are paid for: a stream of
  short jobs then runs on the same warm processes. On a loaded 2-core machine a new worker
  process took 25-35 s to start beside training jobs (Ray starts at most as many at once as the
  node has cores), an adoption 0.5-0.8 s. A worker that was lost, replaced or drained is
  killed, as is one that served ``MAX_JOBS_PER_PROCESS`` jobs or grew by
  ``RECYCLE_GROWTH_BYTES`` (its heap is the largest job's), and one the pool does not need (its
  node has ``per_node`` idle).

Who uses spares: runs inside an actor (the service's runners) take any pool's; a run from a
driver (a notebook, a script) takes the spares of a pool its own Ray job started
(``rts.connect(spec, warm_workers_per_node=1)``), since spares run with the code and import
path of the job that made them: a claim by a driver is a claim by its Ray job (``job:<id>``,
ended when the job table says that job is dead), and the spares and pool of a driver's job end
with it (``home_id``). Both take them for the first gang, and for newcomers (growth,
replacements) once their slots are placed (``WorkerGroup.start_placed``), so that every worker
can go back to the pool; a newcomer with no spare on its node starts fresh, in the background
while the group trains. Only CPU slots: Ray binds GPUs to a process when it is created (CUDA_VISIBLE_DEVICES),
so a spare made before the job cannot be handed the GPU its bundle reserved; GPU slots start
fresh processes (``takes_spares``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_sys.control.owners import JOB_OWNER, owner_gone

log = logging.getLogger(__name__)

NAMESPACE = "raytrain-sys"
POOL_NAME = "raytrain-sys-spares"
SPARE_PREFIX = "raytrain-sys-spare-"
CLAIM_TIMEOUT_S = 10.0
# How long a spare given back may take to be a spare again (its job's calls still in flight end
# first): past it, it is ended.
RECYCLE_TIMEOUT_S = 30.0
# How long a take waits for a spare being given back on the node it wants, when none is idle there.
RECYCLE_WAIT_S = 2.0
# How long after a take the pool waits before it starts a node's replacement spares: a short job
# (a sweep's trial) gives its spares back meanwhile, and a replacement started at once would be
# ended when they come back, its imports paid for nothing, beside the jobs that train there.
REFILL_DELAY_S = 5.0
# The takes the pool remembers (token -> spares), for a caller that gave up waiting on one: its
# word comes within seconds of the take's return.
RECENT_TAKES = 64


def takes_spares(gpus_per_worker: float, owner: str, pool_job: str = "", my_job: str = "") -> bool:
    """Whether a gang start may use the warm spares of a pool: CPU slots only, and the start's
    ``owner`` ("actor": a job's runner; "driver": a notebook or script) an actor, or a driver
    of the Ray job that started the pool (``pool_job == my_job``: a spare imports what that job
    can, and another driver's modules and working_dir may not be there)."""
    if not slots_take_spares(gpus_per_worker):
        return False
    return owner == "actor" or (owner == "driver" and bool(pool_job) and pool_job == my_job)


def slots_take_spares(gpus_per_worker: float) -> bool:
    """CPU slots only: Ray binds GPUs to a process when it is created (CUDA_VISIBLE_DEVICES),
    so a spare made before the job cannot be handed the GPU its slot's bundle reserved."""
    return not gpus_per_worker


@dataclass(frozen=True)
class SpareSource:
    """Where a gang start takes spares from (``pool``) and who claims them (``owner_id``, the
    id of an actor: the spares end with it, and ``end_spares_of`` ends them at once)."""

    pool: Any
    owner_id: str

    @classmethod
    def here(cls) -> Optional["SpareSource"]:
        """The running pool and this process as the owner (an actor by its id, a driver by its
        Ray job: ``takes_spares``); None without a pool, or a driver's when the pool is another
        job's."""
        if not ray.is_initialized():
            return None
        pool = find_pool()
        if pool is None:
            return None
        context = ray.get_runtime_context()
        owner_id = context.get_actor_id()
        if owner_id is not None:
            return cls(pool, owner_id)
        try:
            pool_job = ray.get(pool.job_id.remote(), timeout=CLAIM_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001: a pool that is gone or slow: fresh workers
            log.warning("warm spares: the pool did not answer (%s); starting fresh workers", exc)
            return None
        my_job = context.get_job_id()
        if not takes_spares(0.0, "driver", pool_job, my_job):
            return None
        return cls(pool, JOB_OWNER + my_job)

    def take(self, node_ids: list[str], timeout_s: float = CLAIM_TIMEOUT_S) -> list[Any]:
        """One claimed spare per entry of ``node_ids`` (on that node), or None where the pool
        has none; all None when the pool does not answer (the start then makes fresh workers)."""
        token = uuid.uuid4().hex
        try:
            return ray.get(self.pool.take.remote(node_ids, self.owner_id, token), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001: a pool that is gone or slow costs seconds, not the job
            log.warning("warm spares: the pool did not answer (%s); starting fresh workers", exc)
            # What the take claims for this call no one adopts: ended, now or when it returns (a
            # claim by a driver's job would otherwise keep them for as long as the driver lives).
            try:
                self.pool.forget_take.remote(token)
            except Exception:  # noqa: BLE001: a pool that is gone: it claimed nothing more
                pass
            return [None] * len(node_ids)

    def new_claimed(self, node_id: str):
        """A spare started now on ``node_id``, claimed by this owner from its start: a job's slot
        where the pool had none. It costs what a fresh worker costs, goes back to the pool when it
        leaves its job healthy (``SparePool.give_back``), and the pool ends it with the owner's
        other spares (``end_spares_of``) when the owner is killed."""
        spare = _new_spare(node_id, self.owner_id)
        try:
            self.pool.note_claimed.remote([spare], self.owner_id)
        except Exception as exc:  # noqa: BLE001: a pool that is gone: it still ends with its owner
            log.warning("warm spares: could not tell the pool of a spare claimed on %s: %s", node_id[:8], exc)
        return spare

    def give_back(self, spares: list[tuple[Any, str]], timeout_s: float = CLAIM_TIMEOUT_S) -> bool:
        """Hand spares this owner took (with their nodes) back to the pool (``SparePool.give_back``,
        which answers at once: the recycling runs in its threads); False when the pool is gone
        or does not answer (the caller ends them). A driver's is waited for: a call to a pool
        that died (its node lost) fails only when read, and spares handed to no one would live
        on, claimed by the driver's job for as long as the driver lives. An actor's (a job's
        runner) is not: its spares end with it, and its run's end does not wait on the pool
        (at Ray's nice 15 under a sweep's load it took seconds to answer)."""
        try:
            call = self.pool.give_back.remote(spares, self.owner_id)
            if self.owner_id.startswith(JOB_OWNER):
                ray.get(call, timeout=timeout_s)
            return True
        except Exception as exc:  # noqa: BLE001: a pool that is gone: they are ended instead
            log.warning("warm spares: could not give %d back to the pool: %s", len(spares), exc)
            return False


class SparePool:
    """Keeps ``per_node`` idle spares on every alive node with CPUs; hands them out claimed.
    A detached named actor (``start_pool``); see the module docstring."""

    def __init__(self, per_node: int, poll_s: float = 1.0, refill_delay_s: float = REFILL_DELAY_S,
                 home_id: str = ""):
        self.per_node = int(per_node)
        # A driver's pool (``start_pool(home=True)``): it and its spares end with that driver's
        # Ray job (``owner_gone``), as nothing else would end a detached actor. "" (the
        # service's): it lives until stopped.
        self.home_id = home_id
        self._job_id = ray.get_runtime_context().get_job_id()
        self.poll_s = poll_s
        self.refill_delay_s = refill_delay_s
        self._taken_at: dict[str, float] = {}  # node id -> when a spare was last taken there
        self._lock = threading.Lock()
        self._idle: dict[str, list[Any]] = {}  # node id -> spares up and unclaimed
        self._starting: dict[str, list[tuple[Any, Any]]] = {}  # node id -> (spare, node_info ref)
        self._counts = {"started": 0, "taken": 0, "missed": 0, "lost": 0, "recycled": 0, "ended_after_use": 0}
        self._recycling: dict[str, int] = {}  # node id -> spares being given back there
        # Spares given back kept idle beyond per_node, cluster-wide (set_keep_extra: the service's,
        # while a sweep's trials are to start): none is started for them.
        self.keep_extra = 0
        # owner actor id -> the spares it claimed, until its end is reported (end_claimed_by)
        self._claimed: dict[str, list[Any]] = {}
        self._takes: dict[str, tuple[str, list[Any]]] = {}  # the newest takes: token -> (owner, spares)
        self._forgotten: set[str] = set()  # tokens whose caller gave up before the take returned
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._find_existing()
        self._thread = threading.Thread(target=self._loop, name="spares", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what gang starts call
    def take(self, node_ids: list[str], owner_id: str, token: str = "") -> list[Any]:
        """One spare claimed by ``owner_id`` per entry of ``node_ids`` (None where there is none).
        ``token``: the caller's name for this take; a caller that stopped waiting for it says
        ``forget_take(token)``, and what it claimed is ended."""
        out = []
        for node_id in node_ids:
            out.append(self._take_one(node_id, owner_id))
        taken = [s for s in out if s is not None]
        with self._lock:
            forgotten = token in self._forgotten
            if forgotten:
                self._forgotten.discard(token)
            else:
                self._claimed.setdefault(owner_id, []).extend(taken)
                if token:
                    self._takes[token] = (owner_id, taken)
                    while len(self._takes) > RECENT_TAKES:
                        self._takes.pop(next(iter(self._takes)))
        self._wake.set()
        if forgotten:
            for spare in taken:
                _kill(spare)
            return [None] * len(node_ids)
        return out

    def forget_take(self, token: str) -> int:
        """The caller of take ``token`` gave up waiting for it: the spares it claimed (or will
        claim) are ended, as no one adopts them. Returns how many were ended now."""
        with self._lock:
            entry = self._takes.pop(token, None)
            if entry is None:  # still running: take ends them as it returns
                self._forgotten.add(token)
                return 0
            owner_id, spares = entry
            ended = {_id(s) for s in spares}
            self._claimed[owner_id] = [s for s in self._claimed.get(owner_id, []) if _id(s) not in ended]
        for spare in spares:
            _kill(spare)
        return len(spares)

    def note_claimed(self, spares: list[Any], owner_id: str) -> None:
        """Spares started for ``owner_id``, claimed from their start (``SpareSource.new_claimed``):
        ended with the ones it took (``end_claimed_by``) unless given back first."""
        with self._lock:
            self._claimed.setdefault(owner_id, []).extend(spares)

    def give_back(self, spares: list[tuple[Any, str]], owner_id: str) -> None:
        """Spares (with their nodes) that the job of ``owner_id`` let go healthy: each becomes a
        spare again (``TrainWorker.recycle``, in a thread of its own) and waits idle on its node
        when the node has fewer than ``per_node``, in place of one still starting there; it is
        ended otherwise. The owner's end no longer ends them."""
        given = {_id(s) for s, _ in spares}
        with self._lock:
            if owner_id in self._claimed:
                self._claimed[owner_id] = [s for s in self._claimed[owner_id] if _id(s) not in given]
            for _, node_id in spares:
                self._recycling[node_id] = self._recycling.get(node_id, 0) + 1
        for spare, node_id in spares:
            threading.Thread(target=self._recycle, args=(spare, node_id), name="recycle", daemon=True).start()

    def _recycle(self, spare, node_id: str) -> None:
        try:
            got = ray.get(spare.recycle.remote(), timeout=RECYCLE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001: gone, or stuck in its job's last call
            got = {"ok": False, "why": str(exc).splitlines()[0][:200]}
        ended = []
        with self._lock:
            self._recycling[node_id] -= 1
            idle, starting = self._idle.setdefault(node_id, []), self._starting.get(node_id, [])
            keep = got["ok"] and not self._stop.is_set() and (len(idle) < self.per_node
                                                              or self._surplus() < self.keep_extra)
            if keep:
                idle.append(spare)
                self._counts["recycled"] += 1
                while starting and len(idle) + len(starting) > self.per_node:
                    ended.append(starting.pop()[0])
            else:
                self._counts["ended_after_use"] += 1
                ended.append(spare)
        if not got["ok"]:
            log.info("warm spares: a spare given back on node %s is ended: %s", node_id[:8], got["why"])
        for s in ended:
            _kill(s)

    def end_claimed_by(self, owner_id: str) -> int:
        """End the spares ``owner_id`` claimed (its actor was just killed: they would end by
        themselves within seconds, and hold their peers' collectives until then)."""
        with self._lock:
            spares = self._claimed.pop(owner_id, [])
        for s in spares:
            _kill(s)
        return len(spares)

    def _take_one(self, node_id: str, owner_id: str):
        deadline = time.monotonic() + RECYCLE_WAIT_S
        while True:
            with self._lock:
                idle = self._idle.get(node_id) or []
                spare = idle.pop() if idle else None
                coming = self._recycling.get(node_id, 0) > 0
            if spare is None and coming and time.monotonic() < deadline:
                time.sleep(0.05)  # one being given back there: warm in a moment
                continue
            if spare is None:
                self._counts["missed"] += 1
                return None
            try:
                ray.get(spare.claim.remote(owner_id), timeout=CLAIM_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001: died while idle; try the node's next one
                log.warning("warm spare on node %s lost: %s", node_id[:8], exc)
                self._counts["lost"] += 1
                _kill(spare)
                continue
            self._counts["taken"] += 1
            self._taken_at[node_id] = time.monotonic()
            return spare

    # ------------------------------------------------------------------ reports and control
    def status(self) -> dict:
        with self._lock:
            return {"per_node": self.per_node, "keep_extra": self.keep_extra,
                    "idle": {n: len(s) for n, s in self._idle.items() if s},
                    "recycling": {n: c for n, c in self._recycling.items() if c},
                    "starting": {n: len(s) for n, s in self._starting.items() if s},
                    **self._counts}

    def set_keep_extra(self, count: int) -> None:
        """Keep up to ``count`` spares given back beyond ``per_node`` (cluster-wide); the ones past
        a lower count are ended at the next refill."""
        self.keep_extra = max(0, int(count))
        self._wake.set()

    def _surplus(self) -> int:
        return sum(max(0, len(idle) - self.per_node) for idle in self._idle.values())

    def set_per_node(self, per_node: int) -> None:
        self.per_node = int(per_node)
        self._wake.set()

    def wait_full(self, timeout_s: float) -> bool:
        """Whether every alive node has ``per_node`` idle spares within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = _worker_nodes()
            with self._lock:
                if all(len(self._idle.get(n, [])) >= self.per_node for n in nodes):
                    return True
            self._wake.set()
            time.sleep(0.1)
        return False

    def stop(self) -> int:
        """End the refill loop and every idle or starting spare; returns how many were ended."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10.0)
        return self.stop_idle()

    def stop_idle(self) -> int:
        """End every idle or starting spare; returns how many."""
        with self._lock:
            spares = [s for idle in self._idle.values() for s in idle]
            spares += [s for starting in self._starting.values() for s, _ in starting]
            self._idle, self._starting = {}, {}
        for s in spares:
            _kill(s)
        return len(spares)

    def ping(self) -> bool:
        return True

    def job_id(self) -> str:
        """The Ray job that started this pool: its spares import what that job's processes can."""
        return self._job_id

    # ------------------------------------------------------------------ the refill loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.home_id and owner_gone(self.home_id):
                log.warning("warm spares: the driver that started this pool is gone: ending it and its spares")
                self.stop_idle()
                os._exit(0)
            try:
                self._refill()
            except Exception as exc:  # noqa: BLE001: e.g. the GCS briefly unreachable; try again
                log.warning("warm spares: refill failed: %s", exc)
            self._wake.wait(self.poll_s)  # (a delayed refill is looked at again within poll_s)
            self._wake.clear()

    def _refill(self) -> None:
        nodes = set(_worker_nodes())
        # The spares' class (it imports torch: seconds on a loaded node) before the lock, which
        # status() and take() wait on: the service's first info() waited here 3-5 s at each start.
        _spare_class()
        with self._lock:
            self._settle_starting()
            for node_id in list(self._idle) + list(self._starting):
                if node_id not in nodes:  # node gone: its spares with it
                    self._counts["lost"] += len(self._idle.pop(node_id, []))
                    self._counts["lost"] += len(self._starting.pop(node_id, []))
            if self._stop.is_set():
                return
            now, allowance = time.monotonic(), self.keep_extra
            for node_id in nodes:
                have = len(self._idle.get(node_id, [])) + len(self._starting.get(node_id, []))
                have += self._recycling.get(node_id, 0)
                # Spares taken there just now: those given back come first.
                delayed = now - self._taken_at.get(node_id, -1e9) < self.refill_delay_s
                for _ in range(0 if delayed else max(0, self.per_node - have)):
                    spare = _new_spare(node_id, home_id=self.home_id)
                    self._starting.setdefault(node_id, []).append((spare, spare.node_info.remote()))
                    self._counts["started"] += 1
                surplus = self._idle.get(node_id, [])[self.per_node:]  # per_node or keep_extra lowered
                allowed, extra = surplus[:allowance], surplus[allowance:]
                allowance -= len(allowed)
                for spare in extra:
                    self._idle[node_id].remove(spare)
                    _kill(spare)

    def _settle_starting(self) -> None:
        for node_id, starting in self._starting.items():
            if not starting:
                continue
            refs = [ref for _, ref in starting]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for spare, ref in list(starting):
                if ref not in done:
                    continue
                starting.remove((spare, ref))
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    log.warning("warm spare on node %s failed to start: %s", node_id[:8], exc)
                    self._counts["lost"] += 1
                    continue
                self._idle.setdefault(node_id, []).append(spare)

    def _find_existing(self) -> None:
        """After a restart of the pool: its spares are still there (detached); keep the idle
        ones, leave the claimed ones to their owners."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(SPARE_PREFIX)]
        for name in names:
            try:
                spare = ray.get_actor(name, namespace=NAMESPACE)
                info = ray.get(spare.spare_state.remote(), timeout=CLAIM_TIMEOUT_S)
            except Exception:  # noqa: BLE001: gone, or not answering: not ours to keep
                continue
            if info["claimed"]:
                continue
            self._idle.setdefault(info["node_id"], []).append(spare)


def _worker_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]


def _spare_class():
    from raytrain_sys.control.worker import TrainWorker

    return TrainWorker


def _new_spare(node_id: str, owner_id: str = "", home_id: str = ""):
    return _spare_class().options(
        name=f"{SPARE_PREFIX}{uuid.uuid4().hex[:12]}", namespace=NAMESPACE, lifetime="detached",
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(None, owner_id, home_id)


def _id(actor) -> str:
    return actor._actor_id.hex()


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001: already gone
        pass


RemoteSparePool = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(SparePool)


def start_pool(per_node: int, refill_delay_s: float = REFILL_DELAY_S, home: bool = False):
    """The cluster's pool (started now, or the running one set to ``per_node``). ``home``: a
    driver's pool (``rts.connect(..., warm_workers_per_node=n)``), which ends, with its spares,
    when this driver's Ray job does; the service's lives until ``stop_pool``."""
    from raytrain_sys.control.control_actors import control_options

    home_id = JOB_OWNER + ray.get_runtime_context().get_job_id() if home else ""
    # A control actor (control_actors.py): on a safe node when the cluster has one.
    pool = RemoteSparePool.options(name=POOL_NAME, namespace=NAMESPACE, lifetime="detached",
                                   get_if_exists=True, **control_options()).remote(per_node, 1.0, refill_delay_s,
                                                                                   home_id)
    ray.get(pool.set_per_node.remote(per_node))
    return pool


def find_pool():
    try:
        return ray.get_actor(POOL_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def end_spares_of(owner_id: str, wait: bool = True) -> int:
    """End at once the spares that the actor ``owner_id`` claimed (see
    ``SparePool.end_claimed_by``); 0 when no pool runs or it does not answer. ``wait=False``:
    only ask (0 returned), for a caller that must not wait for the pool (the reconciler's pass:
    the pool, at Ray's nice 15 beside training, took 2.7 s to answer under a sweep's load)."""
    pool = find_pool()
    if pool is None or not owner_id:
        return 0
    try:
        ref = pool.end_claimed_by.remote(owner_id)
        return ray.get(ref, timeout=CLAIM_TIMEOUT_S) if wait else 0
    except Exception as exc:  # noqa: BLE001: they end by themselves within seconds anyway
        log.warning("warm spares: could not end the spares of %s: %s", owner_id[:8], exc)
        return 0


def stop_pool(timeout_s: float = 30.0) -> int:
    """End the pool and its idle spares (claimed ones end with their jobs). Returns how many
    spares were ended (0 when no pool runs)."""
    pool = find_pool()
    if pool is None:
        return 0
    try:
        ended = ray.get(pool.stop.remote(), timeout=timeout_s)
    finally:
        _kill(pool)
    return ended
