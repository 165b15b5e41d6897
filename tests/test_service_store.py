"""The service store on a real SQLite file and a real PostgreSQL server: schema made by Alembic
only, guarded transitions, history, audit, hashed tokens, restart after SIGKILL, unreachable
database errors, and claims that never hand one job out twice."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, update

from raytrain_sys.errors import JobStateConflict, ServiceInputError, ServiceStoreError
from raytrain_sys.service import migrations
from raytrain_sys.service.flavors import FlavorState, ResourceFlavor, WorkerShape
from raytrain_sys.service.model import JobState, TransitionNotAllowed, WaitCause
from raytrain_sys.service.scheduler.actions import Admit
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.scheduler import decide
from raytrain_sys.service.store import Store, mask_url
from raytrain_sys.service.tables import jobs, metadata, teams

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/service.db"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(store_url):
    s = Store.open(store_url)
    s.add_team(Team("a", 2, cohort="c"))
    s.add_team(Team("b", 2, cohort="c", borrowing_limit_workers=1))
    yield s
    s.close()


def all_rows_text(store: Store) -> str:
    with store.engine.connect() as conn:
        return "\n".join(repr(tuple(row)) for table in metadata.sorted_tables
                         for row in conn.execute(select(table)))


def test_a_fresh_database_is_made_by_alembic_and_matches_the_tables(store_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    store = Store.open(store_url)
    try:
        assert store.schema_revision() == migrations.head() == "0008"
        with store.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == [], f"tables.py and the migrations differ: {diff}"
    finally:
        store.close()
    Store.open(store_url).close()  # opening again is a no-op upgrade


def test_a_database_of_the_previous_revision_is_upgraded_and_keeps_its_jobs(store_url):
    """A service upgraded in place: a store at 0002 (before code packages) with a queued job
    opens at the newest revision, the job as it was and without a package."""
    from alembic import command
    from sqlalchemy import create_engine

    engine = create_engine(store_url)
    with engine.begin() as conn:
        command.upgrade(migrations.config(conn), "0002")
    engine.dispose()
    with pytest.raises(Exception):  # 0002 has no packages table: Store.open must migrate it
        with create_engine(store_url).connect() as conn:
            conn.execute(select(metadata.tables["packages"]))
    with create_engine(store_url).begin() as conn:
        conn.execute(metadata.tables["teams"].insert().values(
            name="a", nominal_workers=2, weight=1.0, created_at_s=1.0, updated_at_s=1.0))
        conn.execute(metadata.tables["jobs"].insert().values(
            team="a", name="old", spec="{}", priority=0, state="queued", held=False, min_workers=1, max_workers=1,
            elastic=False, workers=0, target_workers=0, restarts=0, submitted_at_s=1.0, waiting_since_s=1.0,
            updated_at_s=1.0, message="submitted"))
    store = Store.open(store_url)
    try:
        assert store.schema_revision() == migrations.head()
        [job] = store.jobs()
        assert (job.name, job.state, job.package) == ("old", JobState.QUEUED, None)
        assert store.put_package(sha256="0" * 64, team="a", data=b"zip", files=1)
        assert store.package_data("0" * 64) == b"zip"
    finally:
        store.close()


def test_a_database_at_0003_is_upgraded_and_its_jobs_wait_without_a_reason_until_one_is_noted(store_url):
    """A store of the revision before wait reasons, with a queued and a starting job: both are
    kept as they were, with no reason and no start given up, and take a reason once noted."""
    from alembic import command

    engine = create_engine(store_url)
    with engine.begin() as conn:
        command.upgrade(migrations.config(conn), "0003")
        conn.execute(metadata.tables["teams"].insert().values(
            name="a", nominal_workers=2, weight=1.0, created_at_s=1.0, updated_at_s=1.0))
        for name, state in (("waits", "queued"), ("starts", "starting")):
            conn.execute(jobs.insert().values(
                team="a", name=name, spec="{}", priority=0, state=state, held=False, min_workers=1, max_workers=1,
                elastic=False, workers=0, target_workers=1 if state == "starting" else 0, restarts=0,
                submitted_at_s=1.0, waiting_since_s=1.0, updated_at_s=1.0, message="submitted"))
    engine.dispose()
    store = Store.open(store_url)
    try:
        assert store.schema_revision() == migrations.head() == "0008"
        waits, starts = store.jobs()
        assert [(j.name, j.state, j.wait_cause, j.wait_reason, j.start_returns) for j in (waits, starts)] == [
            ("waits", JobState.QUEUED, None, None, 0), ("starts", JobState.STARTING, None, None, 0)]
        assert store.note_waits({waits.id: (JobState.QUEUED, WaitCause.TEAM_QUOTA, "over its team's quota")},
                                now_s=7.0) == 1
        assert (store.job(waits.id).wait_cause, store.job(waits.id).wait_cause_since_s) == (WaitCause.TEAM_QUOTA, 7.0)
    finally:
        store.close()


def test_wait_reasons_are_written_only_when_they_change_and_cleared_when_the_job_moves_on(store):
    job = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a", now_s=1.0)
    other = store.submit(team="a", name="k", spec="{}", min_workers=1, actor="a", now_s=1.0)
    quota = (JobState.QUEUED, WaitCause.TEAM_QUOTA, "over its team's quota: team a uses 2 of nominal 2")
    assert store.note_waits({job.id: quota, other.id: quota}, now_s=10.0) == 2
    assert store.note_waits({job.id: quota, other.id: quota}, now_s=11.0) == 0, "nothing changed: nothing written"
    noted = store.job(job.id)
    assert (noted.wait_cause, noted.wait_reason, noted.wait_cause_since_s) == (WaitCause.TEAM_QUOTA, quota[2], 10.0)
    assert noted.updated_at_s == 1.0 and [t.to_state for t in store.history(job.id)] == [JobState.QUEUED]
    # The same cause in other words keeps its since; another cause starts its own.
    assert store.note_waits({job.id: (JobState.QUEUED, WaitCause.TEAM_QUOTA, "over its team's quota: 3 of 2")},
                            now_s=12.0) == 1
    assert (store.job(job.id).wait_reason, store.job(job.id).wait_cause_since_s) == ("over its team's quota: 3 of 2",
                                                                                      10.0)
    store.note_waits({job.id: (JobState.QUEUED, WaitCause.CLUSTER, "the cluster is full")}, now_s=13.0)
    assert (store.job(job.id).wait_cause, store.job(job.id).wait_cause_since_s) == (WaitCause.CLUSTER, 13.0)
    # Guarded by the state it was seen in: a job that moved meanwhile keeps what its move wrote.
    store.transition(other.id, JobState.QUEUED, JobState.CANCELLED, actor="a", reason="cancelled by its team")
    assert store.note_waits({other.id: quota}, now_s=14.0) == 0
    assert (store.job(other.id).wait_cause, store.job(other.id).wait_reason) == (None, None), "ended: no reason"
    # A move sets the reason of its new state, or clears the old one; a note in the same state keeps it.
    held = store.transition(job.id, JobState.QUEUED, JobState.QUEUED, actor="a", reason="held", held=True)
    assert held.wait_cause is WaitCause.CLUSTER
    starting = store.transition(job.id, JobState.QUEUED, JobState.STARTING, actor="scheduler", reason="admitted",
                                wait_cause=WaitCause.RUNNER_START, wait_reason="its runner is starting", now_s=15.0)
    assert (starting.wait_cause, starting.wait_reason, starting.wait_cause_since_s) == (
        WaitCause.RUNNER_START, "its runner is starting", 15.0)
    running = store.transition(job.id, JobState.STARTING, JobState.RUNNING, actor="reconciler", reason="training")
    assert (running.wait_cause, running.wait_reason, running.wait_cause_since_s) == (None, None, None)
    with pytest.raises(ValueError, match="a wait reason is set with both"):
        store.transition(job.id, JobState.RUNNING, JobState.RUNNING, actor="reconciler", reason="x",
                         wait_cause=WaitCause.PLACEMENT, wait_reason="a running job does not wait")


def test_a_pass_over_hundreds_of_waiting_jobs_writes_nothing_when_nothing_changed(store):
    """The reconciler's real pass (no runner is needed for waiting jobs) over 300 queued jobs on a
    cluster with no workers: the first pass writes their reasons in one statement batch, the next
    passes issue no UPDATE at all."""
    from sqlalchemy import event

    from raytrain_sys.service.reconciler import Reconciler, ReconcilerConfig

    ids = [store.submit(team="a", name=f"j{i}", spec="{}", min_workers=1, actor="a").id for i in range(300)]
    statements = []
    event.listen(store.engine, "before_cursor_execute",
                 lambda conn, cursor, sql, params, context, many: statements.append((sql.split()[0], many)))
    reconciler = Reconciler(store, ReconcilerConfig(log_dir=".", spare_runners=0), cluster_workers=lambda: 0)
    reconciler.run_once()
    updates = [many for verb, many in statements if verb == "UPDATE"]
    assert updates == [True], "the first pass's 300 reasons: one executemany"
    assert {store.job(i).wait_cause for i in ids} == {WaitCause.NEVER_FITS}
    statements.clear()
    for _ in range(3):
        reconciler.run_once()
    assert [s for s in statements if s[0] in ("UPDATE", "INSERT", "DELETE")] == []


def test_a_slow_pass_logs_the_seconds_of_each_of_its_parts(store, monkeypatch, caplog):
    """A pass of SLOW_PASS_S or more says where its time went (made 0 here: every pass is slow);
    a pass under it says nothing."""
    import logging

    from raytrain_sys.service import reconciler as rec

    store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a")
    reconciler = rec.Reconciler(store, rec.ReconcilerConfig(log_dir=".", spare_runners=0), cluster_workers=lambda: 0)
    with caplog.at_level(logging.INFO, logger=rec.__name__):
        reconciler.run_once()
        assert not [r for r in caplog.records if "took" in r.getMessage()]
        monkeypatch.setattr(rec, "SLOW_PASS_S", 0.0)
        reconciler.run_once()
    [line] = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert line.startswith("pass 2 took ")
    for part in ("read the store", "runners' status", "runners' requests and ends", "sweep runners",
                 "snapshot and decision", "1 action(s)", "waits and spares"):
        assert f"{part} 0." in line, line


# (sentence, the job's state, the run's end, the moves the store records, the MLflow run id it keeps)
ENDS = [
    ("a run that finished while running is finished", JobState.RUNNING, "finished", ["finished"], "run-1"),
    ("a start whose run finished unseen is recorded running, then finished", JobState.STARTING, "finished",
     ["running", "finished"], "run-1"),
    ("a run that stopped while running is recorded pausing (held), then paused", JobState.RUNNING, "stopped",
     ["pausing", "paused"], "run-1"),
    ("a pause that landed is paused", JobState.PAUSING, "stopped", ["paused"], "run-1"),
    ("a cancel after the pause landed is cancelled", JobState.CANCELLING, "stopped", ["cancelled"], None),
    ("a run that cancelled itself is recorded cancelling, then cancelled", JobState.RUNNING, "cancelled",
     ["cancelling", "cancelled"], "run-1"),
    ("a start not placed goes back to the queue", JobState.STARTING, "failed:ClusterCapacityError", ["queued"], None),
    ("a run that failed while cancelling is cancelled", JobState.CANCELLING, "failed", ["cancelled"], None),
    ("a run that failed is failed", JobState.RUNNING, "failed", ["failed"], "run-1"),
]


@pytest.mark.parametrize("state, end, moves, run_id", [c[1:] for c in ENDS], ids=[c[0] for c in ENDS])
def test_the_reconciler_records_a_runs_end_as_finish_decision_says(tmp_path, state, end, moves, run_id):
    """``Reconciler._finish`` carries each case of ``finish_decision`` out as guarded moves the
    state table allows, the last with the decision's reason, the run's MLflow run id kept where
    the run itself is recorded (its end, running, paused; not a stop's or a cancel's note, nor a
    give-up); then it ends the runner (the one Ray call, watched here)."""
    from raytrain_sys.service.finish import finish_decision
    from raytrain_sys.service.model import RunOutcome, RunnerResult
    from raytrain_sys.service.reconciler import Reconciler, ReconcilerConfig
    from raytrain_sys.service.runner import Launch, RunnerState, RunnerStatus

    store = Store.open(f"sqlite:///{tmp_path}/service.db")
    store.add_team(Team("a", 2))
    job = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a")
    path = {JobState.STARTING: [JobState.STARTING], JobState.RUNNING: [JobState.STARTING, JobState.RUNNING]}.get(
        state, [JobState.STARTING, JobState.RUNNING, state])
    for to in path:
        job = store.transition(job.id, job.state, to, actor="a", reason=f"asked: {to.value}")
    outcome, _, error_type = end.partition(":")
    result = RunnerResult(RunOutcome(outcome), "why", error_type)
    status = RunnerStatus(job_id=job.id, state=RunnerState(outcome), start_step="", committed_step=12, world_size=0,
                          released=True, max_workers=2, mlflow_run_id="run-1", run_dir="", checkpoint_step=None,
                          checkpoint_at_s=None, done=True, result=result, pid=1, nice=0, actor_id="", started_at_s=7.0,
                          launch=Launch(job.id, {}, 2, str(tmp_path)))
    reconciler = Reconciler(store, ReconcilerConfig(log_dir=str(tmp_path), spare_runners=0), cluster_workers=lambda: 0)
    ended = []
    reconciler._kill = lambda job_id, why: ended.append((job_id, why))
    before = len(store.history(job.id))
    reconciler._finish(job, status)
    recorded = store.history(job.id)[before:]
    assert [t.to_state.value for t in recorded] == moves
    decision = finish_decision(state, result, committed_step=12, message=job.message, wait_cause=job.wait_cause,
                               start_returns=0, max_start_returns=reconciler.config.max_start_returns)
    after = store.job(job.id)
    assert recorded[-1].reason == decision.reason and (after.workers, after.target_workers) == (0, 0)
    assert after.mlflow_run_id == run_id
    assert ended == [(job.id, f"its run ended {outcome}")]
    store.close()


def test_submit_and_read_back(store):
    job = store.submit(team="a", name="tiny", spec="model: {name: gpt}\n", min_workers=1, max_workers=3,
                       priority=2, actor="a", now_s=100.0)
    assert (job.state, job.team, job.min_workers, job.max_workers, job.elastic) == (JobState.QUEUED, "a", 1, 3, True)
    assert (job.submitted_at_s, job.waiting_since_s, job.priority, job.workers) == (100.0, 100.0, 2, 0)
    assert store.job(job.id) == job
    assert store.jobs(states=[JobState.QUEUED]) == [job]
    [record] = store.history(job.id)
    assert (record.from_state, record.to_state, record.actor, record.reason) == (None, JobState.QUEUED, "a", "submitted")
    with pytest.raises(ServiceInputError) as err:
        store.add_team(Team("a", 5))
    assert err.value.field == "team.name"


@pytest.mark.parametrize("kwargs, field, words", [
    ({"team": "zeta", "min_workers": 1}, "team", "unknown team 'zeta'"),
    ({"team": "b", "min_workers": 4}, "elastic.min_workers", "could ever get: 3"),
    ({"team": "a", "min_workers": 2, "max_workers": 1}, "elastic.max_workers", "at least elastic.min_workers"),
    ({"team": "a", "min_workers": 0}, "elastic.min_workers", "at least 1"),
    ({"team": "a", "min_workers": 1, "priority": "high"}, "priority", "must be an integer"),
    ({"team": "a", "min_workers": 3, "cluster_workers": 2}, "elastic.min_workers", "cluster's 2 workers"),
], ids=["an unknown team names the team", "more than the team could ever get names min_workers",
        "max below min names max_workers", "zero workers names min_workers", "a priority that is no number",
        "more than the cluster names min_workers"])
def test_bad_submit_names_the_field_and_writes_nothing(store, kwargs, field, words):
    before = all_rows_text(store)
    with pytest.raises(ServiceInputError) as err:
        store.submit(name="j", spec="{}", actor="a", **kwargs)
    assert err.value.field == field and words in str(err.value)
    assert all_rows_text(store) == before


@pytest.mark.parametrize("write, field, words", [
    (lambda s: s.add_team(Team("big", 100_001)), "team.nominal_workers", "at most 100000"),
    (lambda s: s.add_team(Team("big", 1, borrowing_limit_workers=2 ** 40)), "team.borrowing_limit_workers",
     "at most 100000"),
    (lambda s: s.add_team(Team("heavy", 1, weight=1e12)), "team.weight", "(0, 1e+06]"),
    (lambda s: s.add_team(Team("Not A Name", 1)), "team.name", "a team name is 1-63 lowercase letters"),
    (lambda s: s.add_team(Team("c", 1, cohort="Bad Cohort")), "team.cohort", "a cohort name is 1-63"),
    (lambda s: s.update_team(Team("a", 2, cohort="New Cohort")), "team.cohort", "a cohort name is 1-63"),
    (lambda s: s.submit(team="a", name="j", spec="{}", min_workers=1, max_workers=2 ** 40, actor="a"),
     "elastic.max_workers", "at most 100000"),
    (lambda s: s.submit(team="a", name="j", spec="{}", min_workers=1, priority=-2 ** 63, actor="a"), "priority",
     "at least -1000000"),
    (lambda s: s.submit(team="a", name="two\nlines", spec="{}", min_workers=1, actor="a"), "name", "one line"),
], ids=["a nominal quota past any cluster", "a borrowing limit of 41 bits", "a weight of 1e12", "a name off the rule",
        "a new cohort off the rule", "a cohort changed to one off the rule", "a job of 2**40 workers",
        "a priority of 64 bits", "a job name on two lines"])
def test_the_store_writes_nothing_out_of_bounds_whoever_asks(store, write, field, words):
    """The bounds the API's schema publishes are the store's own too (the service actor and
    scripts write through it): within the 32-bit columns, names on the rule."""
    before = all_rows_text(store)
    with pytest.raises(ServiceInputError) as err:
        write(store)
    assert err.value.field == field and words in str(err.value), str(err.value)
    assert all_rows_text(store) == before


def test_a_cohort_from_before_the_rule_is_kept_by_an_update(store):
    with store.engine.begin() as conn:
        conn.execute(update(teams).where(teams.c.name == "a").values(cohort="Old Cohort"))
    assert store.update_team(Team("a", 3, cohort="Old Cohort")).nominal_workers == 3
    assert store.team("a").cohort == "Old Cohort"


def test_an_audit_row_holds_a_short_quote_of_what_a_user_sent(store):
    """Whatever a refusal quotes, its row fits the columns (a 64-character action on PostgreSQL's
    VARCHAR(64)) and holds no control character (PostgreSQL refuses a NUL) nor 10 MB."""
    from raytrain_sys.service import auth

    huge = "\x00" + "y" * 10_000_000
    auth.record(store, "a", "GET /" + huge, "job " + huge, "refused (400): got " + huge)
    row = store.audit_log(limit=1)[0]
    assert len(row.action) == 64 and len(row.target) == 200 and len(row.result) == 1000
    assert row.action.startswith("GET /\\x00yyy") and row.result.endswith("... (10000023 characters)")


def test_guarded_transitions_and_their_history(store):
    job = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a", now_s=1.0)
    store.transition(job.id, JobState.QUEUED, JobState.STARTING, actor="scheduler", reason="admitted on 1",
                     workers=0, target_workers=1, now_s=2.0)
    running = store.transition(job.id, [JobState.STARTING, JobState.RESUMING], JobState.RUNNING,
                               actor="reconciler", reason="first step committed", workers=1, started_at_s=3.0,
                               now_s=3.0)
    assert (running.state, running.workers, running.target_workers, running.message) == (
        JobState.RUNNING, 1, 1, "first step committed")
    before = all_rows_text(store)
    with pytest.raises(JobStateConflict, match=f"job {job.id} is running, not queued"):
        store.transition(job.id, JobState.QUEUED, JobState.STARTING, actor="scheduler", reason="admitted again")
    with pytest.raises(TransitionNotAllowed, match="running cannot move to paused"):
        store.transition(job.id, JobState.RUNNING, JobState.PAUSED, actor="scheduler", reason="no checkpoint")
    with pytest.raises(ServiceInputError, match="no job 999"):
        store.transition(999, JobState.QUEUED, JobState.STARTING, actor="scheduler", reason="x")
    assert all_rows_text(store) == before, "a refused transition changed something"
    store.transition(job.id, JobState.RUNNING, JobState.PAUSING, actor="scheduler", reason="team b reclaims",
                     now_s=4.0)
    store.record_checkpoint(job.id, step=40, at_s=4.5)
    paused = store.transition(job.id, JobState.PAUSING, JobState.PAUSED, actor="reconciler",
                              reason="checkpoint at step 40, workers released", workers=0, target_workers=0,
                              waiting_since_s=5.0, now_s=5.0)
    assert (paused.last_checkpoint_step, paused.last_checkpoint_at_s, paused.waiting_since_s) == (40, 4.5, 5.0)
    history = [(r.from_state and r.from_state.value, r.to_state.value, r.at_s, r.actor, r.reason)
               for r in store.history(job.id)]
    assert history == [
        (None, "queued", 1.0, "a", "submitted"),
        ("queued", "starting", 2.0, "scheduler", "admitted on 1"),
        ("starting", "running", 3.0, "reconciler", "first step committed"),
        ("running", "pausing", 4.0, "scheduler", "team b reclaims"),
        ("pausing", "paused", 5.0, "reconciler", "checkpoint at step 40, workers released"),
    ]
    store.transition(job.id, JobState.PAUSED, JobState.CANCELLED, actor="a", reason="cancelled by its team")
    with pytest.raises(TransitionNotAllowed, match="it has ended"):
        store.transition(job.id, JobState.CANCELLED, JobState.QUEUED, actor="a", reason="undo")


def test_a_hold_is_guarded_on_held_too_and_a_cancel_records_its_delete_intent(store):
    job = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a")
    held = store.transition(job.id, JobState.QUEUED, JobState.QUEUED, actor="a", reason="held",
                            expected_held=False, held=True)
    assert (held.state, held.held) == (JobState.QUEUED, True)
    before = store.history(job.id)
    with pytest.raises(JobStateConflict, match=r"is queued \(held\), not queued \(not held\)"):
        store.transition(job.id, JobState.QUEUED, JobState.QUEUED, actor="a", reason="held again",
                         expected_held=False, held=True)
    assert store.history(job.id) == before and store.job(job.id) == held
    gone = store.transition(job.id, JobState.QUEUED, JobState.CANCELLED, actor="a", reason="cancel",
                            delete_checkpoints=True)
    assert (gone.state, gone.delete_checkpoints) == (JobState.CANCELLED, True)
    assert store.submit(team="a", name="k", spec="{}", min_workers=1, actor="a").delete_checkpoints is False


def test_audit_rows(store):
    store.record_audit("a", "submit", "job 1", "ok", now_s=10.0)
    store.record_audit("b", "cancel", "job 1", "refused: job 1 belongs to team a", now_s=11.0)
    store.record_audit("admin", "add_team", "team c", "ok", now_s=12.0)
    log = store.audit_log()
    assert [(r.at_s, r.actor, r.action, r.target, r.result) for r in log] == [
        (10.0, "a", "submit", "job 1", "ok"),
        (11.0, "b", "cancel", "job 1", "refused: job 1 belongs to team a"),
        (12.0, "admin", "add_team", "team c", "ok"),
    ]
    assert [r.actor for r in store.audit_log(limit=1)] == ["admin"]
    assert [r.action for r in store.audit_log(actor="b")] == ["cancel"]


def test_tokens_are_stored_hashed_and_never_logged(store, caplog):
    caplog.set_level(logging.DEBUG)
    logging.getLogger("sqlalchemy.engine").setLevel(logging.INFO)  # every statement and its parameters
    try:
        team_token = store.issue_token("a")
        admin_token = store.issue_token(None)
        assert store.authenticate(team_token).name == "a"
        assert store.authenticate(admin_token).is_admin
        assert store.authenticate(team_token[:-1] + ("A" if team_token[-1] != "A" else "B")) is None
        assert store.authenticate("not-a-token") is None
        rows = all_rows_text(store)
        for token in (team_token, admin_token):
            assert token not in rows and token[len("rts_"):] not in rows
            assert token not in caplog.text
        assert "INSERT INTO tokens" in caplog.text  # the statements were logged, the tokens not
    finally:
        logging.getLogger("sqlalchemy.engine").setLevel(logging.WARNING)
    with pytest.raises(ServiceInputError, match="unknown team 'zeta'"):
        store.issue_token("zeta")
    assert store.revoke_tokens("a") == 1
    assert store.authenticate(team_token) is None
    assert store.authenticate(admin_token).is_admin


def test_idempotent_submit(store):
    first = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a", idempotency_key="k1")
    again = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a", idempotency_key="k1")
    other = store.submit(team="b", name="j", spec="{}", min_workers=1, actor="b", idempotency_key="k1")
    assert first.id == again.id != other.id
    assert len(store.jobs()) == 2


_WRITER = r"""
import json, sys, time
from sqlalchemy import insert, update
from raytrain_sys.service.model import JobState
from raytrain_sys.service.teams import Team
from raytrain_sys.service.store import Store
from raytrain_sys.service.tables import jobs, transitions

s = Store.open(sys.argv[1])
s.add_team(Team("a", 4, cohort="c", borrowing_limit_workers=2))
s.add_team(Team("b", 2, cohort="c", lending_limit_workers=1, weight=2.0))
token = s.issue_token("a")
ids = [s.submit(team="a", name=f"j{i}", spec="{}", min_workers=1, max_workers=2, actor="a").id for i in range(3)]
for expected, to in [("queued", "starting"), ("starting", "running"), ("running", "pausing"), ("pausing", "paused")]:
    s.transition(ids[0], JobState(expected), JobState(to), actor="scheduler", reason=f"to {to}")
s.record_audit("a", "submit", f"job {ids[0]}", "ok")
print(json.dumps({"ids": ids, "token": token}), flush=True)
with s.engine.connect() as conn:  # a transition in flight when the process is killed
    conn.begin()
    conn.execute(update(jobs).where(jobs.c.id == ids[1]).values(state="starting"))
    conn.execute(insert(transitions).values(job_id=ids[1], from_state="queued", to_state="starting", at_s=0.0,
                                            actor="scheduler", reason="never committed"))
    print("mid-write", flush=True)
    time.sleep(120)
"""


def test_everything_survives_a_sigkill_and_an_uncommitted_write_is_gone(store_url):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, store_url], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        first = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "mid-write"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    store = Store.open(store_url)
    try:
        ids = first["ids"]
        assert [t.name for t in store.teams()] == ["a", "b"]
        assert store.team("b") == Team("b", 2, cohort="c", lending_limit_workers=1, weight=2.0)
        assert [j.state for j in store.jobs()] == [JobState.PAUSED, JobState.QUEUED, JobState.QUEUED]
        assert [r.reason for r in store.history(ids[1])] == ["submitted"], "the uncommitted write survived"
        assert len(store.history(ids[0])) == 5
        assert store.authenticate(first["token"]).name == "a"
        assert [(r.actor, r.action) for r in store.audit_log()] == [("a", "submit")]
        # The restarted service continues: the paused and queued jobs are admitted, once each.
        snapshot = store.snapshot(cluster_workers=6)
        admits = [a for a in decide(snapshot, now_s=1e10) if isinstance(a, Admit)]
        assert sorted(a.job_id for a in admits) == sorted(ids)
        for a in admits:
            state = store.job(a.job_id).state
            to = JobState.RESUMING if state is JobState.PAUSED else JobState.STARTING
            store.transition(a.job_id, state, to, actor="scheduler", reason=a.reason, target_workers=a.workers)
            with pytest.raises(JobStateConflict):  # a second service acting on the same pass
                store.transition(a.job_id, state, to, actor="scheduler", reason=a.reason)
    finally:
        store.close()


def test_concurrent_claims_never_hand_out_one_job_twice(store_url):
    setup = Store.open(store_url)
    setup.add_team(Team("a", 64))
    ids = {setup.submit(team="a", name=f"j{i}", spec="{}", min_workers=1, actor="a").id for i in range(24)}
    claimed: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def claimer():
        store = Store.open(store_url)  # its own engine: its own connections
        try:
            while True:
                job = store.claim(JobState.QUEUED, JobState.STARTING, actor="runner", reason="claimed")
                if job is None:
                    return
                with lock:
                    claimed.append(job.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(claimed) == sorted(ids), "a job was claimed twice or never"
    assert all(len(setup.history(i)) == 2 for i in ids)
    setup.close()


def test_postgres_claim_skips_a_row_another_connection_holds(postgres_url):
    store = Store.open(postgres_url)
    store.add_team(Team("a", 4))
    first = store.submit(team="a", name="j1", spec="{}", min_workers=1, actor="a")
    second = store.submit(team="a", name="j2", spec="{}", min_workers=1, actor="a")
    other = create_engine(postgres_url)
    try:
        with other.connect() as conn:
            tx = conn.begin()
            conn.execute(select(jobs.c.id).where(jobs.c.id == first.id).with_for_update())  # held, uncommitted
            claimed = store.claim(JobState.QUEUED, JobState.STARTING, actor="runner", reason="claimed")
            assert claimed.id == second.id, "the locked job was handed out"
            assert store.claim(JobState.QUEUED, JobState.STARTING, actor="runner", reason="claimed") is None
            tx.rollback()
        assert store.claim(JobState.QUEUED, JobState.STARTING, actor="runner", reason="claimed").id == first.id
    finally:
        other.dispose()
        store.close()


def test_an_unreachable_database_is_named_without_its_password():
    with socketless_port() as port:
        url = f"postgresql+psycopg://alice:s3cr3t-pw@127.0.0.1:{port}/jobs"
        with pytest.raises(ServiceStoreError) as err:
            Store.open(url)
    message = str(err.value)
    assert f"cannot reach postgresql+psycopg://alice:***@127.0.0.1:{port}/jobs" in message
    assert "refused" in message.lower() and "s3cr3t" not in message
    assert mask_url(url) == f"postgresql+psycopg://alice:***@127.0.0.1:{port}/jobs"
    with pytest.raises(ServiceStoreError, match="cannot reach sqlite:////nonexistent-dir/x.db: unable to open"):
        Store.open("sqlite:////nonexistent-dir/x.db")
    with pytest.raises(ServiceStoreError, match="cannot use database URL"):
        Store.open("nosuchdb://x")


def test_a_store_whose_database_went_away_names_it(tmp_path, postgres_server):
    url = postgres_server.create_database("going_away")
    store = Store.open(url)
    store.add_team(Team("a", 1))
    import psycopg

    with psycopg.connect(host=postgres_server.host, port=postgres_server.port, user=postgres_server.user,
                         password=postgres_server.password, dbname="postgres", autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'going_away'")
        admin.execute('DROP DATABASE "going_away"')
    try:
        with pytest.raises(ServiceStoreError, match=r"cannot reach postgresql\+psycopg://rts:\*\*\*@") as err:
            store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a")
        assert postgres_server.password not in str(err.value)
    finally:
        store.close()


class socketless_port:
    """A local port with nothing listening on it (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None


def test_a_python_object_in_a_service_spec_names_the_field():
    """A callable that cannot be imported (a notebook's, a closure) travels by value in a run; the
    service stores specs as data, so it refuses it, naming the field. One that can be imported is
    stored as its import path, which the service accepts."""
    from raytrain_sys.service.requests import parse_spec

    def build(section):  # a closure: no import path reaches it
        raise AssertionError("never called: the service refuses it first")

    with pytest.raises(ServiceInputError) as err:
        parse_spec({"model": {"factory": build}, "data": {"path": "/data/x"},
                    "train": {"task": "raytrain_sys.train.tasks:Classify"}})
    assert err.value.field == "spec.model.factory"
    assert "Python object" in str(err.value) and "import path 'package.module:name'" in str(err.value)


def test_unused_code_packages_are_pruned_and_used_ones_kept(store):
    def upload(name: str) -> str:
        sha = name * 64
        assert store.put_package(sha256=sha, team="a", data=name.encode(), files=1, now_s=100.0)
        return sha

    unused, waiting, recent, ended = upload("1"), upload("2"), upload("3"), upload("4")
    new = "5" * 64
    store.put_package(sha256=new, team="a", data=b"5", files=1, now_s=600.0)
    store.put_package(sha256=unused, team="b", data=b"1", files=1, now_s=100.0)
    store.submit(team="a", name="w", spec="{}", min_workers=1, actor="a", package=waiting, now_s=100.0)
    for name, sha, at in (("r", recent, 900.0), ("e", ended, 100.0)):  # ended jobs, one submitted lately
        job = store.submit(team="a", name=name, spec="{}", min_workers=1, actor="a", package=sha, now_s=at)
        store.transition(job.id, JobState.QUEUED, JobState.CANCELLED, actor="a", reason="test")
    # Cutoff 500: the unused ones (of both teams) and the one only an ended, old job named go.
    assert sorted(store.prune_packages(500.0)) == [(unused, "a"), (unused, "b"), (ended, "a")]
    assert store.package_data(unused) is None and store.package_data(ended) is None
    assert all(store.package_data(s) for s in (waiting, recent, new))
    # Later: the waiting job still holds its package; the one of the job submitted at 900 goes.
    assert sorted(store.prune_packages(1000.0)) == [(recent, "a"), (new, "a")]
    assert store.package_data(waiting) == b"2"
    with pytest.raises(ServiceInputError, match="team a has uploaded no package"):
        store.submit(team="a", name="again", spec="{}", min_workers=1, actor="a", package=recent)


def test_a_database_at_0004_is_upgraded_keeping_its_teams_jobs_and_decisions(store_url):
    """A store of the revision before flavors, with a queued 2-CPU job and a running one: both
    keep what they were, take their shape from their stored spec, and the service (no flavor
    table: the implicit flavor) decides as it did; a flavor table and per-flavor quotas can then
    be set, and the queued job counts CPUs on the flavor its shape fits."""
    from alembic import command

    engine = create_engine(store_url)
    with engine.begin() as conn:
        command.upgrade(migrations.config(conn), "0004")
        conn.execute(metadata.tables["teams"].insert().values(
            name="a", nominal_workers=3, weight=1.0, created_at_s=1.0, updated_at_s=1.0))
        for name, state, spec in (("waits", "queued", {"resources": {"cpus_per_worker": 2, "market": "spot"}}),
                                  ("runs", "running", {"resources": {"num_workers": 2}}),
                                  ("odd", "queued", "not json")):
            conn.execute(jobs.insert().values(
                team="a", name=name, spec=spec if isinstance(spec, str) else json.dumps(spec), priority=0,
                state=state, held=False, min_workers=2 if name == "runs" else 1, max_workers=2, elastic=False,
                workers=2 if state == "running" else 0, target_workers=2 if state == "running" else 0, restarts=0,
                submitted_at_s=1.0, waiting_since_s=1.0, updated_at_s=1.0, message="submitted"))
    engine.dispose()
    store = Store.open(store_url)
    try:
        assert store.schema_revision() == migrations.head() == "0008"
        waits, runs, odd = store.jobs()
        assert (waits.shape.cpu, waits.shape.market, waits.flavor) == (2.0, "spot", None)
        assert (runs.shape.cpu, runs.shape.market, runs.state, runs.workers) == (1.0, "any", JobState.RUNNING, 2)
        assert (odd.shape.cpu, odd.shape.market) == (1.0, "any")  # a spec it cannot read keeps the defaults
        assert store.flavors() == () and store.team("a").quotas == ()
        [admit, wait] = decide(store.snapshot(cluster_workers=4), 10.0)
        assert (type(admit).__name__, admit.job_id, admit.workers, admit.flavor) == ("Admit", waits.id, 1, "default")
        assert wait.job_id == odd.id and wait.cause is WaitCause.TEAM_QUOTA  # 2 + 1 of nominal 3, as before

        store.set_flavors([ResourceFlavor("spot-cpu", "spot", resources=("cpu",)),
                           ResourceFlavor("on-demand-cpu", "on-demand", resources=("cpu",))])
        store.set_quotas("a", "spot-cpu", [FlavorQuota("spot-cpu", "cpu", 4)])
        assert store.team("a").quotas == (FlavorQuota("spot-cpu", "cpu", 4.0),)
        states = [FlavorState(f, {"cpu": 8.0}) for f in store.flavors()]
        actions = decide(store.snapshot(cluster_workers=0, flavor_states=states), 10.0)
        # The running job (1 CPU a worker, no flavor recorded) counts 2 CPUs on spot-cpu, the first it
        # fits; the 2-CPU spot job takes the other 2 of the team's 4; a third CPU is over its quota (a
        # team of no cohort, with no quota on on-demand-cpu, may not borrow there).
        assert [(type(a).__name__, a.job_id, getattr(a, "flavor", None), getattr(a, "cause", None))
                for a in actions] == [("Admit", waits.id, "spot-cpu", None),
                                      ("Wait", odd.id, None, WaitCause.TEAM_QUOTA)], actions
    finally:
        store.close()


def test_flavors_and_quotas_are_checked_before_they_are_written(store):
    spot = ResourceFlavor("spot-cpu", "spot", resources=("cpu",))
    with pytest.raises(ServiceInputError) as err:
        store.set_quotas("a", "spot-cpu", [FlavorQuota("spot-cpu", "cpu", 4)])
    assert err.value.field == "quota.flavor" and "no flavor table" in str(err.value)
    store.set_flavors([spot])
    with pytest.raises(ServiceInputError) as err:
        store.set_quotas("a", "spot-cpu", [FlavorQuota("spot-cpu", "gpu", 1)])
    assert err.value.field == "quotas[0].resource" and "spot-cpu counts cpu" in str(err.value)
    with pytest.raises(ServiceInputError) as err:
        store.set_flavors([spot, ResourceFlavor("spot-again", "spot", resources=("cpu",))])
    assert err.value.field == "flavors[1]" and "one flavor per kind of node" in str(err.value)
    with pytest.raises(ServiceInputError) as err:
        ResourceFlavor("spot", "preemptible")
    assert err.value.field == "flavor.market"
    store.set_quotas("a", "spot-cpu", [FlavorQuota("spot-cpu", "cpu", 4)])
    job = store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a", shape=WorkerShape(market="spot"))
    store.transition(job.id, JobState.QUEUED, JobState.STARTING, actor="scheduler", reason="admitted",
                     target_workers=1, flavor="spot-cpu")
    with pytest.raises(ServiceInputError) as err:
        store.set_flavors([ResourceFlavor("on-demand-cpu", "on-demand", resources=("cpu",))])
    assert err.value.field == "flavors" and f"job {job.id} on spot-cpu" in str(err.value)
    assert store.flavors() == (spot,)


@pytest.mark.parametrize("shape, field, words", [
    (WorkerShape(market="on-demand"), "resources.market", "spot-cpu is spot, the job asks resources.market=on-demand"),
    (WorkerShape(gpu=1.0, accelerator="H100"), "resources.accelerator_type",
     "spot-a10g has A10G, the job asks resources.accelerator_type=H100"),
    (WorkerShape(cpu=64.0), "elastic.min_workers", "is more than its capacity holds: 0 (8 CPU, 2 GPU)"),
], ids=["a market no flavor has", "a GPU type no flavor has", "a worker bigger than the flavor's ceiling"])
def test_a_submit_whose_shape_fits_no_flavor_names_the_field(store, shape, field, words):
    store.set_flavors([ResourceFlavor("spot-cpu", "spot", resources=("cpu",)),
                       ResourceFlavor("spot-a10g", "spot", "A10G", resources=("gpu",))])
    store.set_quotas("a", "spot-cpu", [FlavorQuota("spot-cpu", "cpu", 100)])
    with pytest.raises(ServiceInputError) as err:
        store.submit(team="a", name="j", spec="{}", min_workers=1, actor="a", shape=shape,
                     capacity={"spot-cpu": {"cpu": 8.0, "gpu": 2.0}})
    assert err.value.field == field and words in str(err.value), str(err.value)
    assert store.jobs() == []


def test_a_database_at_0006_is_upgraded_its_trials_jobs_segment_0_and_a_trial_takes_more_segments(store_url):
    """A store of the revision before trial segments, with a sweep and its trial's job: the job
    is the trial's segment 0; the trial may then take a segment 1 (a PBT exploit), and each
    segment submitted again is found, not made twice."""
    from alembic import command

    engine = create_engine(store_url)
    with engine.begin() as conn:
        command.upgrade(migrations.config(conn), "0006")
        conn.execute(metadata.tables["teams"].insert().values(
            name="a", nominal_workers=2, weight=1.0, created_at_s=1.0, updated_at_s=1.0))
        sweep_id = conn.execute(metadata.tables["sweeps"].insert().values(
            team="a", name="s", spec="{}", priority=0, state="running", storage_path="/tmp", runner_restarts=0,
            submitted_at_s=1.0, updated_at_s=1.0, message="submitted").returning(
            metadata.tables["sweeps"].c.id)).scalar_one()
        conn.execute(jobs.insert().values(
            team="a", name="trial", spec="{}", priority=0, state="running", held=False, min_workers=1, max_workers=1,
            elastic=False, workers=1, target_workers=1, restarts=0, submitted_at_s=1.0, waiting_since_s=1.0,
            updated_at_s=1.0, message="submitted", sweep_id=sweep_id, trial_id="t1"))
    engine.dispose()
    store = Store.open(store_url)
    try:
        assert store.schema_revision() == migrations.head() == "0008"
        [old] = store.trials(sweep_id)
        assert (old.trial_id, old.segment, old.state) == ("t1", 0, JobState.RUNNING)

        def submit(segment: int):
            return store.submit(team="a", name="trial", spec="{}", min_workers=1, actor="sweep",
                                sweep_id=sweep_id, trial_id="t1", segment=segment)

        assert submit(0).id == old.id  # re-attaches, as before
        second = submit(1)
        assert second.id != old.id and second.segment == 1
        assert submit(1).id == second.id
        assert [(j.trial_id, j.segment) for j in store.trials(sweep_id)] == [("t1", 0), ("t1", 1)]
    finally:
        store.close()
