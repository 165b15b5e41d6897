"""The job service's process: ``ServiceActor``, a detached named Ray actor, and its helpers.

Owns: the store it opens (SQLite file by default, a ``postgresql://`` URL allowed), the
reconciler loop (a thread, one pass every ``poll_s``), the HTTP API when
``raytrain_sys/service/api.py`` is installed (imported lazily; ``api.serve(store, host, port)``
binds the port before anything else starts, so a port that is taken fails the start with that
reason and leaves nothing running; without the module the service runs and says so), and the
cluster's capacity in workers for the scheduler (CPU slots / ``cpus_per_worker``, or GPUs /
``gpus_per_worker``, read each pass, unless ``cluster_workers`` is configured; with a flavor
table, each flavor's CPUs, GPUs and memory from the nodes' labels, ``service/capacity.py``; with
``autoscaling``, the ceiling the worker groups can reach: ``max_cluster_workers`` or Ray's cluster
config, a flavor's ``max_*``). Its logs (``service.log``, and the runners' ``job-<id>.log``) go to
the store's one log directory (``Store.log_dir``). ``info`` says what really serves: the actor
answers it, and ``api_problem`` is "" only when the API answers ``GET /healthz`` at its address.

Why an actor: it lives in the cluster, not in the shell that started it (``raytrain-sys service
start`` returns; the service runs on). Detached and named (``raytrain-sys-service`` in namespace
``raytrain-sys``), num_cpus=0, never restarted by Ray: a service started again (after a crash,
or ``service stop`` then ``start``) opens the same database and its reconciler reads back what
was recorded, re-attaches to the runners by name and finishes the intents it finds. The jobs
themselves live in their runners (detached too): stopping the service stops no training. On a
cluster with safe nodes (``raytrain_control``, ``control/control_actors.py``) it runs on one, as
do the runners, the spare runners and the warm spares' pool: a spot reclaim takes none of them.

The actor's Python methods (submit, pause, resume, cancel, jobs, job, history, audit_log,
add_team, set_quotas, flavors, set_flavors, info) do what the API does, through the same
functions (``service/requests.py``), for tests and notebooks; the API adds authentication and HTTP.

Relative paths given to ``start_service`` (the SQLite file, the log dir, a spec's output_dir,
data path and checkpoint dir) are made absolute against the caller's working directory: the
actor's own working directory is Ray's.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any, Callable, Optional, Union

import ray

from raytrain_sys.control import control_actors
from raytrain_sys.control.control_actors import control_options
from raytrain_sys.control.node_roles import CONTROL_RESOURCE
from raytrain_sys.control.spares import find_pool, start_pool, stop_pool
from raytrain_sys.errors import ServiceInputError, UserError, find_user_error
from raytrain_sys.niceness import set_niceness
from raytrain_sys.service import requests as user_requests
from raytrain_sys.service.capacity import autoscaler_max_resources, ceilings, flavor_states
from raytrain_sys.service.flavors import flavor_from_dict
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.names import SERVICE_NAME
from raytrain_sys.service.progress import ProgressSource
from raytrain_sys.service.reconciler import Reconciler, ReconcilerConfig
from raytrain_sys.service.runner import NAMESPACE, log_to_file
from raytrain_sys.service.store import DEFAULT_URL, Store, mask_url
from raytrain_sys.service.sweeps import requests as sweep_requests

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # the API listens on loopback unless told otherwise
DEFAULT_PORT = 8470
DEFAULT_POLL_S = 0.5  # a reconciler pass: a request is acted on within about this long
# Idle worker processes kept per node (about 0.26 GB of memory each, PSS: torch imported;
# benchmarks/idle_footprint.py). Two cover a small job's first gang on one node; 0 turns the pool off.
DEFAULT_WARM_WORKERS = 2
# The nice value the service actor runs at, every thread (the reconciler's passes, the API): Ray
# starts it at 15, where beside training workers at 0 (raytrain_sys/niceness.py) a pass that does
# milliseconds of work took 1-2 s, each of its parts slowed alike (reading the store 0.2-0.4 s,
# the decision 0.3-0.7 s: benchmarks/sweep.py --quick, the pass's parts in service.log), and the
# job an ASHA stop made room for waited for it. None: Ray's.
SERVICE_NICENESS: Optional[int] = 0
API_MODULE = "raytrain_sys.service.api"
API_CHECK_TIMEOUT_S = 3.0  # GET /healthz answers in milliseconds; seconds allow for a loaded node


def cluster_capacity_workers(cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0) -> int:
    """Worker slots of the whole cluster: GPUs / gpus_per_worker when workers take GPUs, else
    CPUs / cpus_per_worker."""
    total = ray.cluster_resources()
    if gpus_per_worker > 0:
        return int(total.get("GPU", 0) // gpus_per_worker)
    return int(total.get("CPU", 0) // max(cpus_per_worker, 1e-9))


class ServiceActor:
    """See the module docstring. Start with ``start_service``."""

    def __init__(self, db_url: str = DEFAULT_URL, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 log_dir: str = "", base_dir: str, poll_s: float = DEFAULT_POLL_S,
                 cluster_workers: Optional[int] = None, cpus_per_worker: float = 1.0,
                 gpus_per_worker: float = 0.0, max_restarts: int = 3, stop_deadline_s: float = 120.0,
                 serve_api: bool = True, step_hook: Optional[Callable] = None,
                 warm_workers_per_node: int = DEFAULT_WARM_WORKERS,
                 package_retention_s: float = ReconcilerConfig.package_retention_s,
                 start_stall_s: float = ReconcilerConfig.start_stall_s,
                 max_start_returns: int = ReconcilerConfig.max_start_returns,
                 flavors: Optional[list[dict]] = None, autoscaling: bool = False,
                 max_cluster_workers: Optional[int] = None,
                 provisioning_timeout_s: float = ReconcilerConfig.provisioning_timeout_s):
        set_niceness(SERVICE_NICENESS, why="the job service")  # before its threads: they inherit it
        self.base_dir = base_dir
        self.store = Store.open(db_url)
        self.log_dir = self.store.log_dir(log_dir, base_dir)  # the store's one rule (Store.log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self._handler = log_to_file(os.path.join(self.log_dir, "service.log"))
        if flavors is not None:  # the table given at start (service start --flavors FILE) replaces the store's
            self.store.set_flavors([flavor_from_dict(f, f"flavors[{i}]") for i, f in enumerate(flavors)])
        self.autoscaling, self._max_cluster_workers = autoscaling, max_cluster_workers
        self.host, self.port, self.poll_s = host, port, poll_s
        self._cluster_workers = cluster_workers
        self._cpus_per_worker, self._gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.reconciler = Reconciler(self.store, ReconcilerConfig(log_dir=self.log_dir, max_restarts=max_restarts,
                                                                  stop_deadline_s=stop_deadline_s,
                                                                  spare_runners=2 if warm_workers_per_node > 0 else 0,
                                                                  package_retention_s=package_retention_s,
                                                                  start_stall_s=start_stall_s,
                                                                  max_start_returns=max_start_returns,
                                                                  provisioning_timeout_s=provisioning_timeout_s,
                                                                  autoscaling=autoscaling,
                                                                  db_url=db_url, base_dir=base_dir),
                                     cluster_workers=self.cluster_workers, step_hook=step_hook,
                                     flavor_states=self.flavor_states)
        self.last_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()  # a request was made: pass now (see _loop)
        self.store.add_waker(self._wake.set)
        self.api, self._api = "not served", None
        try:
            # Before anything else starts: a port that is taken fails the start here, and the
            # caller gets the reason (start_service), with nothing left running.
            if serve_api:
                self._serve_api()
        except BaseException:
            self._close_api_and_store()
            raise
        # Warm spares: worker processes with torch imported on every node, for the jobs' first
        # gangs (raytrain_sys.control.spares); a pool left by an earlier start is adopted. None
        # with autoscaling: an idle spare is a live actor on its node, and Ray's autoscaler never
        # releases a node with an actor on it (measured: a 0-CPU actor kept a fake node 40 s past
        # its 6 s idle timeout; it went 7 s after the actor ended), so the nodes a queue brought
        # would stay. The spare runners stay: they run on the safe nodes, which are not scaled.
        self.warm_workers_per_node = 0 if autoscaling else warm_workers_per_node
        if self.warm_workers_per_node > 0:
            start_pool(self.warm_workers_per_node)
        if autoscaling and control_actors.placement().safe_nodes == 0:
            log.warning("autoscaling on a cluster with no safe node (%s): the service's runners may land on nodes "
                        "the autoscaler adds, and keep them from being released", CONTROL_RESOURCE)
        self._loop_thread = threading.Thread(target=self._loop, name="reconciler", daemon=True)
        self._loop_thread.start()
        log.info("service started: store %s, %s, logs in %s, pid %d", self.store.url, self.api, self.log_dir,
                 os.getpid())

    # ------------------------------------------------------------------ threads
    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.reconciler.run_once()
                self.last_error = ""
            except Exception as exc:  # a pass that fails is retried; the service must not die of it
                if str(exc) != self.last_error:
                    log.exception("reconciler pass failed: %s", exc)
                self.last_error = str(exc)
            # The next pass comes at the poll, or at once when a user's request woke it.
            self._wake.wait(max(0.0, self.poll_s - (time.monotonic() - started)))
            self._wake.clear()

    def _serve_api(self) -> None:
        """Serve the HTTP API (``api.serve``: it returns once the port is bound and uvicorn
        accepts connections, and raises a UserError when the port is taken)."""
        try:
            api = importlib.import_module(API_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name != API_MODULE:
                raise
            self.api = f"no HTTP API ({API_MODULE} is not installed)"
            log.warning("%s", self.api)
            return
        offered = {"log_dir": self.log_dir, "base_dir": self.base_dir, "cluster_workers": self.admission_workers,
                   "progress": ProgressSource(runner_of=self.reconciler.runner), "capacity": self.capacity}
        accepted = inspect.signature(api.serve).parameters
        kwargs = {k: v for k, v in offered.items() if k in accepted}
        self._api = api.serve(self.store, self.host, self.port, **kwargs)
        self.api = f"HTTP API on {self._api.url}"

    def api_answers(self, timeout_s: float = API_CHECK_TIMEOUT_S) -> str:
        """"" when the API answers ``GET /healthz`` at its address, else why not. Asked from
        this process: it runs on the node the API listens on, so a loopback address (the
        default) is checked too, and a client elsewhere is not taken for the service."""
        if self._api is None:
            return self.api
        return healthz_problem(local_url(self._api.url), timeout_s)

    def cluster_workers(self) -> int:
        if self._cluster_workers is not None:
            return self._cluster_workers
        return cluster_capacity_workers(self._cpus_per_worker, self._gpus_per_worker)

    def max_cluster_workers(self) -> Optional[int]:
        """With autoscaling, the implicit flavor's ceiling: ``max_cluster_workers``, else what Ray's
        cluster config says its node groups reach (``capacity.autoscaler_max_resources``), in
        worker slots; None without autoscaling or when neither says."""
        if not self.autoscaling:
            return None
        if self._max_cluster_workers is not None:
            return self._max_cluster_workers
        most = autoscaler_max_resources()
        if not most:
            return None
        if self._gpus_per_worker > 0:
            return int(most.get("GPU", 0) // self._gpus_per_worker)
        return int(most.get("CPU", 0) // max(self._cpus_per_worker, 1e-9))

    def admission_workers(self) -> int:
        """The implicit flavor's capacity the scheduler and the submit check count: its ceiling
        with autoscaling, else what is up."""
        return max(self.cluster_workers(), self.max_cluster_workers() or 0)

    def flavor_states(self, table: tuple = ()) -> tuple:
        """Each flavor's capacity now and its ceiling (``service/capacity.py``), for the
        scheduler; the implicit flavor's when there is no table."""
        nodes = [(n.get("Resources") or {}, n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive")] \
            if table else []
        return flavor_states(table, nodes, cluster_workers=self.cluster_workers(), autoscaling=self.autoscaling,
                             max_cluster_workers=self.max_cluster_workers())

    def capacity(self) -> dict:
        """Each flavor's ceiling per resource (the API's submit check and GET /v1/flavors)."""
        return ceilings(self.flavor_states(self.store.flavors()))

    # ------------------------------------------------------------------ what the API does, as methods
    def submit(self, team: str, spec: Union[dict, str], priority: int = 0, name: str = "", by: str = "",
               idempotency_key: Optional[str] = None, package: Optional[str] = None) -> dict:
        job = user_requests.submit(self.store, team=team, spec=spec, by=by or team, priority=priority, name=name,
                                   cluster_workers=self.admission_workers(), idempotency_key=idempotency_key,
                                   base_dir=self.base_dir, package=package, capacity=self.capacity())
        return user_requests.job_dict(job)

    def upload_package(self, team: str, sha256: str, data: bytes, by: str = "") -> dict:
        """Keep a code package for the team's submits (``packages.pack`` makes one)."""
        return user_requests.upload_package(self.store, team=team, sha256=sha256, data=data, by=by or team)

    def pause(self, job_id: int, by: str, reason: str = "") -> dict:
        return user_requests.job_dict(user_requests.pause(self.store, job_id, by=by, reason=reason))

    def resume(self, job_id: int, by: str, reason: str = "") -> dict:
        return user_requests.job_dict(user_requests.resume(self.store, job_id, by=by, reason=reason))

    def cancel(self, job_id: int, by: str, reason: str = "", delete_checkpoints: bool = False) -> dict:
        return user_requests.job_dict(user_requests.cancel(self.store, job_id, by=by, reason=reason,
                                                           delete_checkpoints=delete_checkpoints))

    def jobs(self, team: Optional[str] = None) -> list[dict]:
        return [user_requests.job_dict(j) for j in self.store.jobs(team=team)]

    def submit_sweep(self, team: str, sweep: Union[dict, str], priority: int = 0, by: str = "") -> dict:
        """Queue a sweep (``sweeps/requests.py``): the reconciler starts its runner."""
        record = sweep_requests.submit(self.store, team=team, sweep=sweep, by=by or team, priority=priority,
                                       base_dir=self.base_dir, cluster_workers=self.admission_workers(),
                                       capacity=self.capacity())
        return sweep_requests.sweep_dict(record)

    def sweeps(self, team: Optional[str] = None) -> list[dict]:
        return [sweep_requests.sweep_dict(s) for s in self.store.sweeps(team=team)]

    def sweep(self, sweep_id: int) -> dict:
        return sweep_requests.sweep_dict(self.store.sweep(sweep_id), self.store.trials(sweep_id))

    def pause_sweep(self, sweep_id: int, by: str, reason: str = "") -> dict:
        return sweep_requests.sweep_dict(sweep_requests.pause(self.store, sweep_id, by=by, reason=reason))

    def resume_sweep(self, sweep_id: int, by: str, reason: str = "") -> dict:
        return sweep_requests.sweep_dict(sweep_requests.resume(self.store, sweep_id, by=by, reason=reason))

    def cancel_sweep(self, sweep_id: int, by: str, reason: str = "") -> dict:
        return sweep_requests.sweep_dict(sweep_requests.cancel(self.store, sweep_id, by=by, reason=reason))

    def job(self, job_id: int) -> dict:
        return user_requests.job_dict(self.store.job(job_id))

    def history(self, job_id: int) -> list[dict]:
        return [{"from": t.from_state.value if t.from_state else None, "to": t.to_state.value, "at_s": t.at_s,
                 "actor": t.actor, "reason": t.reason} for t in self.store.history(job_id)]

    def audit_log(self) -> list[dict]:
        return [asdict(a) for a in self.store.audit_log()]

    def add_team(self, name: str, nominal_workers: int, cohort: Optional[str] = None, by: str = "admin",
                 **limits: Any) -> dict:
        try:
            team = self.store.add_team(Team(name=name, nominal_workers=nominal_workers, cohort=cohort, **limits))
        except ServiceInputError as exc:
            self.store.record_audit(by, "add_team", f"team {name}", f"refused: {exc}")
            raise
        self.store.record_audit(by, "add_team", f"team {name}", "ok")
        return asdict(team)

    def teams(self) -> list[dict]:
        return [asdict(t) for t in self.store.teams()]

    def set_quotas(self, team: str, flavor: str, quotas: dict, by: str = "admin") -> dict:
        """Replace ``team``'s quotas on ``flavor`` (resource -> nominal, or -> {nominal,
        borrowing_limit, lending_limit}; {} clears them), as ``PUT /v1/teams/{name}/quotas/{flavor}``."""
        target = f"team {team} on {flavor}"
        try:
            made = [FlavorQuota(flavor, resource, **(q if isinstance(q, dict) else {"nominal": q}))
                    for resource, q in quotas.items()]
            changed = self.store.set_quotas(team, flavor, made)
        except ServiceInputError as exc:
            self.store.record_audit(by, "set_quotas", target, f"refused: {exc}")
            raise
        self.store.record_audit(by, "set_quotas", target, "ok")
        return asdict(changed)

    def flavors(self) -> list[dict]:
        return [asdict(f) for f in self.store.flavors()]

    def set_flavors(self, flavors: list[dict], by: str = "admin") -> list[dict]:
        """Replace the flavor table, as ``PUT /v1/flavors``."""
        try:
            table = self.store.set_flavors([flavor_from_dict(f, f"flavors[{i}]") for i, f in enumerate(flavors)])
        except ServiceInputError as exc:
            self.store.record_audit(by, "set_flavors", f"{len(flavors)} flavors", f"refused: {exc}")
            raise
        self.store.record_audit(by, "set_flavors", f"{len(flavors)} flavors", "ok")
        return [asdict(f) for f in table]

    def job_log_path(self, job_id: int) -> str:
        from raytrain_sys.service.runner import job_log_path

        return job_log_path(self.log_dir, job_id)

    def info(self) -> dict:
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "db": self.store.url,
                "api": self.api, "url": self._api.url if self._api is not None else None,
                "api_problem": self.api_answers(), "host": self.host, "port": self.port,
                "log_dir": self.log_dir, "poll_s": self.poll_s, "passes": self.reconciler.passes,
                "last_error": self.last_error, "cluster_workers": self.cluster_workers(),
                "jobs": self.store.count_jobs(), "warm_spares": self.warm_spares(),
                "control_nodes": control_actors.placement().where,
                "flavors": self.flavors_info(), "autoscaling": self.autoscaling_info(),
                "spare_runners": self.reconciler.spare_runners()}

    def flavors_info(self) -> Union[str, dict]:
        """Each flavor's capacity now and ceiling, or that the service has the implicit flavor."""
        states = self.flavor_states(self.store.flavors())
        if len(states) == 1 and states[0].flavor.is_implicit:
            return "no table: one implicit flavor counting workers (each team's nominal_workers)"
        return {s.name: {"up": s.capacity(present=True), "ceiling": s.capacity()} for s in states}

    def autoscaling_info(self) -> dict:
        """Whether the scheduler admits against a ceiling, and what it asked Ray's autoscaler for."""
        if not self.autoscaling:
            return {"on": False}
        asked = self.reconciler.requested
        return {"on": True, "warm_spares": "off: an idle spare would keep its node from being released",
                "max_cluster_workers": self.max_cluster_workers(),
                "provisioning_timeout_s": self.reconciler.config.provisioning_timeout_s,
                "requested": None if asked is None else asked.describe(),
                "requested_bundles": None if asked is None else len(asked.bundles),
                "requested_at_s": self.reconciler.requested_at_s}

    def warm_spares(self) -> dict:
        """The pool's counts (idle and starting spares by node, taken, missed), or why none."""
        pool = find_pool() if self.warm_workers_per_node > 0 else None
        if pool is None:
            return {"per_node": 0}
        try:
            return ray.get(pool.status.remote(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001: a report, not a failure of the service
            return {"per_node": self.warm_workers_per_node, "error": str(exc).splitlines()[0]}

    def wake(self) -> None:
        """A pass now: a request written through another process's store (a sweep's runner
        stopping a trial) does not wake this one's reconciler, which would pass at its period."""
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the reconciler loop (the runners train on), the warm spares' pool (claimed spares
        stay with their jobs) and close the store."""
        self._stop.set()
        self._wake.set()
        self._loop_thread.join(timeout=30)
        self.reconciler.close()
        stop_pool()
        self._close_api_and_store()

    def _close_api_and_store(self) -> None:
        if self._api is not None:
            self._api.stop()
        self.store.close()
        self._handler.flush()
        logging.getLogger("raytrain_sys").removeHandler(self._handler)
        self._handler.close()


RemoteServiceActor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(ServiceActor)


# ----------------------------------------------------------------------------- helpers


def absolute_db_url(db_url: str, base_dir: str) -> str:
    """A SQLite URL with a relative file path made absolute against ``base_dir``."""
    prefix = "sqlite:///"
    if db_url.startswith(prefix) and not db_url.startswith(prefix + "/") and db_url != prefix + ":memory:":
        return prefix + os.path.join(base_dir, db_url[len(prefix):])
    return db_url


def start_service(db_url: str = DEFAULT_URL, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                  log_dir: str = "", base_dir: str = "", **config: Any):
    """Start the service actor on the connected cluster and wait until it runs (or return the
    one that runs already). ``config``: ``poll_s``, ``cluster_workers``, ``cpus_per_worker``,
    ``gpus_per_worker``, ``max_restarts``, ``stop_deadline_s``, ``serve_api``, ``step_hook``,
    ``warm_workers_per_node``, ``package_retention_s``, ``start_stall_s``, ``max_start_returns``,
    ``flavors`` (a flavor table, replacing the store's), ``autoscaling``, ``max_cluster_workers``,
    ``provisioning_timeout_s``."""
    existing = get_service()
    if existing is not None:
        return existing
    base_dir = os.path.abspath(base_dir or os.getcwd())
    db_url = absolute_db_url(db_url, base_dir)
    log_dir = os.path.abspath(os.path.join(base_dir, log_dir)) if log_dir else ""  # "": the store's (Store.log_dir)
    handle = RemoteServiceActor.options(name=SERVICE_NAME, namespace=NAMESPACE, lifetime="detached",
                                        **control_options()).remote(
        db_url, host, port, log_dir=log_dir, base_dir=base_dir, **config)
    try:
        ray.get(handle.info.remote())
    except ray.exceptions.RayActorError as exc:
        with contextlib.suppress(Exception):  # dead already: its constructor raised; nothing left half-started
            ray.kill(handle, no_restart=True)
        cause = find_user_error(exc)
        raise (cause if cause is not None else UserError(
            f"the job service did not start on {mask_url(db_url)}: {str(exc).splitlines()[0]}")) from None
    return handle


def local_url(url: str) -> str:
    """The URL a client on the API's own node reaches it at (a wildcard address is not one)."""
    return url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")


def healthz_problem(url: str, timeout_s: float = API_CHECK_TIMEOUT_S) -> str:
    """"" when ``GET <url>/healthz`` answers ok, else why not, in a few words."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503: its database is unreachable
        detail = exc.read().decode(errors="replace").strip()[:200]
        return f"GET {url}/healthz answered HTTP {exc.code} {detail}".rstrip()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return f"GET {url}/healthz failed: {reason}"
    return "" if isinstance(answer, dict) and answer.get("ok") is True else f"GET {url}/healthz answered {answer!r:.200}"


def get_service():
    """The running service actor, or None."""
    try:
        return ray.get_actor(SERVICE_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def stop_service() -> bool:
    """Stop the service (its reconciler and API; the jobs' runners train on and are re-attached
    by the next start). False when none runs."""
    handle = get_service()
    if handle is None:
        return False
    try:
        ray.get(handle.shutdown.remote(), timeout=60)
    except ray.exceptions.RayError as exc:
        log.warning("the service did not shut down cleanly (%s); killing it", str(exc).splitlines()[0])
    ray.kill(handle, no_restart=True)
    return True



