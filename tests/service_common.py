"""Shared by the job service tests: step gates that hold a runner's step loop at a chosen step
until the test says go (so that an event lands mid-run whatever the machine's speed), and the
service's start and clean-up on the session cluster; a free port for its HTTP API, and whether
that API answers."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import ray

from raytrain_sys.service.runner import NAMESPACE, RUNNER_PREFIX


class StepGates:
    """A runner step hook (``step_hook``), run in the runner's process at each committed step.

    Files in ``root`` drive it: with ``hold-<job>-<step>`` present, the job's step loop stops at
    the commit of that step, writes ``at-<job>-<step>`` and waits for ``go-<job>-<step>``
    (a step redone after a restore passes once go exists); ``pids`` reads the run's worker
    processes at that hold. With ``newcomer-<job>`` present,
    the loop waits for every requested worker to be ready (at each step until the slots held
    reach the run's target), so a grow lands whole before the end."""

    def __init__(self, root: str, timeout_s: float = 240.0):
        self.root = root
        self.timeout_s = timeout_s

    def __call__(self, job_id, sup, report) -> None:
        step = report.step
        if os.path.exists(self._path("hold", job_id, step)):
            at = self._path("at", job_id, step)
            with open(at + ".tmp", "w") as f:  # the run's worker processes (for a kill), whole once seen
                json.dump({"pids": [w.info["pid"] for w in sup.group.workers]}, f)
            os.replace(at + ".tmp", at)
            deadline = time.monotonic() + self.timeout_s
            while not os.path.exists(self._path("go", job_id, step)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id}: no go for step {step} within {self.timeout_s:g} s")
                time.sleep(0.05)
        newcomer = os.path.join(self.root, f"newcomer-{job_id}")
        if os.path.exists(newcomer) and sup.group.pending:
            # all of them: a grow by 2 that takes one ends a worker short; and until the slots
            # held reach the run's target (a grow asked for in two passes, as the quota frees one
            # worker and then the other, waits here again at the next step for the second)
            sup.group.await_pending(self.timeout_s)
            if sup.group.held >= sup._target_size():
                os.remove(newcomer)

    def _path(self, kind, job_id, step) -> str:
        return os.path.join(self.root, f"{kind}-{job_id}-{step}")

    # the test's side
    def hold(self, job_id: int, step: int) -> None:
        open(self._path("hold", job_id, step), "w").close()

    def reached(self, job_id: int, step: int) -> bool:
        return os.path.exists(self._path("at", job_id, step))

    def pids(self, job_id: int, step: int) -> list[int]:
        """The process ids of the job's workers when its step loop held at ``step``."""
        with open(self._path("at", job_id, step)) as f:
            return json.load(f)["pids"]

    def go(self, job_id: int, step: int) -> None:
        open(self._path("go", job_id, step), "w").close()

    def wait_for_newcomer(self, job_id: int) -> None:
        open(os.path.join(self.root, f"newcomer-{job_id}"), "w").close()


def runner_heard(test_dir, job_id: int, what: str, timeout_s: float = 120.0) -> None:
    """Wait until the job's runner has been asked to ``what`` (pause, cancel): the reconciler
    delivers a user's request on its next pass. A test that lets a held step loop go on before
    then races that pass, and on a busy machine the run may end first."""
    path = os.path.join(str(test_dir), "raytrain-sys-logs", f"job-{job_id}.log")
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(path):
            with open(path) as f:
                if f"job {job_id}: {what} asked by" in f.read():
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}'s runner was not asked to {what} within {timeout_s:g} s")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the service's API is bound to it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_answers(url: str) -> bool:
    """The service's HTTP API at ``url`` answers ``GET /healthz`` (False while it is not up)."""
    from raytrain_sys.service.client import Client

    try:
        return Client(url, None).health()["ok"]
    except Exception:  # noqa: BLE001: not up (yet, or any more)
        return False


def runner_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(RUNNER_PREFIX)]


@contextlib.contextmanager
def running_service(db, gates: StepGates, **config):
    """The service on the session cluster, its store a SQLite file at path ``db`` or the
    database URL ``db``; on exit it is stopped and every runner ended."""
    from raytrain_sys.service.service import start_service, stop_service

    config.setdefault("poll_s", 0.2)
    # No pool of warm spares unless a test passes warm_workers_per_node (tests/test_spares.py
    # tests the pool itself): a service's pool keeps a
    # spare TrainWorker on each of the session's four nodes and two spare runners, and starts
    # another for each one a job takes, several times the processes a test's one or two jobs
    # need. Four service_runner tests: 144 s and 255 CPU-seconds with a spare per node, 104 s and
    # 133 CPU-seconds without, on this 2-core machine.
    config.setdefault("warm_workers_per_node", 0)
    url = str(db) if "://" in str(db) else f"sqlite:///{db}"
    # Beside the gates (the test's dir), unless a test gives one ("": the store's, Store.log_dir).
    config.setdefault("log_dir", os.path.join(os.path.dirname(gates.root), "raytrain-sys-logs"))
    config.setdefault("serve_api", False)  # the HTTP API on DEFAULT_PORT unless a test gives a port
    handle = start_service(url, step_hook=gates, **config)
    try:
        yield handle
    finally:
        stop_service()
        from raytrain_sys.service.sweeps.names import SWEEP_RUNNER_PREFIX

        sweep_runners = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a["namespace"] == NAMESPACE and a["name"].startswith(SWEEP_RUNNER_PREFIX)]
        for name in runner_actors() + sweep_runners:
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
