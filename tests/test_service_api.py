"""The job service's HTTP API, its auth and audit, the Python client and the CLI, against a real
uvicorn server on 127.0.0.1 over a real store (a SQLite file; the submit and transition path
also over a real PostgreSQL server). No Ray: the tests play the reconciler's part through the
store where a job must be running or paused."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from raytrain_sys.errors import (JobStateConflict, ServiceInputError, ServiceRequestConflict, ServiceRequestError,
                                 ServiceRequestInvalid, UserError)
from raytrain_sys.service import packages
from raytrain_sys.service.api import serve
from raytrain_sys.service.auth import init_admin
from raytrain_sys.service.client import Client
from raytrain_sys.service.flavors import ResourceFlavor
from raytrain_sys.service.model import JobState, WaitCause
from raytrain_sys.service.teams import Team
from raytrain_sys.service.store import Store
from raytrain_sys.service.tables import metadata

REPO = Path(__file__).resolve().parent.parent

# A spec that validates quickly and needs nothing on disk: 2 workers, elastic 1..2 (a spec
# without elastic.max_workers is a gang of resources.num_workers: requests.job_size).
SPEC = {"name": "tiny", "resources": {"num_workers": 2}, "elastic": {"min_workers": 1, "max_workers": 2},
        "train": {"max_steps": 50}}


@dataclass
class Service:
    store: Store
    url: str
    admin: str  # tokens
    a: str
    b: str
    log_dir: Path
    db_url: str

    def client(self, token: str) -> Client:
        return Client(self.url, token)


def _start(db_url: str, root: Path):
    store = Store.open(db_url)
    store.add_team(Team("a", 4, cohort="c"))
    store.add_team(Team("b", 2, cohort="c", borrowing_limit_workers=1, lending_limit_workers=0))
    admin = init_admin(store)
    handle = serve(store, "127.0.0.1", 0, log_dir=root / "logs")
    svc = Service(store, handle.url, admin, store.issue_token("a"), store.issue_token("b"), root / "logs", db_url)
    return svc, handle


@pytest.fixture(scope="module")
def sqlite_service(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    svc, handle = _start(f"sqlite:///{root}/service.db", root)
    yield svc
    handle.stop()
    svc.store.close()


@pytest.fixture(params=["sqlite", "postgres"])
def service(request, tmp_path):
    """The module's SQLite service, or a fresh one over a real PostgreSQL database."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_service")
        return
    svc, handle = _start(request.getfixturevalue("postgres_url"), tmp_path)
    yield svc
    handle.stop()
    svc.store.close()


def raw(svc: Service, method: str, path: str, token: str | None = None, body=None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(svc.url + path, method=method, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, data = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


def play_reconciler(store: Store, job_id: int, *to: JobState) -> None:
    """Move a job the way the reconciler would (one guarded transition per edge)."""
    for state in to:
        current = store.job(job_id).state
        workers = {"workers": 2, "target_workers": 2} if state is JobState.RUNNING else {}
        if state is JobState.PAUSED:
            workers = {"workers": 0, "target_workers": 0}
        store.transition(job_id, current, state, actor="reconciler", reason=f"test: {state.value}", **workers)


# ----------------------------------------------------------------------------- submit and state changes


def test_submit_list_status_and_history(service, tmp_path):
    a = service.client(service.a)
    by_mapping = a.submit(SPEC, priority=3)
    assert (by_mapping["state"], by_mapping["team"], by_mapping["priority"]) == ("queued", "a", 3)
    assert (by_mapping["min_workers"], by_mapping["max_workers"], by_mapping["elastic"]) == (1, 2, True)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    by_path = a.submit(path, overrides=["resources.num_workers=3", "elastic.min_workers=3", "elastic.max_workers=0"],
                       name="sized")
    assert (by_path["name"], by_path["min_workers"], by_path["max_workers"], by_path["elastic"]) == ("sized", 3, 3, False)
    by_text = service.client(service.admin).submit(yaml.safe_dump(SPEC), team="b")
    assert by_text["team"] == "b"

    stored = service.store.job(by_path["id"])
    assert (stored.state, stored.team, stored.min_workers, stored.held) == (JobState.QUEUED, "a", 3, False)
    assert (stored.max_workers, stored.elastic) == (3, False)  # no elastic.max_workers: a gang of num_workers
    assert json.loads(stored.spec)["resources"]["num_workers"] == 3  # the validated spec, overrides applied
    detail = a.job(by_path["id"])
    assert yaml.safe_load(detail["spec"])["elastic"]["min_workers"] == 3
    assert [(t["from_state"], t["to_state"], t["actor"]) for t in a.transitions(by_path["id"])] == [
        (None, "queued", "a")]

    ids_of_a = [j["id"] for j in a.jobs()]
    assert by_mapping["id"] in ids_of_a and by_path["id"] in ids_of_a and by_text["id"] not in ids_of_a
    assert {j["team"] for j in service.client(service.admin).jobs()} >= {"a", "b"}
    of_b = service.client(service.admin).jobs(team="b")
    assert by_text["id"] in [j["id"] for j in of_b] and {j["team"] for j in of_b} == {"b"}
    assert by_mapping["id"] in [j["id"] for j in a.jobs(states=["queued"])]
    assert by_mapping["id"] not in [j["id"] for j in a.jobs(states=["running", "cancelled"])]
    audit = [r for r in service.store.audit_log() if r.action == "submit"]
    assert f"job {by_path['id']} (team a)" in [r.target for r in audit if r.actor == "a" and r.result == "ok"]


def test_a_waiting_jobs_reason_is_in_the_api_the_client_and_the_cli_and_clears_when_it_runs(service, monkeypatch):
    """The reconciler's part (a noted reason, then the job admitted and running) played through
    the store; what a user reads through the API, the client and the CLI."""
    a = service.client(service.a)
    job = a.submit(SPEC)["id"]
    assert {k: a.job(job)[k] for k in ("wait_cause", "wait_reason", "wait_cause_since_s", "start_returns")} == {
        "wait_cause": None, "wait_reason": None, "wait_cause_since_s": None, "start_returns": 0}  # not looked at yet
    reason = ("over its team's quota: needs 1 worker (min_workers), the team may take 0 more: team a uses 4 of "
              "nominal 4 (no borrowing limit; cohort pool 0 free); nothing it may reclaim would make room")
    since = time.time() - 125
    service.store.note_waits({job: (JobState.QUEUED, WaitCause.TEAM_QUOTA, reason)}, now_s=since)
    shown = a.job(job)
    assert (shown["state"], shown["wait_cause"], shown["wait_reason"], shown["wait_cause_since_s"]) == (
        "queued", "team_quota", reason, since)
    assert [j["wait_cause"] for j in a.jobs() if j["id"] == job] == ["team_quota"]

    monkeypatch.setenv("COLUMNS", "120")  # the CLI's terminal
    listed = cli(service, "jobs", "list")
    header, *rows = listed.stdout.splitlines()
    [row] = [r for r in rows if r.split()[0] == str(job)]
    assert row[header.index("REASON"):].startswith("over its team's quota: needs 1 worker")
    assert row.endswith("...") and len(row) <= 120, "cut to fit the terminal"
    status = cli(service, "jobs", "status", str(job)).stdout
    assert f"reason      {reason}\n" in status and "waits on    team_quota since " in status and "(2m ago)" in status

    play_reconciler(service.store, job, JobState.STARTING, JobState.RUNNING)
    running = a.job(job)
    assert (running["wait_cause"], running["wait_reason"], running["wait_cause_since_s"]) == (None, None, None)
    assert "reason " not in cli(service, "jobs", "status", str(job)).stdout


def test_pause_resume_cancel_write_requests_as_guarded_transitions(service):
    a, store = service.client(service.a), service.store
    job = a.submit(SPEC)["id"]

    # Queued: pause holds it (the scheduler leaves it waiting), resume releases it.
    assert (a.pause(job)["state"], store.job(job).held) == ("queued", True)
    assert (a.resume(job)["state"], store.job(job).held) == ("queued", False)

    # Running: pause asks for pausing (held, so that once paused it is not admitted by itself).
    play_reconciler(store, job, JobState.STARTING, JobState.RUNNING)
    paused = a.pause(job, reason="need the nodes")
    assert (paused["state"], paused["held"]) == ("pausing", True)
    assert store.job(job).state is JobState.PAUSING
    play_reconciler(store, job, JobState.PAUSED)
    resumed = a.resume(job)
    assert (resumed["state"], resumed["held"]) == ("paused", False)  # waits for admission: admitted = resumed

    # A paused job that is cancelled ends at once; a running one asks the reconciler.
    assert a.cancel(job)["state"] == "cancelled"
    other = a.submit(SPEC)["id"]
    play_reconciler(store, other, JobState.STARTING, JobState.RUNNING)
    cancelling = a.cancel(other, delete_checkpoints=True)
    assert (cancelling["state"], cancelling["delete_checkpoints"]) == ("cancelling", True)
    assert store.job(other).delete_checkpoints is True

    history = [(t["from_state"], t["to_state"], t["actor"]) for t in a.transitions(job)]
    assert history == [(None, "queued", "a"), ("queued", "queued", "a"), ("queued", "queued", "a"),
                       ("queued", "starting", "reconciler"), ("starting", "running", "reconciler"),
                       ("running", "pausing", "a"), ("pausing", "paused", "reconciler"), ("paused", "paused", "a"),
                       ("paused", "cancelled", "a")]
    assert a.transitions(job)[5]["reason"] == "paused by a: need the nodes; held until resumed"


@pytest.mark.parametrize("setup, action, state_named", [
    ((), "resume", "queued"),
    ((JobState.STARTING, JobState.RUNNING, JobState.CANCELLING), "pause", "cancelling"),
    ((JobState.STARTING, JobState.RUNNING), "resume", "running"),
    ((JobState.STARTING, JobState.RUNNING, JobState.CANCELLING), "cancel", "cancelling"),
    ((JobState.STARTING, JobState.RUNNING, JobState.FINISHED), "pause", "finished"),
    ((JobState.CANCELLED,), "cancel", "cancelled"),
], ids=["resume of a queued job not held", "pause of a cancelling job", "resume of a running job",
        "cancel of a job already cancelling", "pause of a finished job", "cancel of a cancelled job"])
def test_a_request_the_state_does_not_allow_is_409_naming_it_and_changes_nothing(sqlite_service, setup, action,
                                                                                 state_named):
    a, store = sqlite_service.client(sqlite_service.a), sqlite_service.store
    job = a.submit(SPEC)["id"]
    play_reconciler(store, job, *setup)
    before, history = store.job(job), store.history(job)
    with pytest.raises(ServiceRequestConflict, match=rf"HTTP 409: job {job} is {state_named}\b.*nothing was changed"):
        getattr(a, action)(job)
    assert store.job(job) == before and store.history(job) == history
    last = store.audit_log(actor="a", limit=1)[0]
    assert (last.action, last.target) == (action, f"job {job}") and last.result.startswith("refused (409)")


def test_pausing_a_held_job_twice_is_409_too(sqlite_service):
    a = sqlite_service.client(sqlite_service.a)
    job = a.submit(SPEC)["id"]
    a.pause(job)
    with pytest.raises(JobStateConflict, match="is queued and held"):
        a.pause(job)
    with pytest.raises(ServiceRequestInvalid) as err:
        a._json("POST", f"/v1/jobs/{job}/pause", {"delete_checkpoints": True})
    assert err.value.field == "delete_checkpoints"


def test_a_pause_that_meets_a_starting_job_holds_it_for_the_reconciler(sqlite_service):
    """A job being started: the pause holds it (the reconciler pauses it once it runs) rather
    than a 409 the user would have to retry; a resume before then drops the hold."""
    a, store = sqlite_service.client(sqlite_service.a), sqlite_service.store
    job = a.submit(SPEC)["id"]
    play_reconciler(store, job, JobState.STARTING)
    held = a.pause(job, reason="not now")
    assert (held["state"], held["held"]) == ("starting", True)
    assert held["message"] == "paused by a: not now; held until resumed"
    assert (a.resume(job)["state"], store.job(job).held) == ("starting", False)
    # One audit row a request, written once (by requests.py, not again by the API).
    rows = [(r.action, r.result) for r in store.audit_log(actor="a") if r.target == f"job {job}"]
    assert rows == [("pause", "ok"), ("resume", "ok")]


def test_a_submitted_spec_is_stored_as_the_runner_reads_it_with_absolute_paths(tmp_path):
    """The store holds what the reconciler launches: ``json.loads(job.spec)``, run at the
    admitted size by ``runner.start_spec``; relative local paths point into the API's base dir."""
    from raytrain_sys.service.runner import start_spec
    from raytrain_sys.spec import from_dict

    store = Store.open(f"sqlite:///{tmp_path}/service.db")
    store.add_team(Team("a", 4))
    base = tmp_path / "base"
    with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs", base_dir=str(base)) as handle:
        spec = {**SPEC, "output_dir": "runs", "data": {"path": "data/tiny"},
                "checkpoint": {"uri": "ckpt"}}
        job = Client(handle.url, store.issue_token("a")).submit(yaml.safe_dump(spec))["id"]
    stored = json.loads(store.job(job).spec)  # the reconciler's read (JSON; YAML would raise here)
    runnable = from_dict(start_spec(stored, 1))
    assert runnable.data.path == str(base / "data" / "tiny")
    assert (runnable.output_dir, runnable.checkpoint.uri) == (str(base / "runs"), str(base / "ckpt"))
    assert (runnable.resources.num_workers, runnable.elastic.max_workers) == (1, 2)
    store.close()


# ----------------------------------------------------------------------------- auth


def test_a_team_cannot_see_or_touch_another_teams_jobs(sqlite_service):
    svc = sqlite_service
    a, b = svc.client(svc.a), svc.client(svc.b)
    job = a.submit(SPEC)["id"]
    b_job = b.submit(SPEC)["id"]
    before, history = svc.store.job(job), svc.store.history(job)

    assert job not in [j["id"] for j in b.jobs()] and b_job in [j["id"] for j in b.jobs()]
    for call in (lambda: b.jobs(team="a"), lambda: b.job(job), lambda: b.transitions(job), lambda: b.logs(job),
                 lambda: b.pause(job), lambda: b.resume(job), lambda: b.cancel(job),
                 lambda: b.submit(SPEC, team="a")):
        with pytest.raises(ServiceRequestError) as err:
            call()
        assert err.value.status == 403, err.value
        assert "team b's token cannot act on" in str(err.value)
    assert svc.store.job(job) == before and svc.store.history(job) == history

    refusals = [(r.action, r.target) for r in svc.store.audit_log(actor="b") if r.result.startswith("refused (403)")]
    for action in ("pause", "resume", "cancel", "get_job", "get_logs", "get_transitions"):
        assert (action, f"job {job}") in refusals
    assert ("list_jobs", "team a") in refusals and ("submit", "team a") in refusals


def test_missing_or_invalid_token_is_401_and_audited(sqlite_service):
    svc = sqlite_service
    job = svc.client(svc.a).submit(SPEC)["id"]
    for token in (None, "rts_not-a-real-token", "garbage"):
        status, body = raw(svc, "POST", f"/v1/jobs/{job}/cancel", token)
        assert status == 401 and body["error"] in ("missing token: send 'Authorization: Bearer <token>'",
                                                   "invalid or revoked token")
    status, body = raw(svc, "GET", "/v1/jobs", None)
    assert status == 401
    assert svc.store.job(job).state is JobState.QUEUED
    anon = svc.store.audit_log(actor="unauthenticated")
    assert [r.action for r in anon[-4:]] == [f"POST /v1/jobs/{job}/cancel"] * 3 + ["GET /v1/jobs"]
    assert all(r.result.startswith("refused (401)") for r in anon[-4:])
    # A team token is not an admin token.
    with pytest.raises(ServiceRequestError, match="HTTP 403: adding a team needs an admin token"):
        svc.client(svc.a).add_team("x", 1)
    assert raw(svc, "GET", "/healthz")[0] == 200  # health needs no token


def test_the_admin_manages_teams_and_tokens(sqlite_service):
    svc = sqlite_service
    admin = svc.client(svc.admin)
    team = admin.add_team("ml", 3, cohort="c", borrowing_limit_workers=1, weight=2)
    assert team == {"name": "ml", "nominal_workers": 3, "cohort": "c", "borrowing_limit_workers": 1,
                    "lending_limit_workers": None, "weight": 2.0, "quotas": []}
    assert svc.store.team("ml") == Team("ml", 3, cohort="c", borrowing_limit_workers=1, weight=2.0)
    changed = admin.update_team("ml", nominal_workers=5, borrowing_limit_workers=None)  # null clears the limit
    assert (changed["nominal_workers"], changed["borrowing_limit_workers"], changed["cohort"]) == (5, None, "c")
    assert "ml" in [t["name"] for t in admin.teams()]

    token = admin.issue_token("ml")
    ml = svc.client(token)
    assert ml.submit(SPEC)["team"] == "ml"
    assert admin.revoke_tokens("ml") == 1
    with pytest.raises(ServiceRequestError) as err:
        ml.jobs()
    assert err.value.status == 401

    for call, field in ((lambda: admin.add_team("ml", 1), "team.name"),
                        (lambda: admin.add_team("admin", 1), "team.name"),
                        (lambda: admin.add_team("neg", -1), "team.nominal_workers"),
                        (lambda: admin.update_team("ml", lending_limit_workers=9), "team.lending_limit_workers")):
        with pytest.raises(ServiceRequestInvalid) as bad:
            call()
        assert bad.value.field == field and bad.value.status == 400
    with pytest.raises(ServiceRequestError, match="HTTP 404: unknown team 'nope'") as missing:
        admin.issue_token("nope")
    assert missing.value.status == 404
    assert svc.store.team("ml").nominal_workers == 5
    results = [(r.action, r.target, r.result) for r in svc.store.audit_log(actor="admin")]
    assert ("add_team", "team ml", "ok") in results and ("issue_token", "team ml", "ok") in results
    assert ("revoke_tokens", "team ml", "ok") in results


FLAVORS = [{"name": "spot-cpu", "market": "spot", "resources": ["cpu"], "usd_per_cpu_hour": 0.01, "max_cpu": 64},
           {"name": "on-demand-cpu", "market": "on-demand", "resources": ["cpu", "memory_gb"],
            "usd_per_cpu_hour": 0.04},
           {"name": "spot-a10g", "market": "spot", "accelerator": "A10G", "resources": ["gpu"],
            "usd_per_gpu_hour": 0.35}]


def test_the_admin_sets_flavors_and_a_teams_quotas_per_flavor(sqlite_service):
    """The flavor table and per-flavor quotas through the API and the client: set, read back by any
    token, checked (a quota on a flavor the table does not have, a resource it does not count), and
    a submit whose shape fits no flavor is refused on the spec's field, writing nothing."""
    svc = sqlite_service
    admin, team = svc.client(svc.admin), svc.client(svc.a)
    assert team.flavors() == []
    try:
        _flavors_and_quotas(svc, admin, team)
    finally:  # the module's service is shared: back to no table for the tests after this one
        admin.set_flavors([])


def _flavors_and_quotas(svc, admin, team) -> None:
    jobs_before = len(svc.store.jobs())
    with pytest.raises(ServiceRequestError, match="HTTP 403: setting the flavor table needs an admin token"):
        team.set_flavors(FLAVORS)
    table = admin.set_flavors(FLAVORS)
    assert [f["name"] for f in table] == ["spot-cpu", "on-demand-cpu", "spot-a10g"]
    assert table[0] | {"capacity": None} == {"name": "spot-cpu", "market": "spot", "accelerator": "", "resources": ["cpu"],
                                             "usd_per_cpu_hour": 0.01, "usd_per_gpu_hour": 0.0,
                                             "usd_per_memory_gb_hour": 0.0, "max_cpu": 64.0, "max_gpu": None,
                                             "max_memory_gb": None, "capacity": None}
    assert team.flavors() == table
    assert svc.store.flavors()[2] == ResourceFlavor("spot-a10g", "spot", "A10G", ("gpu",), usd_per_gpu_hour=0.35)

    changed = admin.set_quotas("a", "spot-cpu", {"cpu": {"nominal": 16, "borrowing_limit": 8}})
    assert changed["quotas"] == [{"flavor": "spot-cpu", "resource": "cpu", "nominal": 16.0, "borrowing_limit": 8.0,
                                  "lending_limit": None}]
    assert svc.store.team("a").quota("spot-cpu", "cpu") == (16.0, 8.0, None)
    for call, status, field, words in (
            (lambda: admin.set_quotas("a", "gpu-x", {"gpu": 1}), 400, "quota.flavor", "the service's flavors: spot-cpu"),
            (lambda: admin.set_quotas("a", "spot-cpu", {"gpu": 1}), 400, "quotas[0].resource", "spot-cpu counts cpu"),
            (lambda: admin.set_quotas("a", "spot-cpu", {"cpu": {"nominal": 1, "lending_limit": 2}}), 400,
             "quota.lending_limit", "must not exceed nominal"),
            (lambda: admin.set_flavors(FLAVORS + [dict(FLAVORS[0], name="spot-again")]), 400, "flavors[3]",
             "one flavor per kind of node")):
        with pytest.raises(ServiceRequestError) as bad:
            call()
        assert (bad.value.status, getattr(bad.value, "field", None)) == (status, field) and words in str(bad.value)
    assert admin.set_quotas("a", "spot-cpu", {})["quotas"] == []  # cleared

    with pytest.raises(ServiceRequestInvalid) as bad:
        team.submit(SPEC, overrides=["resources.gpus_per_worker=1", "resources.accelerator_type=H100"])
    assert bad.value.field == "spec.resources.accelerator_type" and "spot-a10g has A10G" in str(bad.value)
    assert len(svc.store.jobs()) == jobs_before
    results = [(r.action, r.result) for r in svc.store.audit_log(actor="admin")]
    assert ("set_flavors", "ok") in results and ("set_quotas", "ok") in results


# ----------------------------------------------------------------------------- rejected submits


@pytest.mark.parametrize("spec, overrides, field", [
    ({"resources": {"num_workers": "two"}}, [], "spec.resources.num_workers"),
    ({"resources": {"num_wrokers": 2}}, [], "spec.resources.num_wrokers"),
    ({"elastic": {"min_workers": 3}, "resources": {"num_workers": 2}}, [], "spec.elastic.min_workers"),
    (SPEC, ["train.max_steps=-4"], "spec.train.max_steps"),
    ({"train": {"stop_at_step": 5}}, [], "spec.train.stop_at_step"),
    (SPEC, ["not-an-override"], "overrides"),
    ("resources: {num_workers: 2\n", [], "spec"),
    ("- a list\n", [], "spec"),
], ids=["a field of the wrong type", "an unknown field", "min_workers above num_workers",
        "an override out of range", "a stop step (a service job is paused instead)", "a malformed override",
        "YAML that does not parse", "YAML that is not a mapping"])
def test_a_malformed_spec_is_400_naming_the_field_and_writes_nothing(sqlite_service, spec, overrides, field):
    svc = sqlite_service
    before = svc.store.count_jobs()
    with pytest.raises(ServiceRequestInvalid) as err:
        svc.client(svc.a).submit(spec, overrides=overrides)
    assert isinstance(err.value, ServiceInputError) and err.value.field == field, err.value
    assert field in str(err.value) and str(err.value).startswith("HTTP 400: ")
    assert svc.store.count_jobs() == before


def test_an_unknown_team_and_a_min_workers_that_never_fits_are_rejected(service):
    admin = service.client(service.admin)
    before = service.store.count_jobs()
    with pytest.raises(ServiceRequestInvalid, match="unknown team 'zz'") as err:
        admin.submit(SPEC, team="zz")
    assert err.value.field == "team"
    with pytest.raises(ServiceRequestInvalid, match="an admin token must name the team"):
        admin.submit(SPEC)
    # Team b: nominal 2 + borrowing limit 1 = 3 at most, however idle the cohort.
    never = {**SPEC, "resources": {"num_workers": 4}, "elastic": {"min_workers": 4, "max_workers": 4}}
    with pytest.raises(ServiceRequestInvalid, match=r"min_workers 4 is more than team b could ever get: 3") as err:
        service.client(service.b).submit(never)
    assert err.value.field == "spec.elastic.min_workers"
    gang = {**SPEC, "resources": {"num_workers": 4}, "elastic": {"min_workers": 1}}  # no max: a gang of 4
    with pytest.raises(ServiceRequestInvalid, match=r"min_workers 4 .* team b .*a gang of resources.num_workers") as err:
        service.client(service.b).submit(gang)
    assert err.value.field == "spec.resources.num_workers"
    assert service.store.count_jobs() == before
    assert service.client(service.b).submit(never, overrides=["elastic.min_workers=3"])["min_workers"] == 3


def test_an_integral_number_is_its_int_in_every_integer_field(tmp_path):
    """JSON Schema's integer (the published schema's) is any number without a fraction: 3.0 in a
    body, "3.0" or "1e+3" in a query or a path is 3 (1000), stored as the int; 2.5, "3" in a
    body and true stay refused, naming the field."""
    svc, handle = _start(f"sqlite:///{tmp_path}/integral.db", tmp_path)
    try:
        status, job = raw(svc, "POST", "/v1/jobs", svc.admin, {"spec": SPEC, "team": "a", "priority": 3.0})
        assert status == 201 and job["priority"] == 3 and svc.store.job(job["id"]).priority == 3
        status, team = raw(svc, "POST", "/v1/teams", svc.admin, {"name": "floats", "nominal_workers": 185.0,
                                                                 "borrowing_limit_workers": 2.0})
        assert status == 201 and (team["nominal_workers"], team["borrowing_limit_workers"]) == (185, 2)
        status, team = raw(svc, "PUT", "/v1/teams/floats", svc.admin, {"lending_limit_workers": 1e2})
        assert status == 200 and svc.store.team("floats").lending_limit_workers == 100
        status, got = raw(svc, "GET", f"/v1/jobs/{job['id']}.0", svc.admin)
        assert status == 200 and got["id"] == job["id"]
        status, _ = raw(svc, "GET", f"/v1/jobs/{job['id']}/logs?offset=0.0&limit=1e%2B3", svc.admin)
        assert status == 200
        for body, field in [({"spec": SPEC, "team": "a", "priority": 2.5}, "priority"),
                            ({"spec": SPEC, "team": "a", "priority": "3"}, "priority"),
                            ({"spec": SPEC, "team": "a", "priority": True}, "priority")]:
            status, refused = raw(svc, "POST", "/v1/jobs", svc.admin, body)
            assert (status, refused["field"]) == (400, field), refused
        status, refused = raw(svc, "POST", "/v1/teams", svc.admin, {"name": "halves", "nominal_workers": 2.5})
        assert (status, refused["field"]) == (400, "team.nominal_workers")
        status, refused = raw(svc, "GET", f"/v1/jobs/{job['id']}/logs?offset=0.5", svc.admin)
        assert (status, refused["field"]) == (400, "offset")
    finally:
        handle.stop()
        svc.store.close()


def test_a_bad_request_body_is_400_naming_the_field(sqlite_service):
    status, body = raw(sqlite_service, "POST", "/v1/jobs", sqlite_service.a, {"spec": SPEC, "priority": "high"})
    assert status == 400 and body["field"] == "priority"
    status, body = raw(sqlite_service, "POST", "/v1/jobs", sqlite_service.a, {"priority": 1})
    assert status == 400 and body["field"] == "spec"


# ----------------------------------------------------------------------------- logs


def test_logs_before_and_while_written_and_follow_until_the_job_ends(sqlite_service):
    svc = sqlite_service
    a = svc.client(svc.a)
    job = a.submit(SPEC)["id"]
    assert a.logs(job) == ""  # the runner has not written it yet: empty, not 404
    assert a.log_chunk(job, 0) == (b"", 0)
    svc.log_dir.mkdir(exist_ok=True)
    log = svc.log_dir / f"job-{job}.log"
    log.write_bytes("step 1 loss 2.0 \u2713\n".encode())
    assert a.logs(job) == "step 1 loss 2.0 \u2713\n"
    first, offset = a.log_chunk(job, 0)
    assert offset == len(first) == log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"step 2 loss 1.5\n")
    assert a.log_chunk(job, offset) == (b"step 2 loss 1.5\n", offset + 16)
    assert a.log_chunk(job, 10_000)[0] == b""  # past the end: nothing, from the end

    a.cancel(job)  # ended: follow reads what is there and stops
    assert "".join(a.logs(job, follow=True, poll_s=0.05)) == "step 1 loss 2.0 \u2713\nstep 2 loss 1.5\n"
    status, text = raw(svc, "GET", f"/v1/jobs/{job}/logs?offset=5", svc.a)
    assert (status, text) == (200, "1 loss 2.0 \u2713\nstep 2 loss 1.5\n")


# ----------------------------------------------------------------------------- tokens stay secret


def test_no_token_in_logs_errors_or_the_audit_table(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    svc, handle = _start(f"sqlite:///{tmp_path}/secret.db", tmp_path)
    try:
        admin, a = svc.client(svc.admin), svc.client(svc.a)
        new_token = admin.issue_token("b")
        job = a.submit(SPEC)["id"]
        a.pause(job)
        errors = []
        for call in (lambda: svc.client(new_token).cancel(job), lambda: a.pause(job),
                     lambda: svc.client(svc.a + "x").jobs(), lambda: a.add_team("t", 1)):
            with pytest.raises(ServiceRequestError) as err:
                call()
            errors.append(str(err.value))
        # A token put in a URL by mistake: refused (tokens go in the header) and blanked in the access log.
        status, body = raw(svc, "GET", f"/v1/jobs?token={svc.a}")
        assert status == 401
        errors.append(json.dumps(body))
        logging.getLogger("raytrain_sys.service.api").info("a careless line with %s", svc.a)
    finally:
        handle.stop()
    secrets_ = (svc.admin, svc.a, svc.b, new_token)
    assert "GET /v1/jobs" in caplog.text  # uvicorn's access log was captured
    with svc.store.engine.connect() as conn:
        every_row = "\n".join(repr(tuple(r)) for t in metadata.sorted_tables for r in conn.execute(select(t)))
    svc.store.close()
    for secret in secrets_:
        assert secret not in caplog.text
        assert secret[4:] not in caplog.text  # not even without its prefix
        assert secret not in every_row
        assert not any(secret in e for e in errors)
    assert "rts_***" in caplog.text
    assert "Client(" in repr(admin) and svc.admin not in repr(admin)


# ----------------------------------------------------------------------------- openapi, client errors


def test_openapi_describes_every_endpoint_with_typed_models(sqlite_service):
    status, doc = raw(sqlite_service, "GET", "/openapi.json")
    assert status == 200
    paths = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert paths >= {("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}"),
                     ("GET", "/v1/jobs/{job_id}/transitions"), ("GET", "/v1/jobs/{job_id}/logs"),
                     ("POST", "/v1/jobs/{job_id}/pause"), ("POST", "/v1/jobs/{job_id}/resume"),
                     ("POST", "/v1/jobs/{job_id}/cancel"), ("GET", "/v1/teams"), ("POST", "/v1/teams"),
                     ("PUT", "/v1/teams/{name}"), ("POST", "/v1/teams/{name}/tokens"),
                     ("DELETE", "/v1/teams/{name}/tokens"), ("GET", "/healthz"),
                     ("PUT", "/v1/packages/{sha256}"), ("GET", "/v1/packages/{sha256}"),
                     ("PUT", "/v1/teams/{name}/packages/{sha256}"), ("GET", "/v1/teams/{name}/packages/{sha256}")}
    # What the server needs, the schema says: a package's team is in its path (the token's own
    # team's path takes no team), and a sweep names its base, space and metric.
    for method in ("put", "get"):
        assert [p["name"] for p in doc["paths"]["/v1/packages/{sha256}"][method]["parameters"]] == ["sha256"]
        team_path = doc["paths"]["/v1/teams/{name}/packages/{sha256}"][method]["parameters"]
        assert [(p["name"], p["in"], p["required"]) for p in team_path] == [("name", "path", True),
                                                                            ("sha256", "path", True)]
    schemas = doc["components"]["schemas"]
    sweep = schemas["SweepSubmitIn"]["properties"]["sweep"]["anyOf"][0]
    assert sweep["required"] == ["base", "space", "metric"] and sweep["additionalProperties"] is False
    assert set(schemas["JobState"]["enum"]) == {s.value for s in JobState}
    assert set(schemas["WaitCause"]["enum"]) == {c.value for c in WaitCause}
    job = schemas["JobOut"]
    assert {"wait_cause", "wait_reason", "wait_cause_since_s", "start_returns"} <= set(job["required"])
    assert job["properties"]["wait_cause"]["anyOf"] == [{"$ref": "#/components/schemas/WaitCause"}, {"type": "null"}]
    assert {"spec", "team", "priority", "overrides", "package"} <= set(schemas["SubmitIn"]["properties"])
    assert "409" in doc["paths"]["/v1/jobs/{job_id}/pause"]["post"]["responses"]


def test_openapi_describes_the_spec_by_its_sections_and_fields(sqlite_service):
    """A submit's spec is described by the job spec's own model (raytrain_sys.spec.json_schema):
    every section and field with its type, default and description, and the YAML text beside it."""
    import dataclasses

    import jsonschema

    from raytrain_sys.spec import JobSpec

    status, doc = raw(sqlite_service, "GET", "/openapi.json")
    assert status == 200
    mapping, text = doc["components"]["schemas"]["SubmitIn"]["properties"]["spec"]["anyOf"]
    assert text["type"] == "string"
    assert mapping["type"] == "object" and mapping["additionalProperties"] is False
    assert set(mapping["properties"]) == {f.name for f in dataclasses.fields(JobSpec)}
    resources = mapping["properties"]["resources"]["anyOf"][0]
    assert set(resources["properties"]) == {f.name for f in dataclasses.fields(JobSpec().resources)}
    workers = resources["properties"]["num_workers"]
    assert workers["type"] == "integer" and workers["default"] == 2 and "Ray actor" in workers["description"]
    assert resources["properties"]["market"]["enum"] == ["any", "spot", "on-demand"]
    jsonschema.validate(SPEC, mapping)  # the spec these tests submit
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"resources": {"num_wrokers": 2}}, mapping)


def test_an_unreachable_service_is_one_error_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    client = Client(f"http://127.0.0.1:{port}", "rts_x")
    with pytest.raises(ServiceRequestError) as err:
        client.jobs()
    assert err.value.status is None
    assert str(err.value).startswith(f"cannot reach the job service at http://127.0.0.1:{port}: ")
    assert err.value.__cause__ is None and err.value.__suppress_context__


# ----------------------------------------------------------------------------- CLI


def cli(svc: Service, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAYTRAIN_SYS_SERVICE_URL": svc.url,
           "RAYTRAIN_SYS_TOKEN": token or svc.a}
    return subprocess.run([sys.executable, "-m", "raytrain_sys.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raytrain-sys: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_cli_jobs_commands(sqlite_service, tmp_path):
    svc = sqlite_service
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = cli(svc, "jobs", "submit", str(spec), "--priority", "2", "--set", "train.max_steps=90")
    assert out.returncode == 0, out.stderr
    job = int(out.stdout.split()[1])
    assert out.stdout.startswith(f"job {job} queued: tiny for team a, 1..2 workers, priority 2")
    assert json.loads(svc.store.job(job).spec)["train"]["max_steps"] == 90

    listed = cli(svc, "jobs", "list", "--state", "queued")
    assert listed.returncode == 0
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "TEAM", "NAME", "STATE", "PRI", "WORKERS", "AGE", "REASON"]
    assert any(r.split()[:5] == [str(job), "a", "tiny", "queued", "2"] for r in rows)

    assert cli(svc, "jobs", "pause", str(job)).stdout.strip() == f"job {job}: queued (held)"
    status = cli(svc, "jobs", "status", str(job))
    assert status.returncode == 0 and "queued (held by its team)" in status.stdout
    assert "paused by a" in status.stdout
    assert cli(svc, "jobs", "resume", str(job)).stdout.strip() == f"job {job}: queued"

    svc.log_dir.mkdir(exist_ok=True)
    (svc.log_dir / f"job-{job}.log").write_text("hello from the runner\n")
    assert cli(svc, "jobs", "cancel", str(job), "--delete-checkpoints").stdout.strip() == f"job {job}: cancelled"
    assert svc.store.job(job).delete_checkpoints is True
    followed = cli(svc, "jobs", "logs", str(job), "--follow")
    assert (followed.returncode, followed.stdout) == (0, "hello from the runner\n")

    # User errors: one line, exit 2.
    assert "HTTP 409: job" in one_line_error(cli(svc, "jobs", "cancel", str(job)))
    assert "HTTP 403" in one_line_error(cli(svc, "jobs", "status", str(job), token=svc.b))
    assert "HTTP 404: no job 999999" in one_line_error(cli(svc, "jobs", "status", "999999"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources: {num_workers: two}\n")
    assert "resources.num_workers" in one_line_error(cli(svc, "jobs", "submit", str(bad)))
    assert "does not exist" in one_line_error(cli(svc, "jobs", "submit", str(tmp_path / "missing.yaml")))
    assert "HTTP 401" in one_line_error(cli(svc, "jobs", "list", token="rts_wrong"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert f"cannot reach the job service at http://127.0.0.1:{port}" in one_line_error(
        cli(svc, "jobs", "list", "--url", f"http://127.0.0.1:{port}"))


def test_cli_teams_and_init_admin(sqlite_service):
    svc = sqlite_service
    # init-admin opens the store itself (the database URL is the root credential).
    made = subprocess.run([sys.executable, "-m", "raytrain_sys.cli.main", "service", "init-admin", "--db", svc.db_url],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    admin = made.stdout.strip()
    assert admin.startswith("rts_") and "shown once" in made.stderr and admin not in made.stderr

    added = cli(svc, "teams", "add", "vision", "--nominal", "2", "--cohort", "c", "--borrowing-limit", "1",
                token=admin)
    assert (added.returncode, added.stdout.strip()) == (0, "team vision added: nominal 2 workers")
    updated = cli(svc, "teams", "update", "vision", "--weight", "3", token=admin)
    assert updated.returncode == 0 and "weight 3" in updated.stdout
    listed = cli(svc, "teams", "list", token=admin)
    assert listed.stdout.splitlines()[0].split() == ["TEAM", "NOMINAL", "COHORT", "BORROW", "LEND", "WEIGHT"]
    assert ["vision", "2", "c", "1", "-", "3"] in [r.split() for r in listed.stdout.splitlines()]
    assert cli(svc, "teams", token=admin).stdout == listed.stdout  # list is the default
    env_free = cli(svc, "teams", "--url", svc.url, "--token", admin, token="rts_not-this-one")
    assert env_free.stdout == listed.stdout  # the options win over the environment, before the action too
    assert cli(svc, "teams", "list", "--token", admin, token="rts_not-this-one").stdout == listed.stdout

    token = cli(svc, "teams", "token", "vision", token=admin)
    assert token.returncode == 0 and svc.store.authenticate(token.stdout.strip()).team == "vision"

    assert "--nominal" in one_line_error(cli(svc, "teams", "update", "vision", token=admin))
    assert "HTTP 403: listing teams needs an admin token" in one_line_error(cli(svc, "teams", "list"))
    assert "team.nominal_workers" in one_line_error(cli(svc, "teams", "add", "x", "--nominal", "-1", token=admin))


def test_cli_flavors_and_quotas(sqlite_service, tmp_path):
    """`flavors set FILE`, `flavors list`, `teams quota NAME FLAVOR cpu=32/8/-` and what `teams
    list` then shows; a malformed quota is one line naming the form."""
    svc = sqlite_service
    table = tmp_path / "flavors.yaml"
    table.write_text("flavors:\n  - {name: spot-cpu, market: spot, resources: [cpu], usd_per_cpu_hour: 0.01, "
                     "max_cpu: 64}\n  - {name: on-demand-cpu, market: on-demand, resources: [cpu]}\n")
    try:
        made = cli(svc, "flavors", "set", str(table), token=svc.admin)
        assert (made.returncode, made.stdout.strip()) == (0, "flavor table set: spot-cpu, on-demand-cpu"), made
        listed = cli(svc, "flavors")
        assert listed.stdout.splitlines()[0].split()[:4] == ["FLAVOR", "MARKET", "ACCELERATOR", "COUNTS"]
        assert listed.stdout.splitlines()[1].split()[:4] == ["spot-cpu", "spot", "-", "cpu"] and "cpu 64" in listed.stdout
        quota = cli(svc, "teams", "quota", "a", "spot-cpu", "cpu=32/8/-", token=svc.admin)
        assert (quota.returncode, quota.stdout.strip()) == (0, "team a on spot-cpu: cpu 32/8/-"), quota
        teams = cli(svc, "teams", "list", token=svc.admin).stdout.splitlines()
        assert teams[0].split()[-1] == "QUOTAS" and any(r.endswith("spot-cpu cpu 32/8/-") for r in teams), teams
        assert "RESOURCE=NOMINAL[/BORROW[/LEND]]" in one_line_error(
            cli(svc, "teams", "quota", "a", "spot-cpu", "cpu:32", token=svc.admin))
        cleared = cli(svc, "teams", "quota", "a", "spot-cpu", token=svc.admin)
        assert cleared.stdout.strip() == "team a on spot-cpu: no quota (nominal 0, borrowing from its cohort)"
    finally:
        svc.store.set_flavors([])
    assert cli(svc, "flavors").stdout.startswith("no flavor table: one implicit flavor counts workers")


# ----------------------------------------------------------------------------- code packages


def _code_dir(root: Path, text: str = "def build(model_spec):\n    return None\n") -> Path:
    code = root / "code"
    (code / "mypkg").mkdir(parents=True, exist_ok=True)
    (code / "mypkg" / "models.py").write_text(text)
    (code / "mypkg" / "__init__.py").write_text("")
    return code


def test_a_package_is_kept_once_per_team_and_only_its_team_submits_with_it(service, tmp_path):
    code = _code_dir(tmp_path)
    a, b = service.client(service.a), service.client(service.b)
    info = a.upload_package(code)
    assert (info["team"], info["files"]) == ("a", 2) and info["size_bytes"] > 0
    assert service.store.package_data(info["sha256"]) == packages.pack(code)
    again = a.upload_package(code)  # the same files: found, not sent again
    assert again == info
    assert [r.result for r in service.store.audit_log() if r.action == "upload"] == ["ok"]

    job = a.submit(SPEC, working_dir=code)
    assert job["package"] == info["sha256"] and service.store.job(job["id"]).package == info["sha256"]
    assert a.job(job["id"])["package"] == info["sha256"]
    with pytest.raises(ServiceRequestInvalid) as other:  # b never uploaded it
        b._json("POST", "/v1/jobs", {"spec": SPEC, "package": info["sha256"]})
    assert other.value.field == "package" and "team b has uploaded no package" in str(other.value)
    with pytest.raises(ServiceRequestError) as foreign:
        a.upload_package(code, team="b")
    assert foreign.value.status == 403
    assert a.upload_package(code, team="a") == info  # its own team, named
    admin = service.client(service.admin)
    with pytest.raises(ServiceRequestError) as teamless:  # the token's own team's path: the admin has none
        admin.upload_package(code)
    assert teamless.value.status == 403 and "/v1/teams/{name}/packages/{sha256}" in str(teamless.value)
    with pytest.raises(ServiceRequestError) as unknown:
        admin.upload_package(code, team="nosuchteam")
    assert unknown.value.status == 404
    assert admin.upload_package(code, team="b")["team"] == "b"  # the admin uploads for a team
    assert b._json("POST", "/v1/jobs", {"spec": SPEC, "package": info["sha256"]})["package"] == info["sha256"]


def test_a_package_that_is_not_what_it_says_is_refused_and_nothing_is_kept(service, tmp_path):
    data = packages.pack(_code_dir(tmp_path, text="REFUSED = True\n"))  # no other test's package
    sha = packages.digest(data)
    client = service.client(service.a)
    for body, name, words in [(data[:-10], sha, "not " + sha),  # cut short on the way
                              (b"not a zip at all", packages.digest(b"not a zip at all"), "not a zip file"),
                              (data, "ABC", "64 lower-case hex digits")]:
        with pytest.raises(ServiceRequestInvalid) as refused:
            client._request("PUT", f"/v1/packages/{name}", raw=body)
        assert refused.value.field == "package" and words in str(refused.value), str(refused.value)
    escaping = io.BytesIO()
    with zipfile.ZipFile(escaping, "w") as zf:
        zf.writestr("../outside.py", "x = 1\n")
    with pytest.raises(ServiceRequestInvalid) as outside:
        client._request("PUT", f"/v1/packages/{packages.digest(escaping.getvalue())}", raw=escaping.getvalue())
    assert "'../outside.py' is not a path inside the package" in str(outside.value)
    with pytest.raises(ServiceRequestError) as missing:
        client._json("GET", f"/v1/packages/{sha}")
    assert missing.value.status == 404
    assert service.store.package_data(sha) is None


def test_pack_is_the_files_content_and_leaves_out_what_it_should(tmp_path):
    code = _code_dir(tmp_path)
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "models.cpython-311.pyc").write_bytes(b"\0" * 100)
    (code / ".git").mkdir()
    (code / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (code / "data").mkdir()
    (code / "data" / "rows.parquet").write_bytes(b"PAR1" * 1000)
    first = packages.pack(code, excludes=["data"])
    assert sorted(zipfile.ZipFile(io.BytesIO(first)).namelist()) == ["mypkg/__init__.py", "mypkg/models.py"]
    os.utime(code / "mypkg" / "models.py", (1_000_000_000, 1_000_000_000))  # touched, not changed
    assert packages.pack(code, excludes=["data"]) == first
    (code / "mypkg" / "models.py").write_text("def build(model_spec):\n    return 1\n")
    assert packages.digest(packages.pack(code, excludes=["data"])) != packages.digest(first)
    assert "data/rows.parquet" in zipfile.ZipFile(io.BytesIO(packages.pack(code))).namelist()


def test_pack_refuses_what_cannot_travel_naming_the_field_and_the_largest_files(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="working_dir: .* is not a directory"):
        packages.pack(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="working_dir: .* has no files to send"):
        packages.pack(tmp_path / "empty")
    code = _code_dir(tmp_path)
    (code / "weights.bin").write_bytes(os.urandom(300_000))
    monkeypatch.setattr(packages, "MAX_BYTES", 200_000)
    with pytest.raises(UserError) as big:
        packages.pack(code)
    assert "over the 0.2 MiB a package may have; the largest: weights.bin (0.3 MiB)" in str(big.value)
    assert "--exclude" in str(big.value)
    assert packages.pack(code, excludes=["*.bin"])  # left out, it travels


def test_cli_submit_with_a_working_dir(sqlite_service, tmp_path):
    code = _code_dir(tmp_path)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = cli(sqlite_service, "jobs", "submit", str(spec), "--working-dir", str(code), "--exclude", "*.md")
    assert out.returncode == 0, out.stderr
    sha = packages.digest(packages.pack(code))
    assert out.stdout.strip().endswith(f"code package {sha[:12]}")
    job = int(out.stdout.split()[1])
    assert sqlite_service.store.job(job).package == sha
    assert f"code        package {sha} (its working directory)" in cli(sqlite_service, "jobs", "status", str(job)).stdout
    assert "is not a directory" in one_line_error(cli(sqlite_service, "jobs", "submit", str(spec),
                                                      "--working-dir", str(tmp_path / "nowhere")))


def test_a_package_pruned_between_the_check_and_the_submit_is_uploaded_again(sqlite_service, tmp_path):
    svc = sqlite_service
    code = _code_dir(tmp_path, text="PRUNED = True\n")  # no other test's package
    sha = packages.digest(packages.pack(code))
    pruned = []

    class PrunedMeanwhile(Client):
        def upload_package(self, *args, **kwargs):
            info = super().upload_package(*args, **kwargs)
            if not pruned:  # the service's hourly prune lands right after the first check
                pruned.extend(p for p in svc.store.prune_packages(time.time() + 1) if p[0] == sha)
            return info

    job = PrunedMeanwhile(svc.url, svc.a).submit(SPEC, working_dir=code)
    assert pruned == [(sha, "a")]
    assert job["package"] == sha and svc.store.package_data(sha) == packages.pack(code)
    assert [r.result for r in svc.store.audit_log() if r.action == "upload" and sha[:12] in r.target] == ["ok", "ok"]


# ----------------------------------------------------------------------------- the front door (issue 25)


@pytest.fixture(scope="module")
def postgres_service(postgres_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("pg-service")
    svc, handle = _start(postgres_server.create_database(f"door_{os.getpid()}_{time.monotonic_ns()}"), root)
    yield svc
    handle.stop()
    svc.store.close()


@pytest.fixture(params=["sqlite", "postgres"])
def door_service(request):
    """The module's service on SQLite or on PostgreSQL: the front door's tests leave nothing but
    audit rows, so they share one of each (a fresh PostgreSQL database a test costs a second)."""
    return request.getfixturevalue(f"{request.param}_service")



def send(svc: Service, method: str, path: str, token: str | None = None, data: bytes | None = None,
         content_type: str | None = "application/json", headers: dict | None = None) -> tuple[int, dict, dict]:
    """One request with a raw body; (status, JSON answer, response headers)."""
    import http.client

    host, port = svc.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    sent = {**({"Authorization": f"Bearer {token}"} if token else {}),
            **({"Content-Type": content_type} if content_type and data is not None else {}), **(headers or {})}
    conn.request(method, path, body=data, headers=sent)
    resp = conn.getresponse()
    status, answer, got = resp.status, resp.read(), dict(resp.getheaders())
    conn.close()
    return status, json.loads(answer), got


def refused_shape(status: int, answer: dict, headers: dict) -> str:
    """The documented refusal: ErrorOut JSON, one line, a field that is a name (never an offset)."""
    assert headers["content-type"] == "application/json", headers
    assert set(answer) == {"error", "field"} and "\n" not in answer["error"], answer
    assert answer["field"] is None or not str(answer["field"]).isdigit(), answer
    return answer["error"]


def last_audit(store: Store, actor: str):
    return store.audit_log(actor=actor, limit=1)[0]


@pytest.mark.parametrize("method, path, body, status, field", [
    ("POST", "/v1/jobs", {"spec": SPEC, "team": "a", "priority": 2 ** 70}, 400, "priority"),
    ("POST", "/v1/jobs", {"spec": {**SPEC, "resources": {"num_workers": 10 ** 30}}, "team": "a"}, 400,
     "spec.resources.num_workers"),
    ("POST", "/v1/jobs", {"spec": {**SPEC, "resources": {"num_workers": 200_000}, "elastic": {},
                                   "train": {"global_batch_size": 10 ** 6}}, "team": "a"}, 400,
     "spec.resources.num_workers"),
    ("POST", "/v1/teams", {"name": "huge", "nominal_workers": 2 ** 70}, 400, "team.nominal_workers"),
    ("PUT", "/v1/teams/a", {"lending_limit_workers": 2 ** 64}, 400, "team.lending_limit_workers"),
    ("PUT", "/v1/teams/a", {"weight": 1e300}, 400, "team.weight"),
    ("GET", f"/v1/jobs/{2 ** 70}", None, 404, "job_id"),
    ("GET", f"/v1/jobs/{2 ** 40}", None, 404, "job_id"),
    ("POST", f"/v1/jobs/{2 ** 70}/cancel", None, 404, "job_id"),
    ("GET", "/v1/jobs/1/logs?offset=" + str(2 ** 70), None, 400, "offset"),
], ids=["a priority of 71 bits", "a job of 10**30 workers", "a job of more workers than any cluster",
        "a quota of 71 bits", "a lending limit of 65 bits", "a weight of 1e300", "a job id of 71 bits",
        "a job id past the id column (PostgreSQL INTEGER)", "a cancel of a job id of 71 bits",
        "a log offset of 71 bits"])
def test_a_number_out_of_bounds_never_reaches_the_database(door_service, method, path, body, status, field):
    """Every integer a request carries is bounded by its schema (body and query: 400 naming the
    field; a path id that cannot exist: 404) or by the spec's and the store's bounds, whichever
    store: nothing is written, and the refusal is audited under the token's principal."""
    before_jobs, before_teams = door_service.store.count_jobs(), door_service.store.teams()
    status_got, answer, headers = send(door_service, method, path, door_service.admin,
                                       None if body is None else json.dumps(body).encode())
    message = refused_shape(status_got, answer, headers)
    assert (status_got, answer["field"]) == (status, field), answer
    assert door_service.store.count_jobs() == before_jobs and door_service.store.teams() == before_teams
    row = last_audit(door_service.store, "admin")
    assert row.result.startswith(f"refused ({status})") and message in row.result, row


def test_a_body_over_its_limit_is_413_before_it_is_read_and_audited(door_service):
    """A body's limit (1 MiB for JSON, 64 MiB for a package) is enforced from the declared length
    before reading any of it, and on a body without one as soon as it grows past; in the
    refusal's shape, audited, nothing written."""
    import http.client

    before = door_service.store.count_jobs()
    host, port = door_service.url.removeprefix("http://").split(":")
    for path, declared, field in (("/v1/jobs", 2 ** 31, "body"), (f"/v1/packages/{'0' * 64}", 65 * 2 ** 20, "package")):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.putrequest("POST" if path == "/v1/jobs" else "PUT", path)
        for name, value in (("Authorization", f"Bearer {door_service.a}"), ("Content-Type", "application/json"),
                            ("Content-Length", str(declared))):
            conn.putheader(name, value)
        conn.endheaders()  # and not one byte of the body: the answer must not wait for it
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        conn.close()
        assert resp.status == 413 and answer["field"] == field, answer
        assert f"{declared} bytes declared, over the" in answer["error"]
        assert ("1 MiB (1048576 bytes) a JSON body" if field == "body" else "64 MiB (67108864 bytes) a code package") \
            in answer["error"]

    # Chunked (no length declared): refused once it passes 1 MiB, the rest never sent.
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/jobs")
    for name, value in (("Authorization", f"Bearer {door_service.a}"), ("Content-Type", "application/json"),
                        ("Transfer-Encoding", "chunked")):
        conn.putheader(name, value)
    conn.endheaders()
    chunk = b'{"spec": "' + b"x" * (2 ** 16)
    for _ in range(2 ** 20 // len(chunk) + 1):
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and "over 1048576 bytes sent" in answer["error"], answer
    assert door_service.store.count_jobs() == before
    rows = door_service.store.audit_log(actor="a", limit=3)
    assert [r.result[:14] for r in rows] == ["refused (413):"] * 3, rows
    # The action column holds 64 characters: a longer path is cut, saying how long it was.
    assert [r.action for r in rows] == ["POST /v1/jobs", f"PUT /v1/packages/{'0' * 28}... (81 characters)",
                                        "POST /v1/jobs"]


def test_a_huge_bad_value_is_quoted_short_in_the_answer_and_the_audit(door_service):
    """A value of 900 KB (under the body limit) that is wrong is named by a short quote, in the
    answer and in the audit row, whichever layer refuses it (the schema, the spec, the store)."""
    long = "x" * 900_000
    for body, field in (({"spec": SPEC, "name": long}, "name"),  # the schema: at most 200 characters
                        ({"spec": {**SPEC, "name": long}}, "spec.name"),  # the store's bound, through the spec
                        ({"spec": {**SPEC, "model": {"name": long}}}, "spec.model.name"),  # the spec's rule
                        ({"spec": SPEC, "team": long}, "team")):  # a team's name
        status, answer, headers = send(door_service, "POST", "/v1/jobs", door_service.a, json.dumps(body).encode())
        message = refused_shape(status, answer, headers)
        assert (status, answer["field"]) == (400, field) and len(message) < 600, (field, message[:300])
        assert "(900000 characters)" in message, message
        row = last_audit(door_service.store, "a")
        assert len(row.result) < 1000 and row.result.startswith("refused (400)")
    with door_service.store.engine.connect() as conn:  # not stored anywhere, in any table
        assert not any(long[:1000] in repr(tuple(r)) for t in metadata.sorted_tables for r in conn.execute(select(t)))


MALFORMED = [
    (b'{"spec": {"name": "x"', "application/json", "the body is not valid JSON: Expecting ',' delimiter at line 1, "
                                                   "column 22", None),
    (b"", "application/json", "the request needs a JSON body: {spec, team, priority, name, overrides, package}", None),
    (b'{"spec": "\xff\xfe"}', "application/json", "the body is not UTF-8 text (byte 10", None),
    (b"[1, 2]", "application/json", "the body must be a JSON object {spec, team, priority, name, overrides, package}, "
                                    "got list", None),
    (b'{"spec": {}, "priority": NaN}', "application/json", "NaN is not a JSON number", None),
    (b'{"spec": {}, "priority": "high"}', "application/json", "field 'priority': got 'high'", "priority"),
    (b'{"spec": {}, "priority": 1.5}', "application/json", "field 'priority': got 1.5", "priority"),
    (b'{"priority": 1}', "application/json", "field 'spec': required", "spec"),
    (b'{"spec": {}, "colour": "red"}', "application/json", "field 'colour': unknown field", "colour"),
    (b'{"spec": {}, "overrides": ["a=1", "no equals sign"]}', "application/json",
     "field 'overrides': item 1: got 'no equals sign'; an override is one line", "overrides"),
    (b'{"spec": {}}', "text/plain", "the body must be JSON: send {spec, team, priority, name, overrides, package} "
                                    "with Content-Type: application/json", None),
    (b"[" * 100 + b"]" * 100, "application/json", "JSON nested more than 64 deep", None),
]


@pytest.mark.parametrize("data, content_type, words, field", MALFORMED, ids=[
    "JSON cut short", "no body", "bytes that are not UTF-8", "a list, not an object", "NaN", "a string for an integer",
    "a fraction for an integer (1.0 is 1)", "a required field missing", "an unknown field", "an override without '='",
    "not sent as JSON", "nested 100 deep"])
def test_a_malformed_body_is_a_400_in_the_documented_shape_and_audited(door_service, data, content_type, words, field):
    """Whatever layer refuses it (the front door, FastAPI's validation, our models), a body that
    is not the request is a 400 in ErrorOut naming the field (never a byte offset), and leaves
    one audit row under the token's principal; nothing is written."""
    before = door_service.store.count_jobs()
    rows_before = len(door_service.store.audit_log(actor="a"))
    status, answer, headers = send(door_service, "POST", "/v1/jobs", door_service.a, data, content_type)
    message = refused_shape(status, answer, headers)
    assert status == 400 and words in message and answer["field"] == field, answer
    assert door_service.store.count_jobs() == before
    rows = door_service.store.audit_log(actor="a")
    assert len(rows) == rows_before + 1 and rows[-1].result == f"refused (400): {message}", rows[-1]


def test_a_spec_too_large_to_be_one_is_refused_before_it_is_expanded(door_service):
    """YAML aliases can make 1 KB of text a billion values: counted as reached, the spec is
    refused at 10,000 values (or 32 levels), in milliseconds, naming the field."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
    bomb += "model: {args: {blow: *i}}\n"
    deep = {"model": {"args": {}}}
    node = deep["model"]["args"]
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    for spec, words in ((bomb, "holds more than 10000 values"), (deep, "is nested more than 32 deep")):
        start = time.monotonic()
        status, answer, headers = send(door_service, "POST", "/v1/jobs", door_service.a,
                                       json.dumps({"spec": spec}).encode())
        refused_shape(status, answer, headers)
        assert (status, answer["field"]) == (400, "spec") and words in answer["error"], answer
        assert time.monotonic() - start < 5


def test_a_cancel_only_field_is_declared_on_cancel_alone(door_service):
    job = door_service.client(door_service.a).submit(SPEC)["id"]
    for action in ("pause", "resume"):
        status, answer, headers = send(door_service, "POST", f"/v1/jobs/{job}/{action}", door_service.a,
                                       b'{"delete_checkpoints": true}')
        assert (status, answer["field"]) == (400, "delete_checkpoints") and "unknown field" in answer["error"]
    status, doc, _ = send(door_service, "GET", "/openapi.json")
    schemas = doc["components"]["schemas"]
    assert set(schemas["ActionIn"]["properties"]) == {"reason"} and schemas["ActionIn"]["additionalProperties"] is False
    assert set(schemas["CancelIn"]["properties"]) == {"reason", "delete_checkpoints"}
    assert door_service.store.job(job).state is JobState.QUEUED and not door_service.store.job(job).held


@pytest.mark.parametrize("method, path, status, words, allow", [
    ("GET", "/v1/nothing-here", 404, "no such path: GET '/v1/nothing-here'", None),
    ("DELETE", "/v1/jobs", 405, "'/v1/jobs' has no method DELETE; it has GET, POST", "GET, POST"),
    ("PATCH", "/v1/teams/a", 405, "has no method PATCH; it has PUT", "PUT"),
    ("GET", "/v1/jobs/1/cancel", 405, "it has POST", "POST"),
    ("PUT", "/v1/teams/a/tokens", 405, "it has DELETE, POST", "DELETE, POST"),
    ("GET", "/v1/jobs/abc", 404, "no job 'abc': a job's id is an integer 1..2147483647", None),
    ("GET", "/v1/jobs?state=bogus", 400, "field 'state': item 0: got 'bogus'", None),
    ("GET", "/v1/jobs?team=a%2Fb", 400, "field 'team': got 'a/b'; a team's name has 1-64 characters", None),
    ("GET", "/v1/jobs/1/logs?limit=0", 400, "field 'limit': got '0'", None),
    ("GET", "/" + "x" * 5000, 404, "(5001 characters)", None),
], ids=["an unknown path", "a method /v1/jobs does not have", "PATCH of a team", "GET of an action",
        "PUT of tokens", "a job id that is not a number", "a state that does not exist", "a team name with '/'",
        "a log limit of 0", "a path of 5,000 characters"])
def test_every_other_refusal_is_in_the_documented_shape_and_audited(door_service, method, path, status, words, allow):
    status_got, answer, headers = send(door_service, method, path, door_service.a)
    message = refused_shape(status_got, answer, headers)
    assert status_got == status and words in message, answer
    assert headers.get("allow") == allow
    row = last_audit(door_service.store, "a")
    assert row.result == f"refused ({status}): {message}"[:1000] and len(row.action) <= 64, row


def test_a_refusal_before_authentication_is_audited_as_unauthenticated(door_service):
    status, answer, headers = send(door_service, "POST", "/v1/jobs", None, b"{not json")
    refused_shape(status, answer, headers)
    row = last_audit(door_service.store, "unauthenticated")
    assert row.action == "POST /v1/jobs" and row.result.startswith("refused (400): the body is not valid JSON")
    status, answer, headers = send(door_service, "POST", "/v1/jobs", "rts_not-a-token", b"{}")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert last_audit(door_service.store, "unauthenticated").result.startswith("refused (401)")


BAD_NAMES = ["bad/name", "Upper", "équipe", "two\nlines", "admin", "-edge", "edge-", "x" * 64, "", "a b", "a_b"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=["a slash", "upper case", "not ASCII", "a newline", "reserved",
                                                  "a leading dash", "a trailing dash", "64 characters", "empty",
                                                  "a space", "an underscore"])
def test_a_team_name_is_held_to_one_rule_by_the_api_the_store_and_the_client(door_service, name):
    """bounds.NAME_RULE (a DNS label, not a reserved principal) is the API's schema, the store's
    check and the client's, with one message; nothing is written, the API's refusal is audited."""
    from raytrain_sys.service.bounds import NAME_PATTERN, NAME_RULE

    svc = door_service
    before = svc.store.teams()
    status, answer, headers = send(svc, "POST", "/v1/teams", svc.admin,
                                   json.dumps({"name": name, "nominal_workers": 1}).encode())
    message = refused_shape(status, answer, headers)
    assert (status, answer["field"]) == (400, "team.name"), answer
    assert (NAME_RULE if name != "admin" else "reserved: it names a principal in the audit") in message
    assert last_audit(svc.store, "admin").result == f"refused (400): {message}"
    if name:  # (an empty one Team itself refuses)
        with pytest.raises(ServiceInputError) as in_store:
            svc.store.add_team(Team(name, 1))
        assert str(in_store.value) == message
    rows = len(svc.store.audit_log())
    with pytest.raises(ServiceRequestInvalid) as in_client:  # refused before sending: no request, no row
        svc.client(svc.admin).add_team(name, 1)
    assert (in_client.value.field, str(in_client.value)) == ("team.name", f"HTTP 400: {message}")
    assert len(svc.store.audit_log()) == rows and svc.store.teams() == before
    doc = send(svc, "GET", "/openapi.json")[1]
    assert doc["components"]["schemas"]["TeamAddIn"]["properties"]["name"]["pattern"] == NAME_PATTERN


def test_a_team_named_before_the_rule_stays_listed_usable_and_labelled(door_service):
    """A store from before the name rule may hold any name: such a team is listed, scheduled, its
    quota changed and tokens issued by its name (any name without '/' or a control character),
    its jobs submitted; only a new team must follow the rule."""
    from sqlalchemy import insert

    from raytrain_sys.monitor.metrics import label_value
    from raytrain_sys.service.tables import teams

    svc, legacy = door_service, f"Équipe Legacy {time.monotonic_ns() % 1000}"
    with svc.store.engine.begin() as conn:  # as the API before the rule wrote it
        conn.execute(insert(teams).values(name=legacy, nominal_workers=2, weight=1.0, created_at_s=0.0,
                                          updated_at_s=0.0))
    admin = svc.client(svc.admin)
    assert legacy in [t["name"] for t in admin.teams()]
    assert admin.update_team(legacy, nominal_workers=3)["nominal_workers"] == 3
    job = svc.client(admin.issue_token(legacy)).submit(SPEC)
    assert job["team"] == legacy and legacy in [t.name for t in svc.store.snapshot(8).teams]
    assert [j["id"] for j in admin.jobs(team=legacy)] == [job["id"]]
    assert label_value(legacy).isascii() and label_value(legacy).startswith("\\xc9quipe Legacy")
    with pytest.raises(ServiceRequestInvalid, match="a team name is 1-63 lowercase"):
        admin.add_team(legacy, 1)


def test_cli_refuses_a_bad_team_name_before_sending_with_the_apis_message(sqlite_service):
    svc = sqlite_service
    rows = len(svc.store.audit_log())
    line = one_line_error(cli(svc, "teams", "add", "bad/name", "--nominal", "1", token=svc.admin))
    api = send(svc, "POST", "/v1/teams", svc.admin, b'{"name": "bad/name", "nominal_workers": 1}')[1]["error"]
    assert line == f"raytrain-sys: error: HTTP 400: {api}"
    assert "a team's name has 1-64 characters, no '/'" in one_line_error(
        cli(svc, "jobs", "list", "--team", "a/b", token=svc.admin))
    assert "team.cohort" in one_line_error(cli(svc, "teams", "update", "a", "--cohort", "Bad Cohort", token=svc.admin))
    assert len(svc.store.audit_log()) == rows + 1  # the API's refusal only: the CLI sent nothing
