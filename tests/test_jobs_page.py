"""The job service's jobs page in a real browser (headless Chromium, the Debian package) against a
real service on the session cluster, its API on 127.0.0.1, and a job held mid-run by a step gate.

What a user would notice: with their team's token the page shows their running job, its state,
its progress in steps, its throughput and a loss chart drawn from the run's live numbers; another
team's token shows none of it; the admin's shows it too; once the job ends the page shows its
final numbers. A screenshot is kept under the test's tmp dir (and written to
``$JOBS_PAGE_SCREENSHOT`` when set: ``scripts/jobs_page_screenshot.sh`` refreshes the docs' one).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import urllib.request

import pytest
import ray

from raytrain_sys.service.auth import init_admin
from raytrain_sys.service.store import Store
from tests.ft_common import ft_spec, wait_until
from tests.service_common import StepGates, running_service

CHROMIUM = shutil.which("chromium")
STEPS, HELD_AT = 12, 6
WAIT_S = 180.0
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian chromium package (scripts/install.sh dev)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        assert wait_until(lambda: _healthy(url), 30), f"the service's API did not answer on {url}"
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


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
