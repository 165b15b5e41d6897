"""The job service's queue and quota gauges, from a scheduler snapshot (pure: no Ray). The run's
series are checked against a real Prometheus in tests/test_prometheus.py."""

from __future__ import annotations

from raytrain_sys.monitor.metrics import team_usage
from raytrain_sys.service.model import JobState
from raytrain_sys.service.scheduler.snapshot import JobView, Snapshot
from raytrain_sys.service.teams import Team


def view(id, team, state, workers=0, target=None, held=False):
    return JobView(id=id, team=team, priority=0, state=state, min_workers=1, max_workers=4,
                   submitted_at_s=0.0, workers=workers,
                   target_workers=workers if target is None else target, held=held)


def test_queue_and_quota_per_team():
    snapshot = Snapshot(
        teams=[Team("a", 2, cohort="c"), Team("b", 4, cohort="c"), Team("idle", 1)],
        jobs=[view(1, "a", JobState.RUNNING, workers=3),  # borrows one of b's
              view(2, "a", JobState.STARTING, target=1),  # admitted: counts as the scheduler counts it
              view(3, "a", JobState.QUEUED),
              view(4, "a", JobState.PAUSED, held=True),  # its team holds it: not waiting for workers
              view(5, "b", JobState.PAUSED),
              view(6, "b", JobState.PAUSING, workers=2, target=0),  # giving its workers back
              view(7, "ghost", JobState.QUEUED)],  # a team deleted since: not reported
        cluster_workers=8)
    assert team_usage(snapshot) == {
        "a": {"queued": 1, "used": 4, "borrowed": 2, "nominal": 2},
        "b": {"queued": 1, "used": 0, "borrowed": 0, "nominal": 4},
        "idle": {"queued": 0, "used": 0, "borrowed": 0, "nominal": 1},
    }


def test_waiting_jobs_per_team_and_cause():
    """The labels of ``raytrain_service_waiting_jobs``: a team and a WaitCause value (never the
    sentence), counting only jobs not running yet whose reason has been written."""
    from raytrain_sys.monitor.metrics import wait_counts
    from raytrain_sys.service.model import JobRecord, WaitCause

    def record(id, team, state, cause=None):
        return JobRecord(id=id, team=team, name="j", spec="{}", priority=0, state=state, held=False, min_workers=1,
                         max_workers=1, elastic=False, workers=0, target_workers=0, restarts=0, mlflow_run_id=None,
                         last_checkpoint_step=None, last_checkpoint_at_s=None, submitted_at_s=0.0,
                         waiting_since_s=0.0, started_at_s=None, updated_at_s=0.0, message="",
                         wait_cause=cause, wait_reason=None if cause is None else f"a sentence for job {id}")

    jobs = [record(1, "a", JobState.QUEUED, WaitCause.TEAM_QUOTA), record(2, "a", JobState.QUEUED, WaitCause.TEAM_QUOTA),
            record(3, "a", JobState.PAUSED, WaitCause.HELD), record(4, "a", JobState.STARTING, WaitCause.PLACEMENT),
            record(5, "b", JobState.RESUMING, WaitCause.RESTORE), record(6, "b", JobState.QUEUED),  # not looked at yet
            record(7, "b", JobState.RUNNING)]
    assert wait_counts(jobs) == {("a", "team_quota"): 2, ("a", "held"): 1, ("a", "placement"): 1,
                                 ("b", "restore"): 1}


NAMES = ["a", "équipe", "チーム", "two\nlines", "tab\there", "\x00nul", "x" * 500, "emoji \U0001f680"]


def test_every_label_value_is_one_rays_exporter_takes():
    """Ray encodes tag values as ASCII and raises on anything else (which turned every team's
    gauges off until a restart): label_value keeps printable ASCII, escapes the rest, keeps
    distinct names distinct, and cuts at LABEL_MAX_CHARS."""
    from raytrain_sys.monitor.metrics import LABEL_MAX_CHARS, label_value

    labels = [label_value(n) for n in NAMES]
    assert labels[0] == "a" and labels[1] == "\\xe9quipe" and labels[3] == "two\\x0alines"
    assert all(v.isascii() and v.isprintable() and len(v) <= LABEL_MAX_CHARS for v in labels)
    assert len(set(labels)) == len(labels)


def test_one_teams_name_cannot_turn_the_services_metrics_off():
    """With Ray's own metrics objects (in a child process: no cluster needed, and none touched):
    a name Ray refuses raw is exported through label_value, and the service's gauges stay on for
    every team, whatever names the snapshot holds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
from ray.util import metrics
from raytrain_sys.monitor.metrics import ServiceMetrics, label_value
from raytrain_sys.service.model import JobState
from raytrain_sys.service.scheduler.snapshot import JobView, Snapshot
from raytrain_sys.service.teams import Team
gauge = metrics.Gauge("raytrain_test_label", "test", tag_keys=("team",))
try:
    gauge.set(1, tags={{"team": "équipe"}})
    print("raw: accepted")
except UnicodeEncodeError:
    print("raw: refused")
for name in {NAMES!r}:
    gauge.set(1, tags={{"team": label_value(name)}})
teams = [Team(name, 1) for name in {NAMES!r}]
jobs = [JobView(id=i, team=t.name, priority=0, state=JobState.QUEUED, min_workers=1, max_workers=1,
                submitted_at_s=0.0) for i, t in enumerate(teams)]
service = ServiceMetrics()
service.observe(Snapshot(teams, jobs, cluster_workers=4))
service.observe(Snapshot(teams, jobs, cluster_workers=4))
service.waiting([])  # the waiting-jobs gauge shares the emitter: its first call must not turn it off
print("service metrics:", "on" if service.enabled and not service._failed_teams else "off")
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["raw: refused", "service metrics: on"], out.stdout + out.stderr[-2000:]
