"""The service's front door from a shell: `service start` and `service status` say what really
serves, a start on a taken port is refused with nothing left running, `init-admin` and `serve`
refuse a store that does not exist unless asked to make one, and every part of the service
reads and writes job logs in the store's one log directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import ray

from raytrain_sys.service.runner import NAMESPACE
from raytrain_sys.service.service import get_service, stop_service
from raytrain_sys.service.store import LOG_DIR_NAME, Store
from tests.service_common import free_port

CLI = [sys.executable, "-m", "raytrain_sys.cli.main"]


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("raytrain-sys: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def service_actors() -> list[str]:
    """The service's named actors (the service, the warm spares' pool, spare runners)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE)


# ----------------------------------------------------------------------------- start and status


def test_start_on_a_taken_port_is_refused_in_one_line_and_leaves_nothing(ray_cluster, tmp_path, capsys, monkeypatch):
    from raytrain_sys.cli.main import main

    monkeypatch.chdir(tmp_path)
    before = service_actors()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["service", "start", "--db", "sqlite:///svc.db", "--port", str(port), "--warm-workers", "1"])
    captured = capsys.readouterr()
    assert code == 2, captured
    line = one_error_line(captured.err)
    assert f"port {port} on 127.0.0.1 is taken" in line and "--port" in line, line
    assert captured.out == ""  # nothing reported as started
    assert get_service() is None and service_actors() == before  # no actor, pool or spare runner left


def test_start_and_status_report_what_serves_and_status_fails_once_the_api_does_not(
        ray_cluster, tmp_path, capsys, monkeypatch):
    from raytrain_sys.cli.main import main

    monkeypatch.chdir(tmp_path)
    port = free_port()
    try:
        assert main(["service", "start", "--db", "sqlite:///svc.db", "--port", str(port), "--warm-workers", "0",
                     "--cluster-workers", "2"]) == 0
        started = capsys.readouterr().out
        assert started.startswith("started: serving\n"), started
        assert f"api:   answering at http://127.0.0.1:{port} (GET /healthz)" in started
        assert f"store: sqlite:///{tmp_path}/svc.db (new and empty: made by this start)" in started
        assert f"logs:  {tmp_path / LOG_DIR_NAME}" in started
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
            assert json.loads(answer.read())["ok"] is True  # what it says is so

        assert main(["service", "status"]) == 0
        status = capsys.readouterr().out
        assert status.startswith("running: serving\n") and "actor: alive, pid " in status, status
        assert f"logs:  {tmp_path / LOG_DIR_NAME}" in status

        # The API's server stopped inside a live actor: status says so and exits 1.
        handle = get_service()
        ray.get(handle.__ray_call__.remote(lambda actor: actor._api.stop()))
        assert main(["service", "status"]) == 1
        status = capsys.readouterr().out
        assert status.startswith("running, but not serving: the HTTP API does not answer"), status
        assert f"not answering: GET http://127.0.0.1:{port}/healthz failed:" in status
    finally:
        stop_service()


# ----------------------------------------------------------------------------- a store that does not exist


@pytest.mark.parametrize("command", ["init-admin", "serve"])
def test_a_store_that_does_not_exist_is_refused_unless_asked_to_create_one(tmp_path, command):
    typo = tmp_path / "srvice.db"
    args = [*CLI, "service", command, "--db", f"sqlite:///{typo}"]
    if command == "serve":
        args += ["--port", str(free_port())]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert f"no job service store at sqlite:///{typo} (no such file {typo})" in line and "--create" in line, line
    assert proc.stdout == "" and not typo.exists()  # no token printed, no file made


def test_init_admin_creates_a_store_when_asked_and_its_token_is_accepted(tmp_path):
    db = f"sqlite:///{tmp_path}/new.db"
    made = subprocess.run([*CLI, "service", "init-admin", "--db", db, "--create"], capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    store = Store.open(db)
    try:
        assert store.authenticate(token).is_admin
    finally:
        store.close()
    again = subprocess.run([*CLI, "service", "init-admin", "--db", db], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip().startswith("rts_")  # an existing store needs no flag


def test_a_postgres_database_without_the_services_tables_is_not_a_store(postgres_url, tmp_path):
    assert Store.missing(postgres_url) == "the database has no job service tables"
    store = Store.open(postgres_url)
    try:
        assert Store.missing(postgres_url) is None
        # No file to put it beside: the first part's directory, recorded for every later part.
        assert store.log_dir(base_dir=str(tmp_path)) == str(tmp_path / LOG_DIR_NAME)
        assert store.log_dir(base_dir="/elsewhere") == str(tmp_path / LOG_DIR_NAME)
    finally:
        store.close()


# ----------------------------------------------------------------------------- one log directory


def test_the_log_directory_is_the_stores_for_every_part(tmp_path):
    """The rule, without Ray: the first part records the default (beside the SQLite file), a
    later part opened elsewhere reads it, and an explicit one replaces it for every later part."""
    db = f"sqlite:///{tmp_path}/a/svc.db"
    os.makedirs(tmp_path / "a")
    store = Store.open(db)
    try:
        assert store.log_dir(base_dir=str(tmp_path / "elsewhere")) == str(tmp_path / "a" / LOG_DIR_NAME)
    finally:
        store.close()
    store = Store.open(db)
    try:
        assert store.log_dir() == str(tmp_path / "a" / LOG_DIR_NAME)
        assert store.log_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
        assert store.log_dir() == str(tmp_path / "mine")
    finally:
        store.close()


def test_two_jobs_start_at_once_on_a_fresh_service_and_serve_shows_their_logs(ray_cluster, tiny_dataset, tmp_path):
    """Two jobs submitted together to a fresh service, one MLflow store between them that does
    not exist yet: both finish (the service makes the store once, before their runners start).
    Then `service serve` on the same store from another directory, with no --log-dir: `jobs
    logs` shows the lines their runners wrote."""
    from raytrain_sys.service.auth import init_admin
    from raytrain_sys.service.teams import Team
    from tests.helpers import tiny_spec
    from tests.service_common import StepGates, running_service

    db = tmp_path / "svc.db"
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 3}, resources={"num_workers": 1}).to_dict()
    assert not (tmp_path / "runs").exists()
    (tmp_path / "gates").mkdir()
    store = Store.open(f"sqlite:///{db}")
    try:
        store.add_team(Team("a", 2))
        token = init_admin(store)
    finally:
        store.close()
    # No log_dir: the store's default, beside the SQLite file.
    with running_service(db, StepGates(str(tmp_path / "gates")), log_dir="", warm_workers_per_node=0) as svc:
        jobs = [ray.get(svc.submit.remote("a", spec | {"name": name}))["id"] for name in ("one", "two")]
        deadline = time.monotonic() + 240
        while {ray.get(svc.job.remote(job))["state"] for job in jobs} != {"finished"}:
            ended = [ray.get(svc.job.remote(job)) for job in jobs]
            assert not [j for j in ended if j["state"] in ("failed", "cancelled")], ended
            assert time.monotonic() < deadline, ended
            time.sleep(0.5)
    written = {job: (tmp_path / LOG_DIR_NAME / f"job-{job}.log").read_text() for job in jobs}
    assert all(f"job {job}: runner done" in text for job, text in written.items())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    server = subprocess.Popen([*CLI, "service", "serve", "--db", f"sqlite:///{db}", "--port", str(port)],
                              cwd=elsewhere, stderr=subprocess.PIPE, text=True)
    try:
        banner = ""
        while "Ctrl-C stops it" not in banner:  # its own line, after uvicorn's
            banner = server.stderr.readline()
            assert banner, "service serve ended before it served"
        assert f"job logs in {tmp_path / LOG_DIR_NAME}" in banner, banner
        env = {**os.environ, "RAYTRAIN_SYS_SERVICE_URL": f"http://127.0.0.1:{port}", "RAYTRAIN_SYS_TOKEN": token}
        for job, text in written.items():
            logs = subprocess.run([*CLI, "jobs", "logs", str(job)], capture_output=True, text=True, timeout=60,
                                  env=env, cwd=elsewhere)
            assert logs.returncode == 0 and logs.stdout == text, logs.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)


# ----------------------------------------------------------------------------- CLI gaps


@pytest.fixture
def api(tmp_path):
    """The HTTP API over a fresh SQLite store (no Ray), an admin token and a team token."""
    from raytrain_sys.service.api import serve
    from raytrain_sys.service.auth import init_admin
    from raytrain_sys.service.teams import Team

    store = Store.open(f"sqlite:///{tmp_path}/api.db")
    store.add_team(Team("a", 2))
    admin = init_admin(store)
    with serve(store, "127.0.0.1", 0) as handle:
        yield handle.url, admin, store.issue_token("a"), store
    store.close()


def cli(url: str, token: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAYTRAIN_SYS_SERVICE_URL": url, "RAYTRAIN_SYS_TOKEN": token, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def test_a_teams_limits_are_set_and_cleared_from_the_cli(api):
    url, admin, _, store = api
    limited = cli(url, admin, "teams", "update", "a", "--borrowing-limit", "3", "--lending-limit", "1")
    assert limited.returncode == 0, limited.stderr
    assert (store.team("a").borrowing_limit_workers, store.team("a").lending_limit_workers) == (3, 1)

    cleared = cli(url, admin, "teams", "update", "a", "--borrowing-limit", "none")
    assert cleared.returncode == 0, cleared.stderr
    assert (store.team("a").borrowing_limit_workers, store.team("a").lending_limit_workers) == (None, 1)
    cleared = cli(url, admin, "teams", "update", "a", "--lending-limit", "NONE")
    assert cleared.returncode == 0 and store.team("a").lending_limit_workers is None, cleared.stderr
    assert ["a", "2", "-", "-", "-", "1"] in [r.split() for r in cli(url, admin, "teams", "list").stdout.splitlines()]

    added = cli(url, admin, "teams", "add", "b", "--nominal", "1", "--borrowing-limit", "none")
    assert added.returncode == 0 and store.team("b").borrowing_limit_workers is None, added.stderr
    wrong = cli(url, admin, "teams", "update", "a", "--borrowing-limit", "lots")
    assert wrong.returncode == 2 and "expected a number of workers, or none for no limit; got 'lots'" in wrong.stderr


def test_jobs_submit_of_a_directory_says_it_is_one_and_what_to_give(api, tmp_path):
    url, _, team, _ = api
    code = tmp_path / "my_job"
    code.mkdir()
    (code / "job.yaml").write_text("name: mine\n")
    proc = cli(url, team, "jobs", "submit", str(code))
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert f"'{code}' is a directory (it holds job.yaml): give the job's spec file, e.g. {code}/job.yaml" in line
    assert f"--working-dir {code}" in line and "does not exist" not in line
    run = subprocess.run([*CLI, "run", str(code)], capture_output=True, text=True, timeout=60)  # the same rule
    assert run.returncode == 2 and "is a directory (it holds job.yaml)" in one_error_line(run.stderr)
