"""Shared test fixtures: one local Ray cluster per session, small datasets, real servers."""

from __future__ import annotations

import os
import tempfile

import pytest

pytest_plugins = [
    "tests.fixtures.s3_server",
    "tests.fixtures.mlflow_server",
    "tests.fixtures.ray_head",
    "tests.fixtures.imds_server",
    "tests.fixtures.gce_metadata_server",
    "tests.fixtures.postgres_server",
    "tests.fixtures.custom_example",
]

# Ray Data progress bars and MLflow's emoji banners only clutter test logs.
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's background processes poll less often, for every cluster the session starts (they inherit
# this environment). All the nodes of a cluster on one machine share one logs directory, so each
# node's dashboard agent rescans the whole events dir every 2 s, and the log monitor globs the whole
# logs dir every 0.1 s while it holds under 1000 files. On an idle 5-node cluster with 700 log
# files, as a session's holds by its middle: 13.75 CPU-s a minute with Ray's defaults, 6.64 with
# these, on 2 cores that the tests need. A new log file is still followed within 5 s and read from
# its start; metrics (Prometheus) are not affected.
os.environ.setdefault("SCAN_EVENT_DIR_INTERVAL_SECONDS", "30")
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")


@pytest.fixture(scope="session")
def ray_nodes(s3_server):
    """One multi-node Ray cluster on this machine for the whole session.

    A head with no CPUs (drivers and Ray Data readers only) and four 1-CPU worker nodes, so that
    tests can lose, drain and add real nodes (ray.cluster_utils.Cluster). The temp dir is short:
    Ray's unix socket paths must stay under 107 characters. It starts after the S3 server so
    that its workers inherit the S3 credentials, as workers on a real cluster get them from
    their nodes' environment.

    Every node added (here or by a test) has its own runtime-env directory, as separate machines
    do: Ray unpacks a job's working_dir there, replacing what it finds, and on one shared
    directory a node joining a job would delete the package under the processes of the others.
    """
    import itertools

    import ray
    from ray.cluster_utils import Cluster

    from ray._common.utils import get_default_ray_temp_dir

    temp_dir = tempfile.mkdtemp(prefix="rts-", dir="/tmp")
    # Cluster() records the head's address in Ray's default temp dir (/tmp/ray) whatever
    # temp_dir says; on a machine where Ray never ran that directory does not exist yet.
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    node_args = {"object_store_memory": 200 * 1024**2}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "temp_dir": temp_dir, **node_args})
    add_node, numbers = cluster.add_node, itertools.count(1)

    def add_own_node(**kwargs):
        kwargs.setdefault("runtime_env_dir_name", f"runtime_resources_{next(numbers)}")
        return add_node(**kwargs)

    cluster.add_node = add_own_node
    for _ in range(4):
        cluster.add_node(num_cpus=1, **node_args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.node_args = node_args
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(ray_nodes) -> str:
    """The session cluster's address."""
    return ray_nodes.address


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> str:
    """A small real corpus (a slice of the standard library), rows of 33 tokens."""
    from raytrain_sys.data.prepare import prepare_text_dataset

    out = str(tmp_path_factory.mktemp("data") / "stdlib-tiny")
    prepare_text_dataset(out, row_len=33, rows_per_shard=512, max_bytes=400_000)
    return out


@pytest.fixture(autouse=True)
def _session_cluster_idle(request):
    """Each test that uses the session cluster starts on an idle one, and finds out if an earlier
    test left something holding it: every CPU free again within 30 s (Ray frees a killed actor's
    resources asynchronously), or an error naming what still holds them.

    A test marked ``warm_workers(needed=True)`` runs on warm workers, as a notebook's runs do
    after ``rts.connect(spec, warm_workers_per_node=1)``: the session's own pool of spares
    (``control.spares``) keeps one idle worker process on each node, and a run from this
    process adopts them and gives them back at its end. The modules marked ``warm_workers``
    without ``needed`` passed on that pool too, and run on it only with
    ``RTS_TESTS_WARM_WORKERS=1``: by default they start fresh processes, as every other test
    does (or a service's own pool). Each of those files is faster on the pool alone, but the
    whole suite was not: 68.7 min in CI with it against 53.6 min without (benchmarks/HISTORY.md),
    the pool's spares started again at every switch between a warm and a cold module and after
    every run that took some, beside the tests on 2 cores."""
    if not {"ray_nodes", "ray_cluster"} & set(request.fixturenames):
        yield
        return
    request.getfixturevalue("ray_nodes")
    from raytrain_sys.control.spares import start_pool, stop_pool

    warm = request.node.get_closest_marker("warm_workers")
    if warm is not None and (warm.kwargs.get("needed") or os.environ.get("RTS_TESTS_WARM_WORKERS") == "1"):
        start_pool(1, home=True)
    else:
        stop_pool()
    yield
    _wait_until_idle(request.node.nodeid)


def _wait_until_idle(after: str, timeout_s: float = 30.0) -> None:
    import time

    import ray

    from tests.helpers import live_actors_and_groups

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        total = ray.cluster_resources().get("CPU", 0)
        free = ray.available_resources().get("CPU", 0)
        if free >= total:
            _IDLE_WAIT[0] += time.monotonic() - t0
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    live_actors, live_groups = live_actors_and_groups()
    actors = [f"{a['ActorClassName']} {a['Name'] or a['ActorID'][:8]} ({a['State']}, job {a['JobID']})"
              for a in live_actors]
    groups = [f"{g['name'] or g['placement_group_id'][:8]} ({g['state']})" for g in live_groups]
    pytest.fail(f"after {after}: {total - free:g} of {total:g} CPUs still held {timeout_s:g} s later; "
                f"actors: {actors or 'none'}; placement groups: {groups or 'none'}", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _close_rank_pools():
    """The parallelism tests' pools of gloo ranks live for one module: idle ranks still cost a
    slice of a core each, which the rest of the session should not pay."""
    yield
    from tests import parallel_harness

    parallel_harness.close_pools()


def pytest_collection_modifyitems(config, items):
    """Mark slow the tests listed in tests/long_tests.txt (a node id, or the start of one): the
    long ones that FAST=1 leaves out beside those marked slow in their files."""
    path = os.path.join(os.path.dirname(__file__), "long_tests.txt")
    with open(path) as f:
        long_ids = tuple(line.strip() for line in f if line.strip() and not line.startswith("#"))
    for item in items:
        if item.nodeid.startswith(long_ids):
            item.add_marker(pytest.mark.slow)


# ------------------------------------------------------------------ where the suite's time goes
# Each file's setup, call and teardown time, summed: the slowest files are printed after the
# run (``--durations`` lists tests; the suite's budget is spent by files, each with its fixtures).
_FILE_SECONDS: dict[str, float] = {}
_IDLE_WAIT = [0.0]  # seconds the tests' teardowns waited for the session cluster's CPUs to be free
SLOWEST_FILES = 30


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section(f"slowest files (of {total / 60:.1f} min in tests, fixtures included; "
                             f"{_IDLE_WAIT[0]:.0f} s of it waiting for an idle cluster after a test)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
