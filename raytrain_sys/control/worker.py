"""The training worker: one Ray actor per GPU or CPU slot.

The actor keeps the model and optimizer in memory across steps and across process-group
rebuilds. The driver hands it a rank, world size, master address/port and a generation number;
the worker tears down and re-creates its process group and cuts the model by the job's
DeviceMesh for that world (raytrain_sys.parallel.parallelize: DDP, FSDP2, TP, PP and hybrids).

Two kinds of layout, one contract:
- replicated (plain DDP: every rank holds everything): a rebuild keeps the model and optimizer
  objects and only wraps them again; a member that lacks the state gets it by broadcast from a
  survivor (``sync_state``).
- sharded (anything with fsdp, tp or pp > 1): DTensor parameters belong to the mesh they were
  cut for, so a rebuild builds the model afresh for the new mesh. What the worker held before is
  kept as *pieces* (raytrain_sys.parallel.reshard: blocks with their global offsets, no process
  group needed, so this works after a peer died); the survivors' pieces are shared through Ray's
  object store and each member takes its blocks of the new layout (``load_pieces``). When the
  survivors do not cover the state (the only shard of something died), the Supervisor restores
  the newest durable checkpoint instead, resharded the same way.

Checkpoints are pieces too: each rank writes the blocks it owns (every block exactly once), and
any layout or world size reads them back (``load_checkpoint``), with torch.load(weights_only=True).

Control calls (node info, ping) run in their own concurrency group, so they are answered while a
step is blocked inside a collective.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from raytrain_sys.checkpoint.background import BackgroundWrite
from raytrain_sys.control.owners import JOB_OWNER, owner_gone
from raytrain_sys.control.peer_copies import PeerCopies
from raytrain_sys.data.batches import RankPlan, RankShare, lease_plans
from raytrain_sys.extensions import resolve_task
from raytrain_sys.niceness import process_niceness, set_niceness
from raytrain_sys.parallel import mesh as meshlib
from raytrain_sys.parallel import phases
from raytrain_sys.parallel import reshard
from raytrain_sys.parallel.backend import choose_backend
from raytrain_sys.parallel.dtensor import forget_meshes
from raytrain_sys.parallel.parallelize import import_for, parallelize
from raytrain_sys.parallel.timing import StepClock
from raytrain_sys.spec import JobSpec, from_dict
from raytrain_sys.train.optim import build_optimizer, lr_at

log = logging.getLogger(__name__)

PIECES_FILE = "pieces_rank{rank:05d}.pt"  # one per writing rank; see raytrain_sys.checkpoint.state
# How long joining a process group may wait for the other members (see setup_group).
RENDEZVOUS_TIMEOUT_S = 30.0
# A lease's rank 0 reports its finished steps at least this often (and at the lease's end). Each
# report costs the driver about a millisecond of CPU (Ray's delivery, the wait, the read), so a
# report a step would cost it more than a whole step's budget; what a report tells it is needed
# at the lease's end (the commits) and for liveness (a member is pinged only after
# policy.LIVENESS_EVERY_S without a report, so this stays well under that). A cut does not wait
# for reports: rank 0 learns it on its control path.
REPORT_EVERY_S = 0.5
# A rank keeps the results of at least this many steps before the lease it runs (``results_kept``):
# more than a lost driver's summary.json can lag behind its commits (a rewrite every few seconds,
# ``policy.summary_due``), so that an adopting Supervisor has every step's loss. About 1 KB a step.
KEPT_STEPS = 1024
# How often ``lease_end`` looks whether the lease it waits for has ended (an adopting Supervisor's
# follow of a lease its lost driver sent; on the control path, one of its threads meanwhile).
LEASE_END_POLL_S = 0.02
# A rank's parts of a step that every rank learns in the step's agreement (TrainWorker._agree):
# the Supervisor's loss sum (data leaders' only), the rows, and where the time went.
AGREED = ("loss_sum", "rows", "data_wait_s", "compute_s", "collective_s", "optimizer_s")
# A spare goes back to its pool after a job (``TrainWorker.recycle``) at most this many times, and
# only while its resident memory is within RECYCLE_GROWTH_BYTES of what it held as a new spare:
# a process that served many jobs, or a large one, is ended (its heap is not given back to the OS).
MAX_JOBS_PER_PROCESS = 50
RECYCLE_GROWTH_BYTES = 1 << 30


def ranks_loss(ranks: np.ndarray) -> np.ndarray:
    """The step's loss sum from the ranks' agreed parts (``..., ranks, AGREED``): each rank's
    ``loss_sum`` added in rank order (a running sum, so the same float whatever else is summed
    beside it), one per step for a lease's table."""
    return np.cumsum(ranks[..., AGREED.index("loss_sum")], axis=-1)[..., -1]


def agreed_result(result: dict[str, Any], agreed: dict[str, Any]) -> dict[str, Any]:
    """A rank's result of a step kept after the ranks' agreement (``TrainWorker._agree``): with
    ``loss_all``, every rank's ``loss_sum`` (``ranks_loss``, as ``report_results`` sums a lease's
    reports), so a survivor alone gives the step's whole loss."""
    return {**result, "loss_all": float(ranks_loss(agreed["ranks"]))}


def results_kept(results: dict[int, dict], newest_from: int, first: int, keep: int = KEPT_STEPS) -> dict[int, dict]:
    """A rank's kept step results as a lease from step ``first`` begins here, the newest one
    before it having begun at ``newest_from``: that lease's stay (the Supervisor may yet learn it
    failed elsewhere and ask for them), and so do the ``keep`` steps before ``first`` (a
    Supervisor that adopts this rank commits from them the steps its lost driver's record had
    not reached yet: ``control.adoption``); older ones go, and so do steps from ``first`` on (kept
    in a timeline that a restore rewound)."""
    return {s: r for s, r in results.items() if min(newest_from, first - keep) <= s < first}


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _step_seed(seed: int, step: int, rank: int) -> int:
    # Dropout masks as a pure function of (seed, step, rank): nothing to save for an exact resume.
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)


def _end_with(owner, poll_s: float, released) -> None:
    """End this process once its owner is dead (``owner()``, read at each look: an actor's id,
    or a driver's Ray job as ``job:<id>``, or several of them, all of which must be gone; the
    cluster's tables say whether one is gone, ``owners.owner_gone``): a claimed worker outlives
    no job's agent (``hand_to``) or driver,
    and a spare of a driver's pool (its home) no driver. By id, not by handle: a handle passed
    on through the pool costs its receivers a first-contact delay (seconds under load), and a
    name can be taken again by a restarted runner. Returns once ``released`` (a
    threading.Event) is set: the spare was given back to the pool (``TrainWorker.recycle``); a
    home's watch is never released."""
    while not released.is_set():
        owner_ids = owner()
        owner_ids = (owner_ids,) if isinstance(owner_ids, str) else tuple(owner_ids)
        if all(owner_gone(owner_id) for owner_id in owner_ids):
            log.warning("the %s of this worker %s gone: ending its process",
                        " and ".join("driver" if o.startswith(JOB_OWNER) else "actor that claimed it" for o in owner_ids),
                        "is" if len(owner_ids) == 1 else "are")
            os._exit(1)
        released.wait(poll_s)


@ray.remote(num_cpus=0)
def index_departed(pieces: dict) -> dict:
    """``TrainWorker.piece_index`` for the pieces of a member that left (see Membership)."""
    return reshard.piece_index(pieces)


@ray.remote(num_cpus=0)
def cut_departed(pieces: dict, chunks: list):
    """``TrainWorker.cut_pieces`` for the pieces of a member that left."""
    for requests in chunks:
        yield reshard.cut(pieces, requests)


def views_of_state(memory: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether ``reshard.local_pieces(copy=False)`` of this state are views of it (its tensors
    all on the CPU), which a step updates in place; off the CPU they are copies made at the
    call (``.cpu()``), stale at the next step: never kept."""
    return all(getattr(t, "_local_tensor", t).device.type == "cpu" for t, _ in memory)


# "control": calls read beside the training thread (ping, phase, cut_lease, adoption_state, ...),
# one of them possibly waiting out a lease for an adopting Supervisor (lease_end).
# "checkpoint": the call that waits for a background checkpoint write (checkpoint_written) runs
# beside the steps, so that the Supervisor can hold its reference while training goes on.
# "peer": the copies this rank holds for others, received beside the steps (hold_copy), several
# at once: a receive from a sender that vanished without a word (a host gone, no reset) waits
# out the copy's timeout, and must not hold up the next group's copies behind it.
@ray.remote(concurrency_groups={"control": 3, "checkpoint": 1, "peer": 4})
class TrainWorker:
    def __init__(self, spec_dict: dict[str, Any] | None, owner_id: str = "", home_id: str = ""):
        """A worker of the job ``spec_dict``; with None, a warm spare (torch and this module
        imported, nothing else) that becomes a job's worker by ``adopt`` (see
        raytrain_sys.control.spares), claimed at once by ``owner_id`` when given (a spare
        started for a job's slot when the pool had none there), and ended with ``home_id``
        when given (a spare of a driver's pool: that driver's Ray job)."""
        if home_id:
            import threading

            threading.Thread(target=_end_with, args=(lambda: home_id, 1.0, threading.Event()), name="home-watch",
                             daemon=True).start()
        self._as_spare()
        self.jobs_served = 0
        if spec_dict is not None:
            self._configure(spec_dict)
        else:  # a spare: the imports any job's prepare() would make, made while no one waits
            from raytrain_sys.parallel.parallelize import import_for_any
            from raytrain_sys.train.check import warm_up

            import_for_any()
            warm_up()
            self.born = {"nice": process_niceness(), "threads": torch.get_num_threads(), "rss": _rss_bytes()}
        if owner_id:  # a job's worker started for its driver, or a spare started for a job's slot
            self._claim(owner_id)

    def _as_spare(self) -> None:
        """The state of a spare that no one claimed: no job, no owner."""
        self.spec: JobSpec | None = None
        self.owner = None  # a spare's: the actor whose death ends this process (claim)
        self.released = None  # set when the claim ends (recycle): the owner watch returns
        self.stash, self.step_done = None, 0  # what ping reads (a spare holds no state)
        self.background = BackgroundWrite()  # checkpoint.async_save: this rank's write in flight
        self.peer_copies = PeerCopies()  # checkpoint.peer_copies: this rank's copy, and those it holds
        self._pieces_cache = None  # (layout, the state's memory, this rank's owned blocks of it): _owned_pieces

    def _configure(self, spec_dict: dict[str, Any]) -> None:
        self.spec = from_dict(spec_dict)
        # Every thread: a spare's torch threads were started by its warm-up, at Ray's 15.
        set_niceness(self.spec.resources.worker_niceness)
        threads = max(1, int(self.spec.resources.cpus_per_worker))
        torch.set_num_threads(threads)
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self.device = "cpu"
        self.model: torch.nn.Module | None = None  # this rank's part, original parameter names
        self.pm = None  # ParallelModel: the model cut by the current mesh
        self.optimizer: torch.optim.Optimizer | None = None
        self.replicated = True  # the current layout keeps a whole copy on every rank
        self.step_done = 0  # optimizer steps applied to the state in the current layout
        # The state held before the layout was rebuilt: (step, pieces), until shared and loaded.
        self.stash: tuple[int, dict] | None = None
        self.collective_timeout_s = 0.0  # of the current process groups (see train_step)
        self.abort_releases = False  # aborting the process group releases a waiting collective (NCCL)
        # The results of the steps of the newest leases that ran here, by step (``results_kept``):
        # after a lease fails part-way the Supervisor commits its finished steps from them
        # (lease_results). The one before the newest stays: under run-ahead this rank may have
        # begun the next lease when the Supervisor learns that the one before it failed elsewhere
        # (its reporter lost with its report unread); and KEPT_STEPS steps for an adopting
        # Supervisor. ``results_from``: the first step of the newest lease.
        self.recent_results: dict[int, dict[str, float]] = {}
        self.results_from = 0
        # Peer copies: (step, result) of the newest step, kept once its copies are confirmed;
        # the lease whose last step's copies could not be confirmed (none: every lease's were).
        self.unconfirmed: tuple[int, dict] | None = None
        self.unconfirmed_lease: int | None = None
        self.cut: tuple[int, int] | None = None  # (through lease, end step): the Supervisor's (rank 0)
        self.cut_through = -1  # leases up to this id are cut short (agreed by every rank: _agree)
        self.newest_lease = -1  # the id of the newest lease that began here (adoption_state)
        # The lease this rank is in: (id, first step, steps, its rows lo, hi), None between leases
        # (adoption_state: an adopting Supervisor sends the ranks that never got it their part).
        self.running: tuple[int, int, int, int, int] | None = None
        self.ended: tuple[int, int, str | None] | None = None  # the newest lease's (id, steps run, error)
        self.task = resolve_task(self.spec)
        # Where this rank is in its step, for the Supervisor's verdict on a step past its
        # deadline (``phase``, read on the control path): raytrain_sys.parallel.phases.
        self.marker = phases.PhaseMarker()
        # Test only (elastic.fault_slow_rank): this process computes that many times slower,
        # decided when it joins its first process group (StepClock sleeps in proportion).
        self.slow_factor: float | None = None

    # ------------------------------------------------------------------ a spare's start
    @ray.method(concurrency_group="control")
    def claim(self, owner_id: str, poll_s: float = 1.0) -> dict[str, Any]:
        """Bind this spare to the actor ``owner_id`` (the one that will adopt it): from now on
        the process ends itself within about ``poll_s`` of that actor's death, whether or not it
        was adopted yet (a spare is detached: nothing else would end it). Returns ``node_info()``."""
        if self.owner is not None or self.spec is not None:
            raise RuntimeError("this spare was claimed already")
        self._claim(owner_id, poll_s)
        return self.node_info()

    def _claim(self, owner_id: str, poll_s: float = 1.0) -> None:
        import threading

        self.owner = owner_id
        self.released = released = threading.Event()
        threading.Thread(target=_end_with, args=(lambda: getattr(self, "owner", None) or owner_id, poll_s, released),
                         name="owner-watch", daemon=True).start()

    @ray.method(concurrency_group="control")
    def hand_to(self, owner_id: str | tuple[str, ...]) -> bool:
        """This claimed worker answers to ``owner_id`` from now on (its node's agent once it is
        up, ``node_agent``; its driver again before it goes back to the pool): it ends with that
        one, not the one before. Several ids (its driver and its agent while the agent starts):
        it ends once every one of them is gone. False when it holds no claim any more (given
        back already)."""
        if self.owner is None or self.released is None or self.released.is_set():
            return False
        self.owner = owner_id
        return True

    @ray.method(concurrency_group="control")
    def spare_state(self) -> dict[str, Any]:
        """Whether this spare is claimed (or a job's worker), and its node."""
        return {"claimed": self.owner is not None or self.spec is not None,
                "node_id": ray.get_runtime_context().get_node_id()}

    def adopt(self, spec_dict: dict[str, Any]) -> dict[str, Any]:
        """Become a worker of the job ``spec_dict`` (after ``claim``); returns ``prepare()``."""
        if self.owner is None or self.spec is not None:
            raise RuntimeError("adopt needs a claimed spare that no job has adopted yet")
        self._configure(spec_dict)
        return self.prepare()

    def recycle(self) -> dict[str, Any]:
        """Back to an unclaimed spare after the job that adopted it let it go (``SparePool.
        give_back``): its process groups destroyed, DTensor's and torch.compile's caches
        dropped, every attribute of the job deleted, its niceness and thread count as a new
        spare's, its owner no longer watched. Runs after any call still in flight here (the
        actor's default group). ``{"ok": False, "why": ...}`` (the pool ends the process) when
        it is no adopted spare, a checkpoint write is still in flight, or the process served
        MAX_JOBS_PER_PROCESS jobs or grew past RECYCLE_GROWTH_BYTES."""
        born = getattr(self, "born", None)
        if born is None or self.owner is None:
            return {"ok": False, "why": "not a spare"}
        if self.background.busy():
            return {"ok": False, "why": "a checkpoint write in flight"}
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_meshes()
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()
        self.released.set()
        served = self.jobs_served + 1
        for name in [n for n in vars(self) if not n.startswith("_ray")]:  # (Ray's own, if any, stay)
            delattr(self, name)
        self._as_spare()
        self.born, self.jobs_served = born, served
        gc.collect()
        set_niceness(born["nice"])
        torch.set_num_threads(born["threads"])
        grown = _rss_bytes() - born["rss"]
        why = ("" if process_niceness() == born["nice"] else f"nice {process_niceness()}, born {born['nice']}") or \
              (f"served {served} jobs" if served >= MAX_JOBS_PER_PROCESS else "") or \
              (f"grew {grown / 2**20:.0f} MiB" if grown > RECYCLE_GROWTH_BYTES else "")
        return {"ok": not why, "why": why, "jobs": served, "node_id": ray.get_runtime_context().get_node_id()}

    # ------------------------------------------------------------------ control path
    @ray.method(concurrency_group="control")
    def node_info(self) -> dict[str, Any]:
        import psutil

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "create_time": psutil.Process().create_time(),
                "nice": process_niceness()}

    def prepare(self) -> dict[str, Any]:
        """Import torch's distributed pieces and build the model now, while the group trains
        without this worker: joining later costs a process-group rebuild and a state sync, not
        a model build. Returns ``node_info()``."""
        if self.model is None:
            self._select_device()
            import_for(self.spec.parallel)
            self._build()
        return self.node_info()

    @ray.method(concurrency_group="control")
    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        """The step of the newest state this worker holds, in its current layout or as pieces."""
        return self.stash[0] if self.stash is not None else self.step_done

    @ray.method(concurrency_group="control")
    def adoption_state(self) -> dict[str, Any]:
        """What a Supervisor that adopts this rank needs (``control.adoption``): its place in the
        process group (rank, world size, generation), the step of the state it holds, whether it
        is between leases (``idle``) with that state in its layout, the newest lease id it began
        and the newest cut it agreed (a new Supervisor numbers its leases after both), the lease
        it is in (``running``: id, first step, steps, its rows' range; None between leases), and
        its node and process."""
        marker = getattr(self, "marker", None) or phases.PhaseMarker()
        configured = self.spec is not None
        return {"rank": getattr(self, "rank", -1), "world_size": getattr(self, "world_size", 0),
                "generation": getattr(self, "generation", -1), "step": self.step_done,
                "idle": marker.read()["phase"] == phases.IDLE and self.stash is None and configured
                and getattr(self, "pm", None) is not None,
                "lease": max(getattr(self, "newest_lease", -1), getattr(self, "cut_through", -1)),
                "running": getattr(self, "running", None),
                "replicated": getattr(self, "replicated", True),
                "training_hash": self.spec.training_hash() if configured else "", **self.node_info()}

    # A step past its deadline (raytrain_sys.control.supervisor.liveness.find_hung): where each
    # rank is, read without its training thread; the hung one's stacks; then its end.
    @ray.method(concurrency_group="control")
    def phase(self) -> dict[str, Any]:
        """This rank's phase (``PhaseMarker.read``: phase, step, index, since_unix_s, group),
        its rank and the step of the state it holds."""
        marker = getattr(self, "marker", None) or phases.PhaseMarker()
        return {**marker.read(), "rank": getattr(self, "rank", -1), "held": self.ping()}

    @ray.method(concurrency_group="control")
    def stacks(self) -> dict[str, Any]:
        """Every thread's Python stack here, the training thread's first (``phases.stacks``)."""
        marker = getattr(self, "marker", None)
        return {**phases.stacks(marker.thread if marker is not None else 0), "pid": os.getpid()}

    @ray.method(concurrency_group="control")
    def abort_group(self) -> bool:
        """Release this rank from a collective that a peer found hung will never join: its
        process groups aborted, where that releases a waiting collective (NCCL; with gloo the
        hung peer's end does: parallel/backend.py). The training thread's collective raises; the
        group is made again by the rebuild. Returns whether it aborted."""
        if not getattr(self, "abort_releases", False) or not dist.is_initialized():
            return False
        dist.distributed_c10d._abort_process_group()
        forget_meshes()
        return True

    @ray.method(concurrency_group="control")
    def end_now(self) -> None:
        """End this process at once (a rank found hung, its stacks taken): its sockets close, so
        its peers' collectives fail now, not at their timeout. Never answers."""
        log.warning("ending this worker process: found hung by the Supervisor")
        os._exit(1)

    # ------------------------------------------------------------------ group lifecycle
    def setup_group(self, rank: int, world_size: int, master_addr: str, master_port: int,
                    generation: int) -> dict[str, Any]:
        """(Re)join the process group of ``generation``; build model and optimizer on first use."""
        if dist.is_initialized():
            dist.destroy_process_group()
            forget_meshes()  # DTensor's cache would hand the old groups' meshes on (dtensor.py)
        choice = self._select_device()
        # The supervisor's step deadline acts long before the collective timeout; it only
        # bounds a lost peer. The rendezvous gets a short one of its own: a member that dies
        # during it would otherwise hold every other member inside init_process_group (and
        # their actors' next calls behind it) for the whole collective timeout.
        collective = timedelta(seconds=max(60.0, self.spec.train.step_timeout_s))
        rendezvous = min(collective, timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        try:
            from torch.distributed.distributed_c10d import _set_pg_timeout
        except ImportError:  # a torch without it: one timeout for both
            _set_pg_timeout, rendezvous = None, collective
        for name, value in choice.env.items():  # read as the group is made (parallel/backend.py)
            os.environ.setdefault(name, value)
        self.abort_releases = choice.abort_releases
        dist.init_process_group(choice.backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, timeout=rendezvous)
        if _set_pg_timeout is not None and rendezvous != collective:
            _set_pg_timeout(collective)
        self.collective_timeout_s = collective.total_seconds()
        self.rank, self.world_size, self.generation = rank, world_size, generation
        # No copies until the Supervisor names this generation's peer (set_peer); the copies
        # held for the old group stay until the state is loaded: a rebuild may need them.
        self.peer_copies.set_peer(None, -1, generation)
        self._pieces_cache = None  # (its tensors would outlive the model a new layout replaces)
        self.unconfirmed_lease = None
        if self.slow_factor is None:
            # The run's first group is generation 1 (WorkerGroup): a replacement that later takes
            # the slow rank's number is not slow, as a replacement on a healthy node would not be.
            e = self.spec.elastic
            self.slow_factor = e.fault_slow_factor if (rank, generation) == (e.fault_slow_rank, 1) else 1.0
        degrees = self.spec.parallel.degrees(world_size)
        replicated = degrees["tp"] == degrees["pp"] == degrees["fsdp"] == 1
        fresh = self.optimizer is None  # never trained: its model is the step-0 build
        keep = not fresh and self.stash is None and self.replicated and replicated
        if not keep:
            # DTensors are bound to the mesh they were cut for: a new layout starts from a fresh
            # model, and the state held so far waits as pieces to be shared and re-cut.
            if not fresh and self.stash is None:  # (the model is dropped next: no copy)
                self.stash = (self.step_done, reshard.local_pieces(self.model, self.optimizer, copy=False))
            if not fresh or self.model is None:
                self._build()
        self.replicated = replicated
        self.mesh = meshlib.build_mesh(self.spec.parallel, world_size, self.device.split(":")[0])
        self.coords = {axis: meshlib.local_index(self.mesh, axis) for axis in meshlib.MESH_AXES}
        # Build order (torchtitan): model, parallelize, optimizer last. A replicated layout
        # wraps the same module again: DDP holds the group it was built with.
        self.pm = parallelize(self.model, self.mesh, self.spec.parallel, self.device, task=self.task,
                              precision=self.spec.train.precision, compile_model=self.spec.train.compile,
                              clock=StepClock(self.slow_factor, self.marker))
        self.model = self.pm.local_model
        if not keep:
            self.optimizer = build_optimizer(self.pm.optimizer_module(), self.spec.optim)
            self.step_done = 0  # a fresh model is the state of step 0, the same on every rank
        return {"rank": rank, "backend": choice.backend, "device": self.device,
                "replicated": replicated, "stashed": self.stash is not None}

    def _set_collective_timeout(self, timeout_s: float) -> None:
        """Collectives of this step time out after ``timeout_s`` (the Supervisor's step deadline
        plus its liveness margin), on every process group of the mesh."""
        from torch.distributed import distributed_c10d as c10d

        try:
            groups = list(c10d._world.pg_map.keys())  # the default group and the mesh's
        except AttributeError as exc:  # a torch without it: keep the timeout of setup_group
            log.warning("could not set the collective timeout to %.0f s: %s", timeout_s, exc)
            groups = []
        for group in groups:
            try:
                c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
            except (ValueError, RuntimeError) as exc:
                log.warning("could not set the collective timeout of %s: %s", group, exc)
        self.collective_timeout_s = timeout_s

    def _select_device(self):
        choice = choose_backend(self.spec.parallel.backend, torch.cuda.is_available(),
                                self.spec.resources.gpus_per_worker)
        self.device = choice.device
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        return choice

    def _build(self) -> None:
        """The whole model, initialized from the job's seed: identical on every rank, so the
        layouts cut from it agree with the single-process model."""
        from raytrain_sys.extensions import build_model

        torch.manual_seed(self.spec.train.seed)
        self.model = build_model(self.spec.model).to(self.device)
        if self.spec.train.precision == "fp64":
            self.model = self.model.double()
        self.pm = None
        self.optimizer = None  # built after parallelize, from the parameters it leaves

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the step
    # A lease: steps ``first`` .. ``first + len(plans) - 1`` in order, in one call (the Supervisor
    # sends many when steps are short, sharing its per-call cost out). Each plan is (rows, global
    # loss units, the indices in ``pieces`` of that step's pieces, in order), dealt here from the
    # lease's one plan (``data.batches.lease_plans``; a list of rows with data.delivery=driver);
    # ``pieces`` are the lease's piece values, each once. Every step ends with the ranks' agreement (``_agree``):
    # their parts of the step, and whether the lease ends there because the Supervisor cut it
    # short (``cut_lease``). Rank 0 reports each finished step as it goes (``report_steps``); the
    # others return how many steps they ran (``train_steps``). A step that fails raises; the
    # results of the steps before it stay in ``recent_results`` (``lease_results``).
    def train_steps(self, first: int, plans: list, collective_timeout_s: float, *pieces, lease: int = -1,
                    after: Any = None) -> int:
        """A lease on a rank other than 0: the number of steps it ran (0: cut before it began).
        ``after``: the lease before's result, when it came from another caller (its node agent
        took over from the driver, ``Steps._through_agents``): only an ordering, its value unused."""
        return sum(len(reports) for reports in self._lease(lease, first, plans, collective_timeout_s, pieces,
                                                           float("inf")))

    def report_steps(self, first: int, plans: list, collective_timeout_s: float, *pieces, lease: int = -1):
        """A lease on rank 0: yields the finished steps' reports (``_agree``: every rank's parts
        of the step, the lease's end) as lists, at least every REPORT_EVERY_S (a Ray generator:
        the Supervisor reads them while the lease runs: one reporter a step, not a call per rank)."""
        yield from self._lease(lease, first, plans, collective_timeout_s, pieces, REPORT_EVERY_S)

    def _lease(self, lease: int, first: int, plans: list, collective_timeout_s: float, pieces: tuple,
               report_every_s: float):
        if lease <= self.cut_through:
            return  # sent ahead of a lease that was cut short: it never starts
        self.newest_lease = max(self.newest_lease, lease)
        if self.unconfirmed_lease is not None and lease > self.unconfirmed_lease:
            raise RuntimeError(f"lease {lease} refused: the lease before it ended without its copies confirmed")
        if self.step_done == first:  # (a lease sent ahead of one that failed here is refused:
            # the failed lease's finished steps stay asked for). Steps from ``first`` on, kept
            # of an older timeline (a restore rewound it), go, and those of leases before the last.
            self.recent_results = results_kept(self.recent_results, self.results_from, first)
            self.results_from = first
            self.unconfirmed = None
            if self.peer_copies.on and self.peer_copies.sent_step != first:
                self.marker.enter(phases.COPY, first)
                self._copy_to_peer()  # a new group's first lease: the state it starts from
                self.peer_copies.wait(self._copy_timeout_s())
        plans = lease_plans(plans)
        rows = (plans.lo, plans.hi) if isinstance(plans, RankPlan) else (-1, -1)
        self.running, ran, error = (lease, first, len(plans), *rows), 0, None
        try:
            for part in self._lease_steps(lease, first, plans, collective_timeout_s, pieces, report_every_s):
                ran += len(part)
                yield part
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.running, self.ended = None, (lease, ran, error)

    @ray.method(concurrency_group="control")
    def lease_end(self, lease: int) -> int:
        """Wait for lease ``lease``, running here, to end; the steps it ran, or its error raised.
        An adopting Supervisor follows a lease its lost driver sent with this call (the lease's
        own call was the lost driver's: ``Steps.complete``)."""
        while (getattr(self, "running", None) or (None,))[0] == lease:
            time.sleep(LEASE_END_POLL_S)
        ended = getattr(self, "ended", None)
        if ended is None or ended[0] != lease:
            return 0  # it never ran here (cut short before it began)
        if ended[2] is not None:
            raise RuntimeError(f"lease {lease} failed on rank {self.rank}: {ended[2]}")
        return ended[1]

    def _lease_steps(self, lease: int, first: int, plans, collective_timeout_s: float, pieces: tuple,
                     report_every_s: float):
        reports, sent_at = [], time.monotonic()
        for i, (batch, global_units, which) in enumerate(plans):
            reports.append(self.train_step(first + i, batch, global_units, collective_timeout_s,
                                           *(pieces[k] for k in which), lease=lease))
            end = reports[-1]["cut"] or i == len(plans) - 1
            if end and self.peer_copies.on:
                try:
                    self._confirm_copies()  # before the lease's last report: its steps all commit
                except BaseException:
                    # The lease sent ahead would find this rank at its first step: refused
                    # (train_step), so that the steps confirmed here stay asked for.
                    self.unconfirmed_lease = lease
                    raise
            if end:
                self.marker.enter(phases.IDLE, self.step_done)
            if end or time.monotonic() - sent_at >= report_every_s:
                yield reports
                reports, sent_at = [], time.monotonic()
            if end:
                return

    @ray.method(concurrency_group="control")
    def cut_lease(self, through: int, end: int) -> int:
        """End the running lease after step ``end - 1`` (or, when this rank is past it, after
        the step it is in), and leave the leases queued behind it up to ``through`` unstarted.
        Asked of a lease's rank 0 only: every rank learns it in the next step's agreement
        (``_agree``), so all of them stop after the same step. Returns the step held."""
        self.cut = (through, end)
        return self.step_done

    def _agree(self, lease: int, step: int, result: dict[str, Any]) -> dict[str, Any]:
        """The ranks' agreement at the end of step ``step`` (of lease ``lease``), in one
        all-gather over the whole group: every rank's parts of the step (``AGREED``), and a
        vote that only rank 0 casts, for the cut the Supervisor asked of it. After it every rank
        knows the same things: the step's report, and whether the lease ends here (leases up to
        the vote's ``through`` are then cut: the one running ends, the queued ones never start).
        Runs after the optimizer step: a peer lost in it leaves this rank holding the step,
        whose result is already kept (the Supervisor commits it from there)."""
        cut = self.cut
        vote = cut[0] + 1 if cut is not None and lease <= cut[0] and cut[1] <= step + 1 else 0
        mine = torch.tensor([vote] + [float(result[k]) for k in AGREED], dtype=torch.float64, device=self.device)
        table = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.marker.enter(phases.AGREEMENT)
        dist.all_gather(table, mine)
        table = torch.stack(table).cpu().numpy()
        through = int(table[:, 0].max()) - 1
        self.cut_through = max(self.cut_through, through)
        return {"step": step, "lr": result["lr"], "grad_norm": result["grad_norm"], "ranks": table[:, 1:],
                "cut": through >= lease}

    @ray.method(concurrency_group="control")
    def agreed_steps(self, first: int) -> int:
        """How many steps from ``first`` on this rank kept the results of (a step's result is
        kept once the step is agreed, when peer copies are on)."""
        n = 0
        while first + n in self.recent_results:
            n += 1
        return n

    @ray.method(concurrency_group="control")
    def lease_results(self, first: int, stop: int) -> list[dict[str, float]]:
        """The results this worker kept of steps ``first`` .. ``stop - 1`` (all of them, or none)."""
        kept = [self.recent_results.get(s) for s in range(first, stop)]
        return kept if all(r is not None for r in kept) else []

    @ray.method(concurrency_group="control")
    def kept_results(self, first: int, stop: int) -> dict[int, dict[str, float]]:
        """The results this worker kept of steps ``first`` .. ``stop - 1``, by step (those it has)."""
        return {s: self.recent_results[s] for s in range(first, stop) if s in self.recent_results}

    def train_step(self, step: int, batch: "RankShare | dict[str, np.ndarray]", global_units: int,
                   collective_timeout_s: float = 0.0, *pieces, lease: int | None = None) -> dict[str, Any]:
        """One optimizer step on this rank's rows of step ``step``'s global batch.

        The rows are this rank's data-parallel slice (TP and PP peers get the same rows): where
        they lie in the object store (``RankShare``) with the pieces' values in ``pieces`` (the
        Supervisor passes their references as arguments, so Ray pulls them to this node, node to
        node, while the step before runs), or the rows themselves (``data.delivery=driver``). The
        summed loss of each micro-batch is scaled by data_parallel_size / global_units: data
        parallelism averages gradients over its ranks, so the result is the gradient of the global
        mean loss whatever the shares, equal to the single-process one. ``loss_sum`` is reported
        by one rank per data shard (0 elsewhere), so the Supervisor's sum counts each row once.

        Where this rank's time went, in seconds (raytrain_sys.parallel.timing): ``data_wait_s``
        assembling its rows from the pieces, ``compute_s`` forward and backward, ``collective_s``
        the exposed wait on the gradient collectives, ``optimizer_s`` clipping and the optimizer
        step. Clock reads only: no collective or device sync is added to the step.

        In a lease (``lease``) the result is kept (``recent_results``) and the step ends with the
        ranks' agreement (``_agree``), whose report is returned instead.
        """
        assert self.pm is not None and self.optimizer is not None, "setup_group first"
        assert self.stash is None, "this worker holds state not yet loaded into its layout"
        if self.step_done != step:
            # Sent ahead (the Supervisor's run-ahead) after a step that failed here: refuse it,
            # state untouched, so that the rebuild finds the state of the step before.
            raise RuntimeError(f"step {step + 1} refused: this worker holds the state of step "
                               f"{self.step_done}, not {step}")
        if collective_timeout_s and abs(collective_timeout_s - self.collective_timeout_s) > 1.0:
            self._set_collective_timeout(collective_timeout_s)
        self.marker.start_step(step)
        t0 = time.perf_counter()
        if isinstance(batch, RankShare):
            batch = batch.assemble(list(pieces))
        spec = self.spec
        lr = lr_at(step, spec.optim, spec.train.max_steps, spec.train.global_batch_size)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(_step_seed(spec.train.seed, step, self.rank))

        # The arrays arrive read-only from Ray's object store; torch.tensor copies them.
        tensors = {k: torch.tensor(v, device=self.device) for k, v in batch.items()}
        rows = len(next(iter(tensors.values())))
        data_wait_s = time.perf_counter() - t0
        try:
            loss_sum = self.pm.forward_backward(tensors, global_units, spec.train.micro_batch_size)
            compute_s, collective_s = self.pm.clock.split()
            self.marker.enter(phases.OPTIMIZER)
            t1 = time.perf_counter()
            max_norm = spec.optim.grad_clip if spec.optim.grad_clip > 0 else float("inf")
            grad_norm = self.pm.clip_grad_norm_(max_norm)
        except BaseException:
            # A peer died mid-step: this half-done step is discarded; the rebuild starts clean.
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_done = step + 1
        result = {"loss_sum": loss_sum if self.pm.is_data_leader else 0.0, "rows": float(rows),
                  "grad_norm": float(grad_norm), "lr": lr, "data_wait_s": data_wait_s,
                  "compute_s": compute_s, "collective_s": collective_s,
                  "optimizer_s": time.perf_counter() - t1, "units": global_units}
        if lease is None:
            return result
        if not self.peer_copies.on:
            self.recent_results[step] = result  # (a peer lost in the agreement: this rank's part)
            agreed = self._agree(lease, step, result)
            self.recent_results[step] = agreed_result(result, agreed)
            return agreed
        # Peer copies (raytrain_sys.control.peer_copies): the copy of the state this step began
        # from went to the peer after the step before, and moved while this one computed; it is
        # whole there before this step's agreement, which so confirms it on every rank: the step
        # before is kept (for lease_results) and committed only then. The lease's last step
        # waits for its own copy (_confirm_copies).
        t0 = time.perf_counter()
        self.marker.enter(phases.COPY)
        self.peer_copies.wait(self._copy_timeout_s())
        self.peer_copies.copy_s += time.perf_counter() - t0
        self._copy_to_peer()
        agreed = self._agree(lease, step, result)
        self._confirmed(step)
        self.unconfirmed = (step, agreed_result(result, agreed))
        return agreed

    def _copy_timeout_s(self) -> float:
        return max(60.0, self.collective_timeout_s)

    def _copy_to_peer(self) -> None:
        """This rank's owned blocks of the state it holds, to its peer (its receipt: ``wait``)."""
        t0 = time.perf_counter()
        self.peer_copies.send(self.rank, self.step_done, self._owned_pieces())
        self.peer_copies.copy_s += time.perf_counter() - t0

    def _owned_pieces(self) -> dict:
        """This rank's owned blocks, views of its live state (``reshard.local_pieces``, no copy).
        A step updates the state in place, so the views taken at one step read the next step's
        values: they are worked out again only for a new layout or when the memory behind them
        is no longer the model's and the optimizer's (``_state_memory``: a load, the optimizer's
        first step, a ``.data`` swapped), not at each step (``model.state_dict()`` and each
        DTensor's offsets took 8 ms a step for the tiny GPT's 112 blocks, on 0.34 s steps of two
        ranks on 2 cores: more than the copy's put). Off the CPU the blocks are copied to it at
        each call, as before."""
        layout, memory = (self.generation, self.coords), self._state_memory()
        cached = self._pieces_cache
        if (cached is not None and cached[0] == layout and len(cached[1]) == len(memory)
                and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(cached[1], memory))):
            return cached[2]
        pieces = reshard.local_pieces(self.model, self.optimizer, owned_by=self.coords, copy=False)
        self._pieces_cache = (layout, memory, pieces) if views_of_state(memory) else None
        return pieces

    def _state_memory(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, address of its local memory) of the model's parameters and buffers and the
        optimizer's state tensors: the objects themselves (held by the cache, so an id is not
        reused while they live) and where their data is (a DTensor's is its local tensor's)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                tensors.append(p)
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return [(t, getattr(t, "_local_tensor", t).data_ptr()) for t in tensors]

    def _confirmed(self, state: int) -> None:
        """Every rank's copy of the state of ``state`` steps is whole at its peer: the step that
        made it is kept (committed), and older copies and snapshots go."""
        if self.unconfirmed is not None and self.unconfirmed[0] == state - 1:
            self.recent_results[state - 1] = self.unconfirmed[1]
            self.unconfirmed = None
        self.peer_copies.agreed(state, self.generation)

    def _confirm_copies(self) -> None:
        """The lease's end: this rank's copy of the state it holds is whole at its peer, and
        (one more collective) every rank's is."""
        t0 = time.perf_counter()
        self.marker.enter(phases.CONFIRM)
        self.peer_copies.wait(self._copy_timeout_s())
        dist.all_reduce(torch.zeros(1, device=self.device))
        self.peer_copies.copy_s += time.perf_counter() - t0
        self._confirmed(self.step_done)

    def evaluate(self, batch_refs: list, which: list[int]) -> dict[int, dict[str, float]]:
        """The sums of evaluation batches ``which`` (indices into ``batch_refs``, -1: a repeat that
        keeps the collectives in step), with the state this worker holds; only a data leader's
        count (raytrain_sys.train.evaluate)."""
        from raytrain_sys.train.evaluate import batch_sums

        assert self.pm is not None and self.stash is None, "no state in this layout to evaluate"
        model = self.pm.local_model  # not DDP's wrapper: its forward would sync buffers
        wanted = sorted({i for i in which if i >= 0})
        batches = dict(zip(wanted, ray.get([batch_refs[i] for i in wanted]))) if wanted else {}
        spare = ray.get(batch_refs[0]) if -1 in which else None
        out = {}
        model.eval()
        self.marker.enter(phases.EVALUATION, self.step_done)
        try:
            with self.pm._autocast():
                for i in which:
                    sums = batch_sums(self.task, model, batches[i] if i >= 0 else spare, self.device)
                    if i >= 0 and self.pm.is_data_leader:
                        out[i] = sums
        finally:
            model.train()
            self.marker.enter(phases.IDLE)
        return out

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, store_uri: str, s3_endpoint_url: str, step: int,
                        everything: bool = False, stage_dir: str = "") -> list[dict]:
        """Write the blocks of the state of ``step`` this rank owns (data only; no manifest).

        Every block of the state is owned by exactly one rank (in a replicated layout rank 0
        owns all of it), so the files of all members together hold it once. ``everything``:
        write all this rank holds instead (a replicated layout's last save when rank 0 is gone).
        No collective: a save works while the process group is broken. Returns the manifest
        records written (none when this rank owns nothing). A background write still in flight
        ends first (one write per rank at a time).
        """
        self.background.wait()
        state = self._owned_state(step, everything)
        if state is None:
            return []
        ckpt, name = self._checkpoint_target(store_uri, s3_endpoint_url)
        return [ckpt.write_state(step, name, state, stage_dir)]

    def start_checkpoint(self, store_uri: str, s3_endpoint_url: str, step: int,
                         stage_dir: str = "") -> dict[str, Any]:
        """``save_checkpoint`` in the background (checkpoint.async_save): copy the owned blocks
        to host memory now, the only time training waits, then write them in a thread; the
        records come from ``checkpoint_written``. Waits first for this rank's previous
        background write, if one is still in flight."""
        t0 = time.perf_counter()
        self.background.wait()
        state = self._owned_state(step, everything=False)
        snapshot_s = time.perf_counter() - t0
        if state is None:
            return {"writes": False, "snapshot_bytes": 0, "snapshot_s": snapshot_s}
        ckpt, name = self._checkpoint_target(store_uri, s3_endpoint_url)
        nbytes = sum(p["data"].numel() * p["data"].element_size() for p in state["pieces"].values())
        self.background.start(step, nbytes, lambda: [ckpt.write_state(step, name, state, stage_dir)])
        return {"writes": True, "snapshot_bytes": nbytes, "snapshot_s": snapshot_s}

    @ray.method(concurrency_group="checkpoint")
    def checkpoint_written(self, step: int) -> dict[str, Any]:
        """Once this rank's background write of ``step`` is durable: its manifest records and
        how long it took; raises what the write raised."""
        return {"files": self.background.result(step), "write_s": self.background.write_s}

    def _owned_state(self, step: int, everything: bool) -> dict[str, Any] | None:
        """The checkpoint file's content for this rank (its blocks copied to host memory), or
        None when it owns no block."""
        assert self.stash is None and self.step_done == step, \
            f"asked to save step {step}, this worker holds {self.ping()} (in layout: {self.step_done})"
        owned = reshard.local_pieces(self.model, self.optimizer,
                                     owned_by=None if everything else self.coords)
        if not owned:
            return None
        return {"step": step, "rank": self.rank, "world_size": self.world_size,
                "pieces": reshard.pieces_to_plain(owned)}

    def _checkpoint_target(self, store_uri: str, s3_endpoint_url: str):
        from raytrain_sys.checkpoint.checkpointer import Checkpointer
        from raytrain_sys.checkpoint.store import open_store

        ckpt = Checkpointer(open_store(store_uri, s3_endpoint_url), keep_last=None)  # writes only
        return ckpt, PIECES_FILE.format(rank=self.rank)

    def load_checkpoint(self, checkpoint_uri: str, s3_endpoint_url: str) -> int:
        """Take this layout's blocks of a checkpoint written at any layout or world size, one
        file at a time (raytrain_sys.checkpoint.state.load_blocks)."""
        from raytrain_sys.checkpoint.checkpointer import open_checkpoint
        from raytrain_sys.checkpoint.state import load_blocks

        ckpt, info = open_checkpoint(checkpoint_uri, s3_endpoint_url)
        load_blocks(ckpt, info, self.model, self.optimizer)
        self._loaded(info.step)
        return self.step_done

    def state_pieces(self) -> dict:
        """What this worker holds of the state, as pieces (a member leaving a draining node:
        its pieces outlive it in the object store). The Supervisor passes the reference on.
        No copy: Ray serializes them before this actor runs anything else."""
        return self._held_pieces()

    # Peer copies (raytrain_sys.control.peer_copies): where this rank's copy goes, and the
    # copies of others it holds, received beside the step (their own concurrency group).
    @ray.method(concurrency_group="control")
    def set_peer(self, peer, peer_rank: int, generation: int) -> None:
        """Copy this rank's blocks to ``peer`` after every step of ``generation`` (None: no copies)."""
        self.peer_copies.set_peer(peer, peer_rank, generation, self.rank, self._copy_timeout_s())

    @ray.method(concurrency_group="peer")
    def hold_copy(self, generation: int, source: int, step: int, pieces: dict) -> int:
        """Hold rank ``source``'s blocks at ``step`` (the whole argument arrived, or its bytes over
        the channel, ``PeerCopies.hold``); the bytes held."""
        if self.spec.elastic.fault_copy_delay_s:  # test only: a copy in flight for that long
            time.sleep(self.spec.elastic.fault_copy_delay_s)
        return self.peer_copies.hold(generation, source, step, pieces)

    @ray.method(concurrency_group="control")
    def held_copies(self) -> list[tuple[str, int, int, int]]:
        """(kind, generation, source rank, step) of every peer copy this worker holds ("held")
        and of its own snapshots ("own")."""
        return self.peer_copies.held()

    @ray.method(concurrency_group="control")
    def rescue_copy(self, copy: tuple) -> dict:
        """A peer copy or snapshot this worker holds (``held_copies``), asked on the control path
        of a member about to be killed (blocked in a collective after its peers were lost): the
        caller owns the returned object, which outlives this process."""
        return self.peer_copies.pieces(*copy)

    @ray.method(concurrency_group="control")
    def host_memory_available(self) -> int:
        """Bytes of memory this worker's host has available (peer copies' room, auto mode)."""
        import psutil

        return int(psutil.virtual_memory().available)

    @ray.method(concurrency_group="control")
    def peer_copy_stats(self) -> dict[str, Any]:
        """Seconds this rank's steps spent on their copies, bytes sent a copy, bytes held."""
        c = self.peer_copies
        return {"copy_s": c.copy_s, "sent_bytes": c.sent_bytes, "held_bytes": c.held_bytes(), "peer": c.peer_rank}

    # Re-forming a sharded layout, by blocks (raytrain_sys.parallel.reshard): the holders of the
    # committed step index what they hold, every member plans what it needs of whom, the
    # holders cut those parts, and every member copies them into its new blocks. ``copy``
    # (kind, generation, source rank, step): a peer copy or snapshot, instead of its live state.
    def _held_pieces(self, copy: tuple | None = None) -> dict:
        if copy is not None:
            return self.peer_copies.pieces(*copy)
        if self.stash is not None:
            return self.stash[1]
        return reshard.local_pieces(self.model, self.optimizer, copy=False)

    def piece_index(self, copy: tuple | None = None) -> dict:
        """Shapes and offsets of the pieces this worker holds (no data)."""
        return reshard.piece_index(self._held_pieces(copy))

    def plan_reshard(self, step: int, *indexes: dict) -> dict:
        """What this member needs of each source (``indexes``, in the Supervisor's order) for
        its blocks of the current layout: per source, chunks of requests; and the keys the
        sources do not cover (then nothing will be loaded: the Supervisor restores instead)."""
        keys = set().union(*(index.keys() for index in indexes))
        wants = reshard.wanted_blocks(self.model, self.optimizer, keys)
        required = reshard.keys_needed(self.model, self.optimizer, step > 0)
        chunks, missing = reshard.plan_requests(wants, list(indexes), required)
        return {"chunks": chunks, "missing": missing}

    def cut_pieces(self, chunks: list, copy: tuple | None = None):
        """The parts ``chunks`` asks of this worker's pieces (or of a peer copy it holds), one
        return value a chunk: Ray stores each as it is yielded, so this worker holds one chunk's
        copy at a time."""
        pieces = self._held_pieces(copy)
        for requests in chunks:
            yield reshard.cut(pieces, requests)

    def load_pieces(self, step: int, chunk_refs: list) -> int:
        """Fill this layout's blocks with the parts planned by ``plan_reshard``, one chunk in
        memory at a time; then the state is that of ``step``."""
        placement = reshard.Placement(self.model, self.optimizer)
        for ref in chunk_refs:
            for key, piece in ray.get(ref):
                placement.take(key, piece)
        self._loaded(step)
        return self.step_done

    def _loaded(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.step_done, self.stash = step, None
        if not self.peer_copies.on:  # a layout without copies: the old group's are not needed
            self.peer_copies.agreed(step + 1, self.generation + 1)

    def sync_state(self, src_rank: int) -> int:
        """Replicated layout: make this replica equal to ``src_rank``'s, the survivor that holds
        the newest step.

        Parameters go tensor by tensor (in place, so DDP and the optimizer keep their
        references); the optimizer state, whose layout a newcomer lacks, goes as one object.
        The schedule and dropout RNG are functions of the step, and the data cursor lives in the
        Supervisor, so nothing else needs to travel.
        """
        assert self.replicated and self.stash is None, "sharded layouts share state as pieces"
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=src_rank)
        box = [{"optim": self.optimizer.state_dict(), "step": self.step_done}
               if self.rank == src_rank else None]
        dist.broadcast_object_list(box, src=src_rank)
        if self.rank != src_rank:
            self.optimizer.load_state_dict(box[0]["optim"])
            self.step_done = int(box[0]["step"])
        self.optimizer.zero_grad(set_to_none=True)
        return self.step_done

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state (its shards)."""
        return self.pm.memory(self.optimizer)
