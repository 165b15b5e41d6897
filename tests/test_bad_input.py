"""Bad input gets one clear line, a non-zero exit, and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import live_actors_and_groups

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

CLI = [sys.executable, "-m", "raytrain_sys.cli.main"]


def run_cli(*args: str, cwd=None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("raytrain-sys: error:")]


def write_spec(tmp_path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("text,expected", [
    ("train: {max_steps: 10\n", "not valid YAML at line"),
    ("train:\n  max_stepz: 10\n", "'train.max_stepz': unknown field (did you mean 'max_steps'?)"),
    ("train:\n  max_steps: ten\n", "'train.max_steps': got 'ten' (str); expected an integer"),
    ("train:\n  global_batch_size: -4\n", "'train.global_batch_size': got -4; must be greater than 0"),
    ("parallel:\n  strategy: zero9\n", "'parallel.strategy': got 'zero9'; allowed: ddp"),
    ("model:\n  n_head: 5\n", "'model.n_head': got 5; must divide model.n_embd=128"),
])
def test_malformed_spec_names_the_field(tmp_path, text, expected):
    proc = run_cli("run", write_spec(tmp_path, text), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # failed before anything was created


def test_bad_override_names_the_field(tmp_path):
    proc = run_cli("run", write_spec(tmp_path, "name: x\n"), "--set", "optim.lr=-1", cwd=tmp_path)
    assert proc.returncode == 2 and "'optim.lr': got -1" in error_lines(proc)[0]


def test_missing_data_path_says_how_to_make_it(tmp_path):
    proc = run_cli("run", write_spec(tmp_path, "data:\n  path: nowhere/ds\n"), cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "no dataset at nowhere/ds" in line and "raytrain-sys prepare-data --out nowhere/ds" in line


def test_missing_spec_file(tmp_path):
    proc = run_cli("run", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "does not exist" in error_lines(proc)[0]


def test_more_workers_than_the_cluster_holds(ray_cluster, tiny_dataset, tmp_path):
    before = live_actors_and_groups()
    spec = write_spec(tmp_path, f"""
        model: {{block_size: 32, n_layer: 1, n_embd: 32, n_head: 2}}
        data: {{path: {tiny_dataset}}}
        train: {{global_batch_size: 16, max_steps: 2}}
        optim: {{warmup_steps: 0}}
        resources: {{num_workers: 8, ray_address: "{ray_cluster}", start_timeout_s: 3}}
        """)
    proc = run_cli("run", spec, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = error_lines(proc)
    assert "could not hold 8 workers" in line and "resources.num_workers" in line
    assert live_actors_and_groups() == before  # no actors or placement groups left behind
    # The MLflow run opens once the slots are placed (beside the workers' start): none here.
    db = tmp_path / "runs" / "mlflow.db"
    if db.exists():
        import sqlite3

        with sqlite3.connect(db) as conn:
            assert conn.execute("select count(*) from runs").fetchone()[0] == 0


def test_more_workers_than_a_local_cluster_holds_fails_at_once(tiny_dataset, tmp_path):
    spec = write_spec(tmp_path, f"""
        model: {{block_size: 32, n_layer: 1, n_embd: 32, n_head: 2}}
        data: {{path: {tiny_dataset}}}
        train: {{global_batch_size: 16, max_steps: 2}}
        optim: {{warmup_steps: 0}}
        resources: {{num_workers: 8, local_num_cpus: 2}}
        """)
    proc = run_cli("run", spec, cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "local Ray cluster has 2 CPU in total but the group needs 8" in line


def test_a_local_cluster_that_does_not_start_in_time_is_one_line_saying_what_to_do(tiny_dataset, tmp_path):
    """Ray's own wait for its GCS made tiny (RAY_gcs_server_port_wait_time_s=0), as a loaded
    machine makes the real one too short: one line, exit 2, no Ray traceback."""
    spec = write_spec(tmp_path, f"""
        model: {{block_size: 32, n_layer: 1, n_embd: 32, n_head: 2}}
        data: {{path: {tiny_dataset}}}
        train: {{global_batch_size: 8, max_steps: 2}}
        optim: {{warmup_steps: 0}}
        resources: {{num_workers: 1}}
        """)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RAY_gcs_server_port_wait_time_s": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([*CLI, "run", spec], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc)
    assert "the local Ray cluster did not start (Timed out waiting for file" in line, line
    assert "ray start --head" in line and "RAY_ADDRESS" in line and "Traceback" not in proc.stderr


def test_block_size_must_match_the_dataset(tiny_dataset, tmp_path):
    proc = run_cli("run", write_spec(tmp_path, f"data: {{path: {tiny_dataset}}}\n"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "'model.block_size': got 128; dataset" in error_lines(proc)[0]


@pytest.mark.parametrize("auth_env, expected", [
    ({}, "requires its auth token and this process sends none: set RAY_AUTH_MODE=token"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-cluster-token-0123456789abcdef"},
     "refused this process's auth token"),
], ids=["a client without RAY_AUTH_MODE=token (a new user after `ray start --head`)",
        "a client sending another cluster's token"])
@pytest.mark.parametrize("command", ["run", "service status"])
def test_a_cluster_that_wants_rays_auth_token(ray_head, tiny_dataset, tmp_path, auth_env, expected, command):
    """`ray start --head` turns token auth on when a token exists; `ray.init(address=...)` then
    retries for about 20 s and raises a bare ConnectionError. Ours: exit 2 within seconds, one
    line naming RAY_AUTH_MODE=token and where the token is read from."""
    import time

    from tests.fixtures.ray_head import clean_client_env

    spec = write_spec(tmp_path, f"""
        model: {{block_size: 32, n_layer: 1, n_embd: 32, n_head: 2}}
        data: {{path: {tiny_dataset}}}
        train: {{global_batch_size: 8, max_steps: 2}}
        optim: {{warmup_steps: 0}}
        """)
    # A home with no ~/.ray/auth_token: what a new user's laptop has.
    env = clean_client_env({"RAY_ADDRESS": ray_head.address, "HOME": str(tmp_path), "PYTHONWARNINGS": "ignore",
                            **auth_env})
    args = ["run", spec] if command == "run" else command.split()
    t0 = time.monotonic()
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc)
    assert expected in line and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "RAY_AUTH_TOKEN" in line and "~/.ray/auth_token" in line
    if not auth_env:
        assert f"{tmp_path}/.ray/auth_token does not exist here" in line
    assert took < 15, f"took {took:.1f} s"
