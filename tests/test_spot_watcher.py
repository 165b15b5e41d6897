"""The spot watcher: polling logic against the stand-in IMDS, and end to end on a real cluster.

Only loopback addresses are contacted: every watcher here gets ``--imds-url`` /
``ImdsClient(url)`` of the stand-in on 127.0.0.1 (and the subprocesses also get
``RAYTRAIN_SYS_IMDS_URL``), so the default 169.254.169.254 is never used.

The end-to-end test runs its Ray ``Cluster`` in a subprocess (``python -m
tests.test_spot_watcher holder``), for the same reason as tests/test_drain.py: one Ray cluster
per process, and the pytest process may hold the session cluster. The stand-in IMDS stays in
the pytest process; the holder starts the watcher as its own subprocess, says READY, and
reports when (and how) its node starts draining.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import pytest

from raytrain_sys.control import spot_watcher as sw
from tests.child_cluster import REPO, SCRUBBED_ENV



class FakeDrain:
    def __init__(self, results=None):
        self.calls = []
        self.results = list(results or [])

    def __call__(self, notice):
        self.calls.append(notice)
        if self.results:
            r = self.results.pop(0)
            if isinstance(r, Exception):
                raise r
            return r
        return True


def make_watcher(url, drain=None, **kw):
    drain = drain or FakeDrain()
    return sw.SpotWatcher(sw.ImdsClient(url, timeout_s=2.0), drain, poll_interval_s=1.0, **kw), \
        drain


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the stand-in
def test_stand_in_speaks_imdsv2(imds_server):
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = imds_server.url + sw.INSTANCE_ACTION_PATH
    with pytest.raises(urllib.error.HTTPError) as e:  # no token
        opener.open(url, timeout=2)
    assert e.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as e:  # PUT without TTL
        opener.open(urllib.request.Request(imds_server.url + sw.TOKEN_PATH, method="PUT"),
                    timeout=2)
    assert e.value.code == 400
    token = opener.open(urllib.request.Request(
        imds_server.url + sw.TOKEN_PATH, method="PUT",
        headers={sw.TOKEN_TTL_HEADER: "21600"}), timeout=2).read().decode()
    with pytest.raises(urllib.error.HTTPError) as e:
        opener.open(urllib.request.Request(url, headers={sw.TOKEN_HEADER: token}), timeout=2)
    assert e.value.code == 404
    at = imds_server.announce(in_s=120)
    body = json.loads(opener.open(urllib.request.Request(
        url, headers={sw.TOKEN_HEADER: token}), timeout=2).read())
    assert body == {"action": "terminate", "time": at.strftime("%Y-%m-%dT%H:%M:%SZ")}


# --------------------------------------------------------------------------- polling logic
def test_no_notice_means_no_action(imds_server):
    watcher, drain = make_watcher(imds_server.url)
    for _ in range(3):
        assert watcher.poll_once() == sw.NO_NOTICE
    assert drain.calls == []
    assert imds_server.count("PUT", sw.TOKEN_PATH, 200) == 1  # the token is reused
    assert imds_server.count("GET", sw.INSTANCE_ACTION_PATH, 404) == 3
    assert imds_server.count(status=401) == 0


def test_expired_token_is_refetched_on_401(imds_server):
    watcher, drain = make_watcher(imds_server.url)
    assert watcher.poll_once() == sw.NO_NOTICE
    imds_server.expire_tokens()
    assert watcher.poll_once() == sw.NO_NOTICE  # 401 -> new token -> 404, in one poll
    assert imds_server.count("GET", sw.INSTANCE_ACTION_PATH, 401) == 1
    assert imds_server.count("PUT", sw.TOKEN_PATH, 200) == 2
    imds_server.expire_tokens()
    at = imds_server.announce(in_s=90)
    assert watcher.poll_once() == sw.DRAINED  # the 401 path also delivers a notice
    assert drain.calls[0].deadline_unix_s == at.timestamp()


def test_token_refreshed_before_it_expires(imds_server):
    now = [0.0]
    client = sw.ImdsClient(imds_server.url, token_ttl_s=600, clock=lambda: now[0])
    watcher = sw.SpotWatcher(client, FakeDrain())
    watcher.poll_once()
    now[0] = 500.0  # inside the TTL minus the 60 s margin
    watcher.poll_once()
    assert client.token_fetches == 1
    now[0] = 541.0  # past TTL - 60 s
    watcher.poll_once()
    assert client.token_fetches == 2
    assert imds_server.count(status=401) == 0


def test_notice_drains_once(imds_server):
    watcher, drain = make_watcher(imds_server.url)
    assert watcher.poll_once() == sw.NO_NOTICE
    at = imds_server.announce(in_s=120)
    assert watcher.poll_once() == sw.DRAINED
    for _ in range(3):
        assert watcher.poll_once() == sw.ALREADY_HANDLED
    assert len(drain.calls) == 1 and watcher.drains == 1
    notice = drain.calls[0]
    assert notice.action == "terminate"
    assert notice.deadline_unix_s == at.timestamp()
    assert 100 < notice.deadline_unix_s - time.time() <= 120


def test_new_notice_time_drains_again(imds_server):
    watcher, drain = make_watcher(imds_server.url)
    first = imds_server.announce(in_s=120)
    assert watcher.poll_once() == sw.DRAINED
    second = imds_server.announce(in_s=60, action="stop")
    assert watcher.poll_once() == sw.DRAINED
    assert [c.deadline_unix_s for c in drain.calls] == [first.timestamp(), second.timestamp()]
    assert drain.calls[1].action == "stop"


def test_failed_drain_is_retried_until_accepted(imds_server):
    drain = FakeDrain([RuntimeError("GCS unreachable"), False, True])
    watcher, _ = make_watcher(imds_server.url, drain)
    imds_server.announce(in_s=120)
    assert watcher.poll_once() == sw.DRAIN_FAILED  # exception
    assert watcher.poll_once() == sw.DRAIN_FAILED  # rejected
    assert watcher.poll_once() == sw.DRAINED
    assert watcher.poll_once() == sw.ALREADY_HANDLED
    assert len(drain.calls) == 3 and watcher.drains == 1


def test_unreachable_imds_backs_off_and_never_raises(imds_server):
    # Nothing listens on this port: connection refused.
    watcher, drain = make_watcher(f"http://127.0.0.1:{free_port()}", max_backoff_s=8.0)
    delays = []
    for _ in range(5):
        assert watcher.poll_once() == sw.IMDS_UNAVAILABLE
        delays.append(watcher.next_delay())
    assert delays == [2.0, 4.0, 8.0, 8.0, 8.0]

    # A service that drops connections, then answers 500s, then recovers.
    watcher, drain = make_watcher(imds_server.url, max_backoff_s=8.0)
    imds_server.set_down(True)
    assert watcher.poll_once() == sw.IMDS_UNAVAILABLE
    imds_server.set_down(False)
    imds_server.fail_next(1, 500)  # the token PUT fails
    assert watcher.poll_once() == sw.IMDS_UNAVAILABLE
    assert watcher.next_delay() == 4.0
    imds_server.announce(in_s=120)
    assert watcher.poll_once() == sw.DRAINED
    assert watcher.next_delay() == 1.0  # back to the poll interval
    assert len(drain.calls) == 1


def test_bad_notice_is_logged_not_fatal(imds_server):
    watcher, drain = make_watcher(imds_server.url)
    with imds_server._lock:
        imds_server._notice = {"action": "terminate", "time": "not a time"}
    assert watcher.poll_once() == sw.BAD_NOTICE
    assert drain.calls == []


def test_parse_notice_formats():
    n = sw.parse_notice(b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}')
    assert n.deadline_unix_s == 1505722920.0 and n.action == "terminate"
    assert sw.parse_notice('{"action":"stop","time":"2017-09-18T08:22:00+00:00"}') \
        .deadline_unix_s == 1505722920.0
    assert sw.parse_notice('{"action":"stop","time":"2017-09-18T08:22:00"}') \
        .deadline_unix_s == 1505722920.0  # naive means UTC
    with pytest.raises(ValueError):
        sw.parse_notice(b"[]")


def test_run_loop_stops_and_uses_the_poll_interval(imds_server):
    watcher, drain = make_watcher(imds_server.url)
    watcher.poll_interval_s = 0.05
    stop = threading.Event()
    th = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    th.start()
    time.sleep(0.3)
    imds_server.announce(in_s=120)
    time.sleep(0.3)
    stop.set()
    th.join(timeout=5)
    assert not th.is_alive()
    assert len(drain.calls) == 1
    assert imds_server.count("GET", sw.INSTANCE_ACTION_PATH) >= 6


def test_default_imds_url_and_overrides(monkeypatch):
    # Parsing only: nothing is contacted.
    monkeypatch.delenv(sw.IMDS_URL_ENV, raising=False)
    assert sw.build_parser().parse_args([]).imds_url == "http://169.254.169.254"
    monkeypatch.setenv(sw.IMDS_URL_ENV, "http://127.0.0.1:9")
    assert sw.build_parser().parse_args([]).imds_url == "http://127.0.0.1:9"
    assert sw.build_parser().parse_args(["--imds-url", "http://127.0.0.1:8"]).imds_url == \
        "http://127.0.0.1:8"


def test_node_discovery_refuses_ambiguity(monkeypatch):
    from raytrain_sys.control import drain

    a, b = "aa" * 28, "bb" * 28
    found = {"10.0.0.5": [drain.NodeInfo(a, True, False, "10.0.0.5")],
             "10.0.0.6": [drain.NodeInfo(a, True, True, "10.0.0.6"),
                          drain.NodeInfo(b, True, False, "10.0.0.6")]}
    monkeypatch.setattr(drain, "nodes_on_ip", lambda ip, addr=None, timeout_s=10: found.get(ip, []))
    monkeypatch.setattr(drain, "alive_nodes", lambda addr=None, timeout_s=10: {a: None})
    assert sw.NodeDrainer("gcs:1", node_ip="10.0.0.5").resolve() == a
    with pytest.raises(LookupError, match="pass --node-id"):
        sw.NodeDrainer("gcs:1", node_ip="10.0.0.6").resolve()
    with pytest.raises(LookupError, match="no alive Ray node"):
        sw.NodeDrainer("gcs:1", node_ip="10.0.0.7").resolve()
    assert sw.NodeDrainer("gcs:1", node_id=b, node_ip="10.0.0.6").resolve() == b


# --------------------------------------------------------------------------- GCE
def gce_watcher(url, drain=None, wait_s=2.0, now=None, **kw):
    drain = drain or FakeDrain()
    client = sw.GceMetadataClient(url, timeout_s=2.0, wait_s=wait_s,
                                  **({"clock": now} if now else {}))
    return sw.SpotWatcher(client, drain, poll_interval_s=0.05, **kw), drain


def test_gce_stand_in_speaks_the_metadata_protocol(gce_metadata_server):
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = gce_metadata_server.url + sw.GCE_PREEMPTED_PATH
    with pytest.raises(urllib.error.HTTPError) as e:  # no Metadata-Flavor header
        opener.open(url, timeout=2)
    assert e.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as e:  # a proxied request
        opener.open(urllib.request.Request(url, headers={"Metadata-Flavor": "Google",
                                                         "X-Forwarded-For": "10.0.0.1"}), timeout=2)
    assert e.value.code == 403
    resp = opener.open(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"}), timeout=2)
    assert resp.read() == b"FALSE" and resp.headers["Metadata-Flavor"] == "Google"
    etag = resp.headers["ETag"]
    t0 = time.monotonic()  # same etag: the answer waits for a change (here: the 1 s timeout)
    resp = opener.open(urllib.request.Request(
        url + f"?wait_for_change=true&timeout_sec=1&last_etag={etag}",
        headers={"Metadata-Flavor": "Google"}), timeout=5)
    assert resp.read() == b"FALSE" and 0.9 < time.monotonic() - t0 < 3


def test_gce_notice_drains_once_with_a_30_s_deadline(gce_metadata_server):
    now = [1000.0]
    watcher, drain = gce_watcher(gce_metadata_server.url, wait_s=0.0, now=lambda: now[0])
    assert watcher.poll_once() == sw.NO_NOTICE
    gce_metadata_server.preempt()
    assert watcher.poll_once() == sw.DRAINED
    now[0] = 1007.0  # later polls see the same notice, not a new one
    assert watcher.poll_once() == sw.ALREADY_HANDLED
    assert len(drain.calls) == 1
    assert drain.calls[0].deadline_unix_s == 1000.0 + sw.GCE_NOTICE_S == 1030.0
    assert drain.calls[0].action == "preempt"


def test_gce_long_poll_sees_the_notice_at_once(gce_metadata_server):
    """A poll waiting on the server (wait_for_change) returns the moment the notice is posted,
    not at the next poll: the VM has 30 s, and a 5 s poll would spend a sixth of them."""
    watcher, drain = gce_watcher(gce_metadata_server.url, wait_s=8.0)
    assert watcher.poll_once() == sw.NO_NOTICE  # the first answer gives the etag
    outcome = []
    th = threading.Thread(target=lambda: outcome.append(watcher.poll_once()), daemon=True)
    th.start()
    time.sleep(0.5)
    assert th.is_alive()  # waiting on the server
    t_preempt = gce_metadata_server.preempt()
    th.join(timeout=5)
    assert outcome == [sw.DRAINED]
    assert time.time() - t_preempt < 2.0
    assert abs(drain.calls[0].deadline_unix_s - (t_preempt + sw.GCE_NOTICE_S)) < 2.0


def test_gce_answers_that_are_not_the_metadata_server_are_unavailable(gce_metadata_server):
    watcher, drain = gce_watcher(gce_metadata_server.url, wait_s=0.0, max_backoff_s=4.0)
    gce_metadata_server.no_flavor(True)  # e.g. a proxy answering for it
    gce_metadata_server.preempt()
    assert watcher.poll_once() == sw.IMDS_UNAVAILABLE
    gce_metadata_server.no_flavor(False)
    gce_metadata_server.fail_next(1, 503)
    assert watcher.poll_once() == sw.IMDS_UNAVAILABLE
    gce_metadata_server.set_down(True)
    assert watcher.poll_once() == sw.IMDS_UNAVAILABLE
    assert watcher.next_delay() == 0.05 * 8  # backing off: three failures in a row
    gce_metadata_server.set_down(False)
    assert watcher.poll_once() == sw.DRAINED
    assert len(drain.calls) == 1


def test_gce_cli_once(gce_metadata_server):
    cmd = [sys.executable, "-m", "raytrain_sys.control.spot_watcher", "--provider", "gce",
           "--imds-url", gce_metadata_server.url, "--once"]
    once = subprocess.run(cmd, env=_cli_env(gce_metadata_server.url), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr
    assert once.stdout.strip() == sw.NO_NOTICE
    assert gce_metadata_server.count(200) == 1


# --------------------------------------------------------------------------- the CLI
def _cli_env(imds_url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env[sw.IMDS_URL_ENV] = imds_url  # belt and braces: never the link-local default
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_cli_once_and_lock_file(imds_server, tmp_path):
    cmd = [sys.executable, "-m", "raytrain_sys.control.spot_watcher", "--imds-url",
           imds_server.url]
    once = subprocess.run(cmd + ["--once"], env=_cli_env(imds_server.url), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr
    assert once.stdout.strip() == sw.NO_NOTICE

    lock = str(tmp_path / "watcher.lock")
    first = subprocess.Popen(cmd + ["--lock-file", lock, "--node-id", "ab" * 28,
                                    "--poll-interval-s", "0.2"],
                             env=_cli_env(imds_server.url), cwd=REPO,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: imds_server.count("GET", sw.INSTANCE_ACTION_PATH) >= 2, 30)
        second = subprocess.run(cmd + ["--lock-file", lock], env=_cli_env(imds_server.url),
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert second.returncode == 0 and "already_running" in second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=30)
    assert first.returncode == 0, err
    assert "event=stopped drains=0" in err


def _wait(pred, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return False


# --------------------------------------------------------------------------- end to end
@pytest.mark.timeout(300)
def test_watcher_drains_its_node_on_a_spot_notice(imds_server):
    env = _cli_env(imds_server.url)
    ray_tmp = tempfile.mkdtemp(prefix="rtsx-", dir="/tmp")
    os.makedirs(os.path.join(ray_tmp, "ray"))
    env["RAY_TMPDIR"] = ray_tmp
    env.setdefault("RAY_DEDUP_LOGS", "0")
    holder = subprocess.Popen([sys.executable, "-m", "tests.test_spot_watcher", "holder",
                               imds_server.url], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in holder.stdout], daemon=True).start()
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(holder.stderr), daemon=True).start()
    try:
        ready = _read_tagged(lines, "READY ", 180, holder, stderr)
        # No notice yet: the watcher polls and does nothing.
        assert _wait(lambda: imds_server.count("GET", sw.INSTANCE_ACTION_PATH, 404) >= 2, 30)
        at = imds_server.announce(in_s=60)
        t_announce = time.time()
        result = _read_tagged(lines, "RESULT ", 120, holder, stderr)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(json.dumps({"ready": ready, "result": result,
                      "seen_after_announce_s": result["seen_unix_s"] - t_announce}, indent=1))
    assert holder.returncode == 0, "".join(stderr)[-5000:]
    assert result["node_id"] == ready["node_id"]
    assert result["reason"] == "PREEMPTION"
    assert abs(result["deadline_unix_s"] - at.timestamp()) <= 1.0
    # Poll interval 0.5 s: about 1 s on a quiet machine; generous for a loaded CI box.
    assert result["seen_unix_s"] - t_announce < 8.0
    assert result["watcher_alive_after_drain"]
    assert result["drain_requested_lines"] == 1  # one drain per notice
    assert result["watcher_rc"] == 0
    # The watcher kept polling after the drain (and saw the same notice again).
    assert imds_server.count("GET", sw.INSTANCE_ACTION_PATH, 200) >= 2


def _read_tagged(lines, tag, timeout_s, proc, stderr) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                break
            continue
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    raise AssertionError(f"no {tag.strip()} from the holder; stderr:\n{''.join(stderr)[-5000:]}")


def _holder(imds_url: str) -> int:
    """Child: a 0-CPU head and one 1-CPU worker node with a busy actor (an idle node would
    exit at once when drained), a watcher for the worker, and a report of its drain."""
    import urllib.parse

    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_sys.control import drain

    assert urllib.parse.urlparse(imds_url).hostname.startswith("127."), imds_url
    temp_dir = tempfile.mkdtemp(prefix="rtsw-", dir="/tmp")
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 0, "temp_dir": temp_dir,
                                      "include_dashboard": False})
    watcher = None
    log_path = os.path.join(temp_dir, "watcher.log")
    try:
        worker = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()

        @ray.remote(num_cpus=1)
        class Busy:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        busy = Busy.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            worker.node_id, soft=False)).remote()
        assert ray.get(busy.node.remote()) == worker.node_id
        with open(log_path, "w") as log_file:
            watcher = subprocess.Popen(
                [sys.executable, "-m", "raytrain_sys.control.spot_watcher",
                 "--imds-url", imds_url, "--node-id", worker.node_id,
                 "--gcs-address", cluster.gcs_address, "--poll-interval-s", "0.5"],
                stdout=log_file, stderr=subprocess.STDOUT)
        print("READY " + json.dumps({"node_id": worker.node_id, "gcs": cluster.gcs_address}),
              flush=True)
        seen = None
        deadline = time.time() + 90
        while time.time() < deadline and seen is None:
            info = drain.draining_nodes().get(worker.node_id)
            if info is not None:
                seen = (time.time(), info)
            else:
                time.sleep(0.05)
        if seen is None:
            raise AssertionError("the worker node never started draining:\n" +
                                 open(log_path).read())
        time.sleep(2.0)  # the watcher keeps polling and must not drain again
        alive = watcher.poll() is None
        watcher.send_signal(signal.SIGTERM)
        watcher_rc = watcher.wait(timeout=30)
        log_text = open(log_path).read()
        sys.stderr.write(log_text)
        t_seen, info = seen
        print("RESULT " + json.dumps({
            "node_id": worker.node_id, "seen_unix_s": t_seen, "reason": info.reason,
            "reason_source": info.reason_source, "deadline_unix_s": info.deadline_unix_s,
            "message": info.message, "watcher_alive_after_drain": alive,
            "watcher_rc": watcher_rc,
            "drain_requested_lines": log_text.count("event=drain_requested"),
        }), flush=True)
        return 0
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "holder":
        try:
            sys.exit(_holder(sys.argv[2]))
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    sys.exit(f"usage: python -m tests.test_spot_watcher holder IMDS_URL (got {sys.argv[1:]})")
