"""A test whose Ray cluster must be its own (nodes killed, drained, the GCS restarted) runs it in a
child process: a process can be connected to one Ray cluster only, and the pytest process may
already hold the session ``ray_cluster``. The child gets a scrubbed environment (no RAY_ADDRESS /
RAY_AUTH_*) and its own RAY_TMPDIR, so it neither joins nor re-points anybody else's cluster
(``Cluster`` writes ``<RAY_TMPDIR>/ray/ray_current_cluster``), and prints one ``RESULT {json}``
line that the test asserts on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRUBBED_ENV = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR")


def child_env() -> tuple[dict, str]:
    """Environment for a child that starts its own Cluster, and its private RAY_TMPDIR."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    ray_tmp = tempfile.mkdtemp(prefix="rtsx-", dir="/tmp")
    os.makedirs(os.path.join(ray_tmp, "ray"))
    env["RAY_TMPDIR"] = ray_tmp
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env, ray_tmp


def parse_result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"child printed no RESULT line; stdout tail:\n{stdout[-3000:]}")


def run_child(module: str, *args: str, timeout_s: float = 360.0) -> dict:
    """``python -m <module> child <args>`` in its own environment; its RESULT, or the test fails
    with the child's output."""
    env, ray_tmp = child_env()
    try:
        proc = subprocess.run([sys.executable, "-m", module, "child", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return parse_result(proc.stdout)


def print_result(result_of) -> None:
    """The child's side: ``RESULT {json}`` of ``result_of()``, or its traceback and exit 1."""
    import traceback

    try:
        result = result_of()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)
