"""The job service's jobs page, and the ``/v1/progress`` it polls.

The page in a real browser (headless Chromium, the Debian package) against a
real service on the session cluster, its API on 127.0.0.1, and a job held mid-run by a step gate.

What a user would notice: with their team's token the page shows their running job, its state,
its progress in steps, its throughput and a loss chart drawn from the run's live numbers; another
team's token shows none of it; the admin's shows it too; once the job ends the page shows its
final numbers, and the run's plots are in its MLflow run. Without Ray or a browser: ``/v1/progress`` answers a team's token with its own
jobs only, and an ended job's numbers come from its summary.json (a service started after the
run still shows them). A screenshot is kept under the test's tmp dir (and written to
``$JOBS_PAGE_SCREENSHOT`` when set: ``scripts/jobs_page_screenshot.sh`` refreshes the docs' one).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import ray
from mlflow import MlflowClient

from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.errors import ServiceRequestError
from raytrain_sys.monitor.report import progress
from raytrain_sys.service import requests as user_requests
from raytrain_sys.service.api import serve
from raytrain_sys.service.auth import init_admin
from raytrain_sys.service.client import Client
from raytrain_sys.service.model import JobProgress, JobState
from raytrain_sys.service.teams import Team
from raytrain_sys.service.progress import ProgressSource
from raytrain_sys.service.store import Store
from tests.ft_common import ft_spec, wait_until
from tests.helpers import read_summary
from tests.service_common import StepGates, api_answers, free_port, running_service

CHROMIUM = shutil.which("chromium")
STEPS, HELD_AT = 12, 6
WAIT_S = 180.0
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian chromium package (scripts/install.sh dev)")


def chromium(url: str, *, screenshot: str = "") -> str:
    """The page's DOM after its scripts ran (its first poll answered), or a screenshot of it.
    ``--virtual-time-budget`` lets the page's timers and fetches run before the DOM is taken."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--window-size=1280,720",
                *([f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]), url]
        out = subprocess.run(args, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def job_cards(dom: str) -> dict[str, str]:
    """job id -> the HTML of its card on the page."""
    return dict(re.findall(r'<section class="job" data-job-id="(\d+)".*?>(.*?)</section>', dom, re.S))


@needs_chromium
@pytest.mark.slow  # about 90 s here: the service, its warm spares and a job started on the shared cluster
def test_jobs_page_shows_a_running_job_to_its_team_only(ray_cluster, tiny_dataset, tmp_path):
    gates_dir = tmp_path / "gates"
    gates_dir.mkdir()
    gates = StepGates(str(gates_dir))
    db = tmp_path / "svc.db"
    port = free_port()
    spec = ft_spec(tmp_path / "page-demo", tiny_dataset, STEPS).to_dict() | {"name": "page-demo"}
    with running_service(db, gates, serve_api=True, port=port) as svc:
        ray.get([svc.add_team.remote("a", 2), svc.add_team.remote("b", 2)])
        store = Store.open(f"sqlite:///{db}")
        tokens = {"a": store.issue_token("a"), "b": store.issue_token("b"), "admin": init_admin(store)}
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: api_answers(url), 30), f"the service's API did not answer on {url}"
        gates.hold(1, HELD_AT)
        job = ray.get(svc.submit.remote("a", spec))["id"]
        assert wait_until(lambda: gates.reached(job, HELD_AT), WAIT_S), ray.get(svc.job.remote(job))
        assert wait_until(lambda: ray.get(svc.job.remote(job))["state"] == "running", WAIT_S)

        dom = chromium(f"{url}/#token={tokens['a']}")
        card = job_cards(dom)[str(job)]
        assert 'data-team="a"' in dom and "page-demo" in card
        assert 'class="state running"' in card and f"{HELD_AT} / {STEPS} steps" in card
        polyline = re.search(r'<svg[^>]*class="loss-chart".*?<polyline[^>]*points="([^"]+)"', card, re.S)
        assert polyline and len(polyline.group(1).split()) == HELD_AT, "no loss chart of the steps so far"
        assert re.search(r'tokens/s </span><span class="num">[\d,]+</span>', card), "no throughput shown"

        shot = tmp_path / "jobs_page.png"
        chromium(f"{url}/#token={tokens['a']}", screenshot=str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("JOBS_PAGE_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["JOBS_PAGE_SCREENSHOT"])

        other = chromium(f"{url}/#token={tokens['b']}")
        assert job_cards(other) == {} and "page-demo" not in other and "no jobs visible to this token" in other
        assert str(job) in job_cards(chromium(f"{url}/#token={tokens['admin']}"))
        refused = chromium(f"{url}/#token=rts_not-a-token")
        assert "401: invalid or revoked token" in refused and job_cards(refused) == {}

        gates.go(job, HELD_AT)
        assert wait_until(lambda: ray.get(svc.job.remote(job))["state"] == "finished", WAIT_S)
        card = job_cards(chromium(f"{url}/#token={tokens['a']}"))[str(job)]
        assert 'class="state finished"' in card and f"{STEPS} / {STEPS} steps" in card
        store.close()
    # The runner's tracker drew the run's plots (in a child of the runner's process) into MLflow.
    [run_dir] = [os.path.dirname(p) for p in glob.glob(str(tmp_path / "page-demo" / "runs" / "*" / "summary.json"))
                 if not os.path.islink(os.path.dirname(p))]  # not runs/latest
    summary = read_summary(run_dir)
    plots = {os.path.basename(a.path) for a in MlflowClient(summary["tracking_uri"]).list_artifacts(
        summary["mlflow_run_id"], "plots")}
    assert plots == {"loss.png", "throughput.png", "world_size.png", "rank_breakdown.png"}


def test_progress_is_scoped_by_token_and_read_from_an_ended_jobs_summary(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/svc.db")
    store.add_team(Team("a", 2))
    store.add_team(Team("b", 2))
    a, b = store.issue_token("a"), store.issue_token("b")
    spec = {"name": "ended", "output_dir": str(tmp_path / "runs"), "resources": {"num_workers": 2},
            "train": {"max_steps": 3}, "optim": {"warmup_steps": 1}}
    job = user_requests.submit(store, team="a", spec=spec, by="a").id
    queued_b = user_requests.submit(store, team="b", spec=spec | {"name": "waits"}, by="b").id
    for state in (JobState.STARTING, JobState.RUNNING, JobState.FINISHED):
        store.transition(job, store.job(job).state, state, actor="reconciler", reason=f"test: {state.value}",
                         mlflow_run_id="run-1")
    run = RunSummary(job="ended", run_dir=str(tmp_path / "runs" / "ended-1"), status="finished", committed_steps=3,
                     losses=[3.0, 2.5, 2.25], world_sizes=[2, 2, 2], mlflow_run_id="run-1",
                     throughput={"tokens_per_s": 1000.0, "step_time_s": 0.05})
    os.makedirs(run.run_dir)
    run.write()

    with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs", progress=ProgressSource()) as handle:
        with urllib.request.urlopen(handle.url + "/", timeout=10) as resp:  # the page needs no token
            assert "<title>raytrain-sys jobs</title>" in resp.read().decode()
        of_a = Client(handle.url, a).progress()
        assert [item["job"]["id"] for item in of_a] == [job]
        shown = of_a[0]["progress"]
        assert (shown["status"], shown["step"], shown["max_steps"], shown["world_size"]) == ("finished", 3, 3, 2)
        assert shown["losses"] == [[1, 3.0], [2, 2.5], [3, 2.25]] and shown["tokens_per_s"] == 1000.0
        of_b = Client(handle.url, b).progress()
        assert [(item["job"]["id"], item["progress"]) for item in of_b] == [(queued_b, None)]
        with pytest.raises(ServiceRequestError) as other_team:
            Client(handle.url, b).progress(team="a")
        assert other_team.value.status == 403
        with pytest.raises(ServiceRequestError) as no_token:
            Client(handle.url, None).progress()
        assert no_token.value.status == 401 and "missing token" in str(no_token.value)
    store.close()


@needs_chromium
def test_page_draws_each_ranks_step_breakdown_and_refreshes_itself(tmp_path):
    """The per-rank step times (``rank_times``, as the step breakdown records them) are drawn as
    one stacked bar a rank, its parts named, the slow rank's bar the longest; the page polls
    again on its own and shows the newer step. A job whose runner stopped answering says so,
    with the age of the numbers it shows."""
    store = Store.open(f"sqlite:///{tmp_path}/svc.db")
    store.add_team(Team("a", 4))
    token = store.issue_token("a")
    spec = {"name": "ranks", "resources": {"num_workers": 4}, "train": {"max_steps": 40},
            "optim": {"warmup_steps": 1}}
    job = user_requests.submit(store, team="a", spec=spec, by="a").id
    silent = user_requests.submit(store, team="a", spec=spec | {"name": "silent"}, by="a").id
    slow = {"0": 0.05, "1": 0.05, "2": 0.12, "3": 0.05}  # rank 2 computes 2.4x as long
    rank_times = {r: {"node": "n", "data_wait_s": 0.002, "compute_s": c, "collective_s": 0.13 - c,
                      "optimizer_s": 0.01, "step_s": 0.142} for r, c in slow.items()}
    live = {"job": "ranks", "status": "running", "committed_steps": 20, "losses": [3.0 - 0.05 * i for i in range(20)],
            "world_sizes": [4] * 20, "rank_times": rank_times}  # summary.json's form
    answers = []

    def advancing(jobs):
        """Each poll: one step further."""
        answers.append(progress(live | {"committed_steps": 20 + len(answers)}, 40))
        return {job: JobProgress(answers[-1], True, time.time()),
                silent: JobProgress(answers[0], False, time.time() - 125)}

    with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs", progress=advancing) as handle:
        cards = job_cards(chromium(f"{handle.url}/#token={token}"))
    card = cards[str(job)]
    assert "not answering" not in card
    assert re.search(r'class="silent">its runner is not answering: numbers of 2 min ago<', cards[str(silent)])
    assert len(answers) >= 2, "the page did not poll again"
    shown = int(re.search(r"(\d+) / 40 steps", card).group(1))
    assert shown in [a["step"] for a in answers[1:]], f"step {shown} shown: not a later poll's"
    chart = re.search(r'<svg[^>]*class="rank-chart".*?</svg>', card, re.S)
    assert chart, "no per-rank chart"
    assert re.findall(r">rank (\d)<", chart.group(0)) == ["0", "1", "2", "3"]
    computes = [float(ms) for ms in re.findall(r"<title>compute ([\d.]+) ms</title>", chart.group(0))]
    assert computes == [50.0, 50.0, 120.0, 50.0]
    assert "collective wait 10 ms" in chart.group(0)
    store.close()


@needs_chromium
def test_page_and_cli_status_name_a_hung_worker_and_the_top_frame_of_its_stack(tmp_path, capsys):
    """A worker found hung (summary.json's recovery record, as ``liveness.hang_record`` keeps it):
    its job's card and ``raytrain-sys jobs status`` name its rank, its worker and where its
    training thread was."""
    from raytrain_sys.cli.main import main as cli_main

    store = Store.open(f"sqlite:///{tmp_path}/svc.db")
    store.add_team(Team("a", 2))
    token = store.issue_token("a")
    job = user_requests.submit(store, team="a", spec={"name": "hung", "resources": {"num_workers": 2},
                                                      "train": {"max_steps": 40}}, by="a").id
    top = {"file": "/home/u/mytask.py", "line": 41, "function": "loss_sum"}
    hung = {"step": 20, "slot": 1, "rank": 1, "phase": "forward", "reason": "hung: stuck in the forward ...",
            "top_frame": top, "stack": "Thread MainThread (training): ..."}
    live = {"job": "hung", "status": "running", "committed_steps": 24, "losses": [3.0] * 24,
            "recoveries": [{"step": 19, "lost": [1], "reason": "steps 16..20 failed: ...", "from": "survivors",
                            "steps_redone": 0, "hung": [hung]}]}
    def answered(jobs):
        """Its runner's answer to this poll: the live numbers above."""
        return {job: JobProgress(progress(live, 40), True, time.time())}

    with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs", progress=answered) as handle:
        card = job_cards(chromium(f"{handle.url}/#token={token}"))[str(job)]
        assert cli_main(["jobs", "status", str(job), "--url", handle.url, "--token", token]) == 0
    shown = re.search(r'<div class="stack" data-kind="hung">(.*?)</div>', card, re.S)
    assert shown, card
    assert re.sub(r"<[^>]+>", "", shown.group(1)) == "step 20: rank 1 (worker 1) hung at /home/u/mytask.py:41 in loss_sum"
    assert "stack       step 20: rank 1 hung at /home/u/mytask.py:41 in loss_sum\n" in capsys.readouterr().out
    store.close()


@needs_chromium
def test_page_says_why_a_job_is_not_running_yet(tmp_path):
    """A queued job's card names the cause it waits on, for how long, and the sentence; a running
    job's shows its last transition's reason instead. The reconciler's part is played through the
    store."""
    from raytrain_sys.service.model import WaitCause

    store = Store.open(f"sqlite:///{tmp_path}/svc.db")
    store.add_team(Team("a", 1))
    token = store.issue_token("a")
    spec = {"name": "first", "resources": {"num_workers": 1}, "train": {"max_steps": 40}}
    runs = user_requests.submit(store, team="a", spec=spec, by="a").id
    waits = user_requests.submit(store, team="a", spec=spec | {"name": "second"}, by="a").id
    for state in (JobState.STARTING, JobState.RUNNING):
        store.transition(runs, store.job(runs).state, state, actor="reconciler", reason=f"test: {state.value}")
    reason = "over its team's quota: needs 1 worker (min_workers), the team may take 0 more"
    store.note_waits({waits: (JobState.QUEUED, WaitCause.TEAM_QUOTA, reason)}, now_s=time.time() - 190)
    with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs") as handle:
        cards = job_cards(chromium(f"{handle.url}/#token={token}"))
    wait = re.search(r'<div class="wait" data-wait-cause="([a-z_]+)">(.*?)</div>', cards[str(waits)], re.S)
    assert wait and wait.group(1) == "team_quota", cards[str(waits)]
    text = re.sub(r"<[^>]+>", "", wait.group(2))
    assert text == f"waiting on team quota for 3 min: {reason}"
    assert 'class="wait"' not in cards[str(runs)] and "test: running" in cards[str(runs)]
    store.close()


@needs_chromium
def test_page_groups_a_sweeps_trials_under_their_sweep(tmp_path):
    """A sweep's trials are shown together under their sweep (how many, how many run), each card
    naming its trial and rung, the trial that passed more rungs first; a job of its own stays
    outside. ``jobs status`` names the trial and its sweep too. The sweep runner's part is played
    through the store."""
    from raytrain_sys.service.model import SweepState

    store = Store.open(f"sqlite:///{tmp_path}/svc.db")
    store.add_team(Team("a", 4))
    token = store.issue_token("a")
    alone = user_requests.submit(store, team="a", spec={"name": "alone", "train": {"max_steps": 40}}, by="a").id
    sweep = store.submit_sweep(team="a", name="lr", spec="{}", priority=0, max_workers=4,
                               storage_path=str(tmp_path / "tune"), actor="a")
    store.transition_sweep(sweep.id, SweepState.QUEUED, SweepState.RUNNING, actor="reconciler", reason="test")
    trials = [store.submit(team="a", name=f"lr-{t}", spec="{}", min_workers=1, max_workers=2, actor="sweep-runner",
                           sweep_id=sweep.id, trial_id=t).id for t in ("t0001", "t0002")]
    for state in (JobState.STARTING, JobState.RUNNING):
        store.transition(trials[0], store.job(trials[0]).state, state, actor="reconciler", reason=f"test: {state.value}")
    assert store.set_rung(trials[0], 1)
    with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs") as handle:
        dom = chromium(f"{handle.url}/#token={token}")
        shown = Client(handle.url, token).job(trials[0])
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               "RAYTRAIN_SYS_SERVICE_URL": handle.url, "RAYTRAIN_SYS_TOKEN": token}
        status = subprocess.run([sys.executable, "-m", "raytrain_sys.cli.main", "jobs", "status", str(trials[0])],
                                env=env, capture_output=True, text=True, timeout=60)
    box = dom.index(f'<div class="sweep" data-sweep-id="{sweep.id}">')
    heading = re.sub(r"<[^>]+>", "", re.search(r"<h3>(.*?)</h3>", dom[box:], re.S).group(1))
    assert heading == f"sweep #{sweep.id} · 2 trials · 1 running"
    # In page order after the heading: the trials, the one that passed more rungs first, then the
    # job of its own (submitted before them: newest first).
    order = [(job_id, (re.search(r'data-sweep-id="(\d+)"', attrs) or [None, ""])[1]) for job_id, attrs in
             re.findall(r'<section class="job" data-job-id="(\d+)"([^>]*)>', dom[box:])]
    assert order == [(str(trials[0]), str(sweep.id)), (str(trials[1]), str(sweep.id)), (str(alone), "")], order
    cards = job_cards(dom)
    assert "trial t0001 · rung 1" in cards[str(trials[0])] and "trial t0002 · rung 0" in cards[str(trials[1])]
    assert 'class="trial"' not in cards[str(alone)]
    assert (shown["sweep_id"], shown["trial_id"], shown["rung"]) == (sweep.id, "t0001", 1)
    assert status.returncode == 0, status.stderr
    assert re.search(rf"trial\s+t0001 of sweep {sweep.id}, rung 1", status.stdout), status.stdout
    store.close()
