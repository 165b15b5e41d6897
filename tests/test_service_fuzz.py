"""The job service's HTTP API fuzzed from its own OpenAPI document by Schemathesis, on a real
uvicorn server over a real store (a SQLite file, and a real PostgreSQL server), with a team's
token and then the admin's: every documented operation, every phase but the stateful one
(examples, coverage: each field's bounds, patterns and types one by one, fuzzing), derandomized
(Schemathesis's deterministic mode) with a fixed number of examples per operation, so a run is
the same requests every time and takes a bounded time (15-80 s a store on 2 shared cores).

Every check Schemathesis has runs (``--checks all``) and a failure of any fails the test: a 5xx,
a status, content type, header or body the document does not describe, a 405 whose ``Allow``
does not name the path's methods, data the schema forbids that the server accepts, a request
without a token that is not refused. One check is relaxed where the schema cannot say what the
server refuses (``POSITIVE_400``: a schema-valid request may be a 400 there, each for its named
reason). The number of requests sent is printed and asserted (docs/SERVICE.md states it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_sys.service import requests
from raytrain_sys.service.api import serve
from raytrain_sys.service.auth import init_admin
from raytrain_sys.service.model import JobState
from raytrain_sys.service.teams import Team
from raytrain_sys.service.store import Store

MAX_EXAMPLES = 25  # fuzzing-phase examples per operation; coverage adds its own (each bound, type, pattern)
PHASES = "examples,coverage,fuzzing"  # stateful: chains of requests, minutes more for little (no links)
RUN_TIMEOUT_S = 240  # one token's run: 7-55 s here, depending on the machine's load

# Operations where a schema-valid request may still be a 400, and why: what JSON Schema cannot say.
POSITIVE_400 = {
    ("POST", "/v1/jobs"): "the spec's own rules (raytrain_sys.spec), an unknown team, a package the team did not "
                          "upload, a size the team could never get; an admin token must name the team",
    ("PUT", "/v1/packages/{sha256}"): "the bytes must be a zip whose sha256 is the path's",
    ("PUT", "/v1/teams/{name}/packages/{sha256}"): "the bytes must be a zip whose sha256 is the path's",
    ("POST", "/v1/teams"): "a name taken, a lending limit above the nominal quota",
    ("PUT", "/v1/teams/{name}"): "a lending limit above the nominal quota",
    ("PUT", "/v1/teams/{name}/quotas/{flavor}"): "a flavor the table does not have, a resource the flavor does not "
                                                  "count, one resource twice, a lending limit above the nominal quota",
    ("PUT", "/v1/flavors"): "two flavors of one name or one kind of node (market and accelerator), removing a flavor "
                            "live jobs run on",
    ("POST", "/v1/sweeps"): "the sweep spec's own rules where they depend on its base (sweeps/spec.py: the base is a "
                            "job spec, its space names the base's fields with domains the base accepts, its metric "
                            "one the trials report, a range's low below its high), an unknown team, a trial the team "
                            "could never start; an admin token must name the team",
}


def _config(path: Path) -> Path:
    lines = ["# written by tests/test_service_fuzz.py", "[checks]", "positive_data_acceptance.enabled = true", ""]
    for (method, route), reason in POSITIVE_400.items():
        # One filter: include-method and include-path would each select operations (either).
        lines += [f"# {reason}", "[[operations]]", f'include-name = "{method} {route}"',
                  'checks.positive_data_acceptance.expected-statuses = '
                  '["2xx", "400", "401", "403", "404", "409"]', ""]
    path.write_text("\n".join(lines))
    return path


def fuzz(url: str, token: str, work: Path, label: str) -> tuple[int, float]:
    """Run Schemathesis against ``url`` with ``token``; fail on any failure it reports. Returns
    (requests sent, seconds)."""
    har = work / f"{label}.har"
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(_config(work / "schemathesis.toml")),
           "run", f"{url}/openapi.json", "--checks", "all",
           "--phases", PHASES, "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--workers", "1",
           "--no-color", "--request-timeout", "30",
           "--header", f"Authorization: Bearer {token}",
           "--report", "har", "--report-har-path", str(har)]
    start = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=work)
    seconds = time.monotonic() - start
    assert run.returncode == 0, f"schemathesis ({label}) found failures:\n{run.stdout[-20000:]}\n{run.stderr[-3000:]}"
    sent = len(json.loads(har.read_text())["log"]["entries"])
    return sent, seconds


def seed_jobs(store: Store) -> None:
    """Jobs 1-4 of team a, queued, running, pausing (held) and paused, so that requests naming a
    small job id (the coverage phase tries 1) meet real jobs in each state a request can find."""
    spec = {"name": "seed", "resources": {"num_workers": 1}}
    ids = [requests.submit(store, team="a", spec=spec, by="a").id for _ in range(4)]
    moves = {ids[1]: [JobState.STARTING, JobState.RUNNING],
             ids[2]: [JobState.STARTING, JobState.RUNNING, JobState.PAUSING],
             ids[3]: [JobState.STARTING, JobState.RUNNING, JobState.PAUSING, JobState.PAUSED]}
    # Sweep 1 of team a, queued (no trial yet), for the sweep requests that name a small id.
    store.submit_sweep(team="a", name="seed", spec=json.dumps({"metric": "eval_loss"}), storage_path="/tmp",
                       actor="a")
    for job, states in moves.items():
        for state in states:
            store.transition(job, store.job(job).state, state, actor="reconciler", reason=f"seed: {state.value}")


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_the_api_keeps_its_published_schema_under_fuzzing(db, tmp_path, request, capsys):
    url = f"sqlite:///{tmp_path}/service.db" if db == "sqlite" else request.getfixturevalue("postgres_url")
    store = Store.open(url)
    store.add_team(Team("a", 4, cohort="c"))
    store.add_team(Team("b", 2, cohort="c", borrowing_limit_workers=1))
    admin = init_admin(store)
    seed_jobs(store)
    totals = []
    try:
        with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs") as handle:
            # The team first: the admin's run revokes team tokens (DELETE /v1/teams/{name}/tokens).
            for label, token in (("team", store.issue_token("a")), ("admin", admin)):
                totals.append((label, *fuzz(handle.url, token, tmp_path, f"{db}-{label}")))
            assert Store.authenticate(store, admin) is not None  # still serving the admin at the end
    finally:
        store.close()
    sent = sum(n for _, n, _ in totals)
    with capsys.disabled():
        print(f"\nfuzzed the API on {db}: " + ", ".join(f"{label} {n} requests in {s:.0f} s" for label, n, s in totals)
              + f"; {sent} requests, 0 failures")
    assert sent > 1000, totals  # every operation, each of its bounds, types and patterns, and the fuzzing
