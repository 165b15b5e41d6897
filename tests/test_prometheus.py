"""A real Prometheus scraping a real Ray cluster's metrics agents: our series carry what
summary.json says, and every panel of the Grafana dashboard (monitoring/) has data.

One private ``ray start --head`` (two CPUs, agents reporting every second) and one Prometheus
(the Debian package; ``scripts/install.sh dev``) on 127.0.0.1, configured from
``monitoring/prometheus.yml`` with only the discovery file's path and the intervals changed. A
driver process runs a short job on that cluster (a worker killed part-way, so failures and a
recovery are recorded; a price, so cost is; a peak, so MFU is), then one pass of a job service's
reconciler over a store with a waiting job, and stays up until its last values are exported.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.fixtures.ray_head import _free_ports, start_ray_head

# A head of its own and a Prometheus: about a minute and a half on a busy two-core machine.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB = "promtest"
STEPS = 24
KILL_AT = 10  # a worker is killed after this step is committed

DRIVER = textwrap.dedent("""
    import json, os, signal, sys, time
    from raytrain_sys.control.supervisor import Supervisor
    from raytrain_sys.service.teams import Team
    from raytrain_sys.service.reconciler import Reconciler, ReconcilerConfig
    from raytrain_sys.service.store import Store
    from raytrain_sys.spec import from_dict

    raw, kill_at, work = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    killed = []

    def on_step(report):
        if report.step >= kill_at and not killed:
            killed.append(sup.group.workers[1].slot)
            os.kill(sup.group.workers[1].info["pid"], signal.SIGKILL)

    sup = Supervisor(from_dict(raw), on_step=on_step)
    started = time.time()
    result = sup.run()
    # The same job, shorter, with tracking.metrics off: it must add no series.
    quiet = {**raw, "name": raw["name"] + "-off", "tracking": {"enabled": False, "metrics": False},
             "train": {**raw["train"], "max_steps": 4}, "optim": {"warmup_steps": 2}}
    off = Supervisor(from_dict(quiet)).run()
    # A job service's pass: one team, one job waiting (the service has no workers to give).
    store = Store.open("sqlite:///" + os.path.join(work, "service.db"))
    store.add_team(Team("research", nominal_workers=2))
    store.submit(team="research", name="waits", spec="{}", min_workers=1, actor="test")
    reconciler = Reconciler(store, ReconcilerConfig(log_dir=work, spare_runners=0), cluster_workers=lambda: 0)
    reconciler.run_once()
    reconciler.run_once()  # the waiting-jobs gauge counts the reasons the pass before wrote
    time.sleep(4.0)  # two report intervals: the last values reach the agent before this process ends
    print(json.dumps({"run_dir": result.run_dir, "status": result.status, "started": started,
                      "off": [off.status, off.committed_steps]}))
""")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def observed(tmp_path_factory, tiny_dataset):
    """(prometheus URL, the run's summary, the run's time window)."""
    if shutil.which("prometheus") is None:
        pytest.fail("the prometheus binary is not on PATH: `scripts/install.sh dev` installs it "
                    "(Debian package prometheus)", pytrace=False)
    work = tmp_path_factory.mktemp("prom")
    env = {"RAY_metrics_report_interval_ms": "1000", "PYTHONPATH": str(ROOT)}
    with start_ray_head(auth="disabled", num_cpus=2, extra_env=env) as head:
        config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        discovery = os.path.join(head.temp_dir, "prom_metrics_service_discovery.json")
        config["scrape_configs"][0]["file_sd_configs"] = [{"files": [discovery], "refresh_interval": "1s"}]
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_ports(1)[0]
        url = f"http://127.0.0.1:{port}"
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        try:
            raw = {"name": JOB, "output_dir": str(work / "runs"),
                   "model": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
                   "data": {"path": tiny_dataset, "shuffle_window": 256},
                   "train": {"max_steps": STEPS, "global_batch_size": 8, "log_every_steps": 4, "steps_per_call": 1},
                   "checkpoint": {"every_steps": 8},
                   "elastic": {"hang_floor_s": 4.0},
                   "tracking": {"enabled": False},
                   "resources": {"num_workers": 2, "ray_address": head.address, "cost_per_worker_hour": 2.0,
                                 "peak_tflops_per_worker": 0.001}}
            out = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(raw), str(KILL_AT), str(work)],
                                 env=head.client_env(env), capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-4000:]
            ran = json.loads(out.stdout.strip().splitlines()[-1])
            assert ran["status"] == "finished" and ran["off"] == ["finished", 4]
            summary = json.loads((Path(ran["run_dir"]) / "summary.json").read_text())
            # Wait for the scrape of the last values (the final committed step).
            deadline = time.monotonic() + 30
            query = f'last_over_time(ray_raytrain_committed_step{{job="{JOB}"}}[10m])'
            while time.monotonic() < deadline:
                found = _query(url, query)
                if found and max(found.values()) == summary["committed_steps"]:
                    break
                time.sleep(1.0)
            yield url, summary, (ran["started"], time.time())
        finally:
            prom.terminate()
            prom.wait(timeout=30)


def _query(url: str, promql: str) -> dict[tuple, float]:
    """Instant query: labels (as a sorted tuple) -> value."""
    body = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert body["status"] == "success", body
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in body["data"]["result"]}


def _one(url: str, promql: str) -> float:
    found = _query(url, promql)
    assert len(found) == 1, f"{promql}: {found}"
    return next(iter(found.values()))


def test_prometheus_holds_what_summary_json_records(observed):
    url, summary, _ = observed
    sel = f'job="{JOB}", team="-"'
    last = lambda name: _one(url, f"max(last_over_time({name}{{{sel}}}[10m]))")  # noqa: E731
    assert summary["failures"] == 1 and summary["committed_steps"] == STEPS
    assert last("ray_raytrain_committed_step") == STEPS
    # Every commit counted once (the recovery was in memory: nothing redone).
    assert last("ray_raytrain_committed_steps_total") == STEPS + summary["steps_redone"]
    assert last("ray_raytrain_loss") == pytest.approx(summary["losses"][-1], rel=1e-9)
    assert last("ray_raytrain_world_size") == summary["world_sizes"][-1]
    assert last("ray_raytrain_failures_total") == summary["failures"]
    kinds = _query(url, f"last_over_time(ray_raytrain_failures_total{{{sel}}}[10m])")
    assert {dict(k)["kind"] for k in kinds} == {"worker_lost"}
    assert last("ray_raytrain_recoveries_total") == 1
    rebuilt = [t for t in summary["transitions"] if t["state"] == "rebuilding"]
    back = next(t for t in summary["transitions"] if t["time"] > rebuilt[0]["time"] and t["state"] == "running")
    assert last("ray_raytrain_recovery_seconds_total") == pytest.approx(back["time"] - rebuilt[0]["time"], abs=0.01)
    assert last("ray_raytrain_checkpoints_total") == len(summary["checkpoints"])
    assert last("ray_raytrain_cost_usd") == pytest.approx(summary["cost"]["usd"], rel=1e-9)
    assert last("ray_raytrain_goodput_cost_usd_per_million_tokens") == pytest.approx(
        summary["cost"]["goodput_usd_per_million_tokens"], rel=1e-9)
    assert 0 < last("ray_raytrain_mfu_ratio")
    # The data plane read at least every row trained.
    assert last("ray_raytrain_data_rows_read_total") >= summary["samples_consumed"]
    # Per-rank series: every rank of the final world (and none beyond the largest), with its node.
    ranks = {dict(k)["rank"] for k in _query(url, f"last_over_time(ray_raytrain_rank_compute_seconds{{{sel}}}[10m])")}
    final, largest = summary["world_sizes"][-1], max(summary["world_sizes"])
    assert {str(r) for r in range(final)} <= ranks <= {str(r) for r in range(largest)}
    nodes = _query(url, f"last_over_time(ray_raytrain_rank_compute_seconds{{{sel}}}[10m])")
    assert all(dict(k)["node"] for k in nodes)
    # The job service's pass: team research, one job waiting, none of its quota used.
    service = {name: _one(url, f'max(last_over_time({name}{{team="research"}}[10m]))')
               for name in ("ray_raytrain_service_queued_jobs", "ray_raytrain_service_quota_used_workers",
                            "ray_raytrain_service_quota_nominal_workers")}
    assert service == {"ray_raytrain_service_queued_jobs": 1, "ray_raytrain_service_quota_used_workers": 0,
                       "ray_raytrain_service_quota_nominal_workers": 2}
    # Why it waits, as a label: the cause (a WaitCause value), never the sentence.
    waiting = _query(url, 'last_over_time(ray_raytrain_service_waiting_jobs{team="research"}[10m])')
    assert {dict(k)["cause"]: v for k, v in waiting.items()} == {"never_fits": 1.0}


def test_a_run_with_metrics_off_adds_no_series(observed):
    """tracking.metrics: false (the driver ran that job, 4 steps, after the observed one)."""
    url, _, _ = observed
    assert _query(url, f'count by (__name__) (last_over_time({{job="{JOB}-off"}}[10m]))') == {}
    assert _query(url, f'count(last_over_time({{job="{JOB}"}}[10m]))')  # the query finds the other


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "monitoring" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def test_every_dashboard_panel_has_data(observed):
    """Each panel's PromQL, with the template variables set as a user would (this job, every
    team), run as Grafana runs it: a range query over the run."""
    url, _, (start, end) = observed
    queries = _dashboard_queries()
    assert len(queries) >= 25
    dead = []
    for title, expr in queries:
        promql = (expr.replace("$job", JOB).replace("$team", ".*")
                  .replace("$__rate_interval", "10s").replace("$__range", "10m"))
        body = _get(f"{url}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": promql, "start": start, "end": end + 5, "step": "1"}))
        assert body["status"] == "success", (title, promql, body)
        values = [float(v) for r in body["data"]["result"] for _, v in r["values"]]
        if not any(math.isfinite(v) for v in values):
            dead.append(f"{title}: {promql}")
    assert not dead, "panels without data:\n" + "\n".join(dead)
