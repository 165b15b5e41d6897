"""Node drains on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``).

The cluster runs in a SUBPROCESS (this module, ``python -m tests.test_drain child``): a process
can be connected to one Ray cluster only, and the pytest process may already hold the session
``ray_cluster``. The child gets a scrubbed environment (no RAY_ADDRESS / RAY_AUTH_*) and its own
RAY_TMPDIR, so it neither joins nor re-points anybody else's cluster (``Cluster`` writes
``<RAY_TMPDIR>/ray/ray_current_cluster``). It prints one ``RESULT {json}`` line that the test
asserts on.

Health checks are sped up in the child (a SIGKILLed node is declared dead in about 2-3 s
instead of Ray's default of up to about 20 s); nothing else is tuned.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from raytrain_sys.control import drain
from tests.child_cluster import REPO, child_env, parse_result, print_result
from tests.ft_common import wait_until

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                      "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


# --------------------------------------------------------------------------- helpers
def wait_for(pred, timeout_s: float, interval_s: float = 0.02):
    return wait_until(pred, timeout_s, interval_s) or None


# --------------------------------------------------------------------------- unit tests
def test_node_id_validation():
    nid = "ab" * 28
    assert drain.normalize_node_id(nid.upper()) == nid
    assert drain.normalize_node_id(bytes.fromhex(nid)) == nid  # bytes would drain NOTHING in Ray
    for bad in ("", "xyz", "ab" * 27, "f" * 56):
        with pytest.raises(drain.DrainError):
            drain.normalize_node_id(bad)


def test_reason_validation():
    from ray.core.generated import autoscaler_pb2

    assert drain._reason_value("PREEMPTION") == autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION == 2
    assert drain._reason_value("idle_termination") == \
        autoscaler_pb2.DRAIN_NODE_REASON_IDLE_TERMINATION == 1
    assert drain._reason_value("DRAIN_NODE_REASON_PREEMPTION") == 2
    with pytest.raises(drain.DrainError):
        drain._reason_value("UNSPECIFIED")


def test_drain_info_seconds_left():
    info = drain.DrainInfo("PREEMPTION", 1000.0)
    assert info.seconds_left(now=970.0) == 30.0
    assert drain.DrainInfo("PREEMPTION", None).seconds_left() is None


# --------------------------------------------------------------------------- cluster test
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_drains_on_multinode_cluster():
    env, ray_tmp = child_env()
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.test_drain", "child"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=360)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    r = parse_result(proc.stdout)
    print(json.dumps(r, indent=1))
    print(f"child wall time {time.time() - t0:.1f}s")

    # Helpers see the cluster without the dashboard.
    assert r["node_of_actor_ok"]
    assert r["alive_before"] == 6 and r["heads"] == 1

    # 1. Our PREEMPTION drain, deadline 30 s ahead: accepted, visible, right reason/deadline.
    d1 = r["drain_ours"]
    assert d1["accepted"] is True
    assert d1["reason"] == "PREEMPTION" and d1["reason_source"] == "recorded"
    assert abs(d1["deadline_unix_s"] - d1["expected_deadline_unix_s"]) < 0.01
    assert d1["visible_polls"] == 1  # the first read after the call returns sees it
    assert d1["visible_after_call_start_s"] < 1.0
    assert 29.0 < d1["seconds_left"] <= 30.0

    # 2. A PREEMPTION drain set by someone else (the hidden `ray drain-node` CLI).
    d2 = r["drain_cli"]
    assert d2["cli_rc"] == 0, d2
    assert d2["reason"] == "PREEMPTION" and d2["reason_source"] == "inferred"
    assert abs(d2["deadline_unix_s"] - (d2["cli_start_unix_s"] + 30)) < 5.0
    assert d2["seen_before_cli_exit"]

    # 3. IDLE_TERMINATION: refused on a busy node, refused over a preemption drain,
    #    accepted on an idle node, which then exits at once labelled AUTOSCALER_DRAIN_IDLE.
    assert r["idle_on_busy"] == {"accepted": False, "draining": False,
                                 "message": "The node to be idle terminated is no longer idle."}
    assert r["idle_over_preemption"]["accepted"] is False
    assert r["idle_over_preemption"]["reason_after"] == "PREEMPTION"
    assert r["idle_on_idle"]["accepted"] is True
    assert r["idle_on_idle"]["death_reason"] == drain.DEATH_IDLE
    assert r["idle_on_idle"]["dead_after_s"] < 10.0  # about 0.02 s on a quiet machine

    assert r["drain_dead_node"] is True  # Ray answers "accepted" for a dead node

    # 4. Ray does nothing at the deadline: a busy drained node stays alive and draining.
    past = r["past_deadline"]
    assert past["alive"] and past["draining"] and past["actor_answers"]
    assert past["seconds_left"] < 0
    # ... and when it is then killed (SIGKILL) it is labelled preempted.
    assert past["death_reason"] == drain.DEATH_PREEMPTED and past["preempted"]

    # 5. Drained, then killed BEFORE its deadline: an unexpected termination, not preempted.
    early = r["killed_before_deadline"]
    assert early["death_reason"] == drain.DEATH_UNEXPECTED and not early["preempted"]

    # 6. Drained then removed with cluster.remove_node (graceful): dead, no longer draining,
    #    its actor gone; a graceful stop reads as an expected termination.
    removed = r["removed"]
    assert removed["alive"] is False and removed["draining_listed"] is False
    assert removed["death_reason"] == drain.DEATH_EXPECTED
    assert removed["actor_error"] == "ActorDiedError"
    assert removed["not_in_alive_nodes"]

    # 7. A drained node exits by itself, at once and labelled preempted, when it is idle: its
    #    last actor gone AND its placement group removed (a bundle alone keeps it alive).
    left = r["actor_left"]
    assert left["alive_while_pg_remains"] is True
    assert left["death_reason"] == drain.DEATH_PREEMPTED
    assert left["dead_after_pg_removed_s"] < 10.0  # about 0.02 s on a quiet machine

    # 8. Stale drain records of dead nodes are dropped.
    assert r["records_left"] == []


# --------------------------------------------------------------------------- child
def _child() -> dict:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                PlacementGroupSchedulingStrategy)

    temp_dir = tempfile.mkdtemp(prefix="rtsd-", dir="/tmp")  # Ray socket paths < 107 chars
    out: dict = {}
    t_setup = time.time()
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 0, "temp_dir": temp_dir,
                                      "include_dashboard": False,
                                      "_system_config": FAST_HEALTH_CHECKS})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(5)]
        cluster.wait_for_nodes()
        w_ours, w_cli, w_busy, w_idle, w_early = workers
        gcs = cluster.gcs_address
        out["cluster_start_s"] = time.time() - t_setup

        @ray.remote(num_cpus=1)
        class Pinned:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        def pin(node):
            return Pinned.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node.node_id, soft=False)).remote()

        actors = {w.node_id: pin(w) for w in (w_ours, w_busy, w_early)}
        # w_cli's actor lives in a placement group, as raytrain-sys workers do.
        pg = placement_group([{"CPU": 1}],
                             bundle_label_selector=[{"ray.io/node-id": w_cli.node_id}])
        ray.get(pg.ready(), timeout=60)
        actors[w_cli.node_id] = Pinned.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote()
        ray.get([a.node.remote() for a in actors.values()])
        out["node_of_actor_ok"] = all(drain.node_of_actor(a) == nid for nid, a in actors.items())
        alive = drain.alive_nodes()
        out["alive_before"] = len(alive)
        out["heads"] = sum(n.is_head for n in alive.values())

        def info(node):
            return drain.nodes()[node.node_id]

        def wait_dead(node, timeout_s=30.0):
            t = time.time()
            n = wait_for(lambda: (lambda i: i if not i.alive else None)(info(node)), timeout_s)
            return n, time.time() - t

        # 1. our drain, measured
        t_start = time.time()
        accepted = drain.drain_node(w_ours.node_id, "PREEMPTION", 30.0, "test: preemption")
        t_ret = time.time()
        polls, seen = 0, None
        while time.time() - t_ret < 10:
            polls += 1
            d = drain.draining_nodes()
            if w_ours.node_id in d:
                seen = d[w_ours.node_id]
                break
        t_seen = time.time()
        out["drain_ours"] = {
            "accepted": accepted, "call_s": t_ret - t_start, "visible_polls": polls,
            "visible_after_call_start_s": t_seen - t_start,
            "reason": seen.reason, "reason_source": seen.reason_source,
            "deadline_unix_s": seen.deadline_unix_s, "expected_deadline_unix_s": t_start + 30.0,
            "seconds_left": seen.seconds_left(),
        }
        # Cost of one draining_nodes() read (GCS RPC plus the KV lookup of reasons).
        lat = []
        for _ in range(5):
            t = time.time()
            drain.draining_nodes()
            lat.append(time.time() - t)
        out["draining_nodes_read_s"] = sorted(lat)

        # 2. someone else drains w_cli through the hidden CLI; a thread watches for it.
        hit: dict = {}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                if w_cli.node_id in drain.draining_nodes():
                    hit["t"] = time.time()
                    return
                time.sleep(0.005)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        ray_cli = str(Path(sys.executable).parent / "ray")
        t_cli = time.time()
        cli = subprocess.run([ray_cli, "drain-node", "--address", gcs, "--node-id",
                              w_cli.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                              "--reason-message", "test: by the ray CLI",
                              "--deadline-remaining-seconds", "30"],
                             capture_output=True, text=True, timeout=120)
        t_cli_end = time.time()
        th.join(timeout=10)
        stop.set()
        d = drain.draining_nodes().get(w_cli.node_id)
        out["drain_cli"] = {
            "cli_rc": cli.returncode, "cli_stderr": cli.stderr[-500:],
            "cli_start_unix_s": t_cli, "cli_s": t_cli_end - t_cli,
            "seen_before_cli_exit": "t" in hit and hit["t"] <= t_cli_end + 0.05,
            "seen_s_after_cli_start": hit.get("t", float("nan")) - t_cli,
            "reason": d.reason if d else None, "reason_source": d.reason_source if d else None,
            "deadline_unix_s": d.deadline_unix_s if d else None,
        }

        # 3. IDLE_TERMINATION
        res = drain.drain_node_result(w_busy.node_id, "IDLE_TERMINATION", None, "test: idle")
        out["idle_on_busy"] = {"accepted": res.accepted, "message": res.rejection_message,
                               "draining": w_busy.node_id in drain.draining_nodes()}
        res = drain.drain_node_result(w_cli.node_id, "IDLE_TERMINATION", None, "test: idle")
        after = drain.draining_nodes().get(w_cli.node_id)
        out["idle_over_preemption"] = {"accepted": res.accepted,
                                       "reason_after": after.reason if after else None}
        t = time.time()
        res = drain.drain_node_result(w_idle.node_id, "IDLE_TERMINATION", None, "test: idle")
        dead, _ = wait_dead(w_idle)
        out["idle_on_idle"] = {"accepted": res.accepted, "dead_after_s": time.time() - t,
                               "death_reason": dead.death_reason if dead else None,
                               "death_message": dead.death_message if dead else None}

        # A dead node counts as drained for Ray.
        out["drain_dead_node"] = drain.drain_node(w_idle.node_id, "PREEMPTION", 10.0, "dead")

        # 4. past the deadline
        drain.drain_node(w_busy.node_id, "PREEMPTION", 2.0, "test: short deadline")
        time.sleep(3.0)
        n = info(w_busy)
        answers = ray.get(actors[w_busy.node_id].node.remote(), timeout=10) == w_busy.node_id
        past = {"alive": n.alive, "draining": n.draining, "actor_answers": answers,
                "seconds_left": n.drain.seconds_left() if n.drain else None}
        t = time.time()
        cluster.remove_node(w_busy, allow_graceful=False)
        dead, waited = wait_dead(w_busy)
        past.update({"death_reason": dead.death_reason if dead else None,
                     "death_message": dead.death_message if dead else None,
                     "preempted": bool(dead and dead.preempted), "detected_after_kill_s": waited})
        out["past_deadline"] = past

        # 5. killed before the deadline
        drain.drain_node(w_early.node_id, "PREEMPTION", 60.0, "test: long deadline")
        cluster.remove_node(w_early, allow_graceful=False)
        dead, waited = wait_dead(w_early)
        out["killed_before_deadline"] = {"death_reason": dead.death_reason if dead else None,
                                         "death_message": dead.death_message if dead else None,
                                         "preempted": bool(dead and dead.preempted),
                                         "detected_after_kill_s": waited}

        # 6. drained (30 s, busy) then removed gracefully
        t = time.time()
        cluster.remove_node(w_ours)
        dead, waited = wait_dead(w_ours)
        try:
            ray.get(actors[w_ours.node_id].node.remote(), timeout=30)
            actor_error = None
        except Exception as e:  # noqa: BLE001
            actor_error = type(e).__name__
        out["removed"] = {"alive": dead.alive if dead else True,
                          "death_reason": dead.death_reason if dead else None,
                          "death_message": dead.death_message if dead else None,
                          "dead_visible_after_remove_s": time.time() - t,
                          "draining_listed": w_ours.node_id in drain.draining_nodes(),
                          "not_in_alive_nodes": w_ours.node_id not in drain.alive_nodes(),
                          "actor_error": actor_error}

        # 7. the last actor leaves a drained node; its placement group still holds the node
        ray.kill(actors[w_cli.node_id])
        time.sleep(2.0)
        alive_with_pg = info(w_cli).alive
        t = time.time()
        remove_placement_group(pg)
        dead, _ = wait_dead(w_cli)
        out["actor_left"] = {"alive_while_pg_remains": alive_with_pg,
                             "death_reason": dead.death_reason if dead else None,
                             "death_message": dead.death_message if dead else None,
                             "dead_after_pg_removed_s": time.time() - t}

        drain.STALE_RECORD_S = 0.0
        drain.draining_nodes()  # drops stale records
        client = drain.gcs_client()
        out["records_left"] = [k.decode() for k in client.internal_kv_keys(
            drain.KV_PREFIX, namespace=drain.KV_NAMESPACE)]
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        print_result(_child)
    sys.exit(f"usage: python -m tests.test_drain child (got {sys.argv[1:]})")
