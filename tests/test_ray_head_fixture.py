"""End-to-end checks for the ``ray_head`` fixture: a real ``ray start --head``
with token auth, reached through the Jobs SDK and the ``ray job submit`` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.ray_head import clean_client_env

RESOURCES_ENTRYPOINT = (
    "python -c \"import ray; ray.init(); print('RESOURCES', ray.cluster_resources()); "
    "print('PAYLOAD', open('payload.txt').read())\""
)


def _http_status(url: str, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_submit_succeeds_with_working_dir(ray_head, tmp_path):
    (tmp_path / "payload.txt").write_text("hello-from-working-dir")
    status, logs = ray_head.submit(RESOURCES_ENTRYPOINT, working_dir=str(tmp_path), timeout_s=120)
    assert status == "SUCCEEDED", logs
    assert "RESOURCES" in logs, logs
    assert "'CPU': 2.0" in logs, logs  # the head's --num-cpus=2, not some other cluster
    assert "PAYLOAD hello-from-working-dir" in logs, logs


def test_failing_job_reports_failed(ray_head, tmp_path):
    (tmp_path / "x.txt").write_text("x")
    status, logs = ray_head.submit(
        'python -c "import sys; sys.exit(3)"', working_dir=str(tmp_path), timeout_s=120
    )
    assert status == "FAILED", logs


def test_token_auth_is_enforced(ray_head):
    assert ray_head.auth_mode == "token" and ray_head.token
    url = ray_head.dashboard_url
    # This path is public and reports the head's mode.
    with urllib.request.urlopen(f"{url}/api/authentication_mode", timeout=10) as r:
        assert b'"token"' in r.read()
    assert _http_status(f"{url}/api/jobs/") == 401  # no token
    assert _http_status(f"{url}/api/jobs/", {"Authorization": "Bearer wrong"}) == 403
    assert _http_status(f"{url}/api/jobs/", ray_head.headers) == 200


def test_ray_job_submit_cli(ray_head, tmp_path):
    """The literal CLI a user runs, authenticated only by ray_head.env."""
    (tmp_path / "payload.txt").write_text("hello-from-cli")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_cli, "job", "submit", "--address", ray_head.dashboard_url, "--working-dir", "."]
    entry = ["--", "python", "-c", "print('CLI', open('payload.txt').read())"]

    ok = subprocess.run(
        cmd + entry, cwd=tmp_path, env=ray_head.client_env(), capture_output=True, text=True, timeout=180
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "CLI hello-from-cli" in ok.stdout, ok.stdout + ok.stderr

    # A token on its own is not enough: without RAY_AUTH_MODE=token the client sends no header.
    no_mode = clean_client_env({"RAY_AUTH_TOKEN": ray_head.token})
    bad = subprocess.run(
        cmd + entry, cwd=tmp_path, env=no_mode, capture_output=True, text=True, timeout=180
    )
    assert bad.returncode != 0
    assert "Missing authentication token" in bad.stdout + bad.stderr, bad.stdout + bad.stderr

    # `ray job submit` (waiting) exits 1 when the job FAILED.
    failed = subprocess.run(
        cmd + ["--", "python", "-c", "import sys; sys.exit(3)"],
        cwd=tmp_path, env=ray_head.client_env(), capture_output=True, text=True, timeout=180,
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr


def test_working_dir_honours_gitignore(ray_head, tmp_path):
    (tmp_path / ".gitignore").write_text(".venv/\nruns/\ndata/\n*.pt\n")
    for d in (".venv", "runs", "data", "jobs"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f.txt").write_text(d)
    (tmp_path / "model.pt").write_text("weights")
    (tmp_path / "keep.py").write_text("")
    lister = textwrap.dedent(
        """
        import os
        for root, dirs, files in os.walk('.'):
            for f in files:
                print('FILE', os.path.relpath(os.path.join(root, f)))
        """
    )
    (tmp_path / "lister.py").write_text(lister)
    status, logs = ray_head.submit("python lister.py", working_dir=str(tmp_path), timeout_s=120)
    assert status == "SUCCEEDED", logs
    files = {ln.split(" ", 1)[1].strip() for ln in logs.splitlines() if ln.startswith("FILE ")}
    assert {"keep.py", "lister.py", ".gitignore", os.path.join("jobs", "f.txt")} <= files, files
    leaked = {f for f in files if f.split(os.sep)[0] in (".venv", "runs", "data") or f.endswith(".pt")}
    assert not leaked, leaked


def test_head_does_not_hijack_bare_ray_init(ray_head):
    """The head writes ray_current_cluster only into its private temp dir, and the
    fixture leaves no RAY_ADDRESS behind, so a bare ray.init() elsewhere in the
    session does not attach to this head."""
    from ray._common.utils import get_ray_address_file

    gcs_port = ray_head.address.rsplit(":", 1)[1]
    own = Path(ray_head.temp_dir, "ray_current_cluster")
    assert own.read_text().strip().endswith(":" + gcs_port)
    default_file = Path(get_ray_address_file(None))
    if default_file.exists():
        assert not default_file.read_text().strip().endswith(":" + gcs_port)
    assert os.environ.get("RAY_ADDRESS", "") != ray_head.address
    assert ray_head.token not in os.environ.values()


@pytest.mark.parametrize("name", ["RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"])
def test_client_ignores_stray_address_env(ray_head, monkeypatch, name):
    """JobSubmissionClient lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override its
    address argument; the fixture's client() must still reach this head."""
    monkeypatch.setenv(name, "http://127.0.0.1:1")
    assert ray_head.client().get_address() == ray_head.dashboard_url
    assert os.environ[name] == "http://127.0.0.1:1"
