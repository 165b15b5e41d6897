"""Sweeps without a cluster: the sweep spec refuses bad input naming the field before any trial
starts; a valid one round-trips through the store's JSON and sets each trial's fields; the
sweep record's guarded lifecycle and the (sweep, trial) pair that makes a re-driven trial find
its job, on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import json
import os

import pytest

from raytrain_sys.errors import JobStateConflict, ServiceInputError
from raytrain_sys.service.model import JobState, SweepState, TransitionNotAllowed
from raytrain_sys.service.teams import Team
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.spec import (REQUIRED_FIELDS, parse_sweep, sweep_from_dict, sweep_json_schema, trial_spec,
                                      tune_space)

BASE = {"name": "tiny", "data": {"path": "/data/tiny"},
        "model": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
        "train": {"max_steps": 20, "global_batch_size": 8},
        "eval": {"every_steps": 5, "max_rows": 16},
        "checkpoint": {"every_steps": 5},
        "resources": {"num_workers": 1}, "elastic": {"min_workers": 1, "max_workers": 2}}
SWEEP = {"name": "lr-wd", "base": BASE, "metric": "eval_loss", "mode": "min", "num_samples": 3,
         "space": {"optim.lr": {"loguniform": [1e-4, 1e-2]}, "optim.weight_decay": {"grid": [0.0, 0.1]}}}


def with_(**changes) -> dict:
    raw = copy.deepcopy(SWEEP)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def base_with(section: str, **fields) -> dict:
    base = copy.deepcopy(BASE)
    base.setdefault(section, {}).update(fields)
    return base


REFUSALS = [
    ("a field the job spec does not have", with_(space={"optim.lrr": {"uniform": [0.1, 0.2]}}),
     "space.optim.lrr", "did you mean 'lr'"),
    ("an empty range", with_(space={"optim.lr": {"uniform": [0.2, 0.2]}}), "space.optim.lr.uniform",
     "empty range"),
    ("a log-uniform range reaching 0", with_(space={"optim.lr": {"loguniform": [0, 0.1]}}),
     "space.optim.lr.loguniform", "above 0"),
    ("an empty choice", with_(space={"optim.lr": {"choice": []}}), "space.optim.lr.choice", "non-empty"),
    ("an unknown domain", with_(space={"optim.lr": {"normal": [0, 1]}}), "space.optim.lr", "loguniform"),
    ("a value the job spec refuses", with_(space={"model.n_head": {"choice": [2, 3]}}), "space.model.n_head",
     "value 3"),
    ("a field the service sets for each trial", with_(space={"output_dir": {"choice": ["a", "b"]}}),
     "space.output_dir", "the service sets it"),
    ("a metric the trials never report", with_(metric="val_accuracy"), "metric", "eval_loss"),
    ("a metric with no evaluation in the base", with_(base=base_with("eval", every_steps=0)), "metric",
     "base.eval.every_steps is 0"),
    ("a mode that is neither min nor max", with_(mode="lowest"), "mode", "min or max"),
    ("an unknown sweep field", with_(samples=3), "samples", "unknown sweep field"),
    ("no space", with_(space=None), "space", "missing"),
    ("an unknown scheduler", with_(scheduler="hyperband"), "scheduler", "asha, fifo, pbt"),
    ("a field of another scheduler", with_(scheduler={"type": "asha", "quantile_fraction": 0.2}),
     "scheduler.quantile_fraction", "not a field of the asha scheduler"),
    ("PBT with a base that never checkpoints", with_(scheduler="pbt", base=base_with("checkpoint", every_steps=0)),
     "base.checkpoint.every_steps", "committed checkpoint"),
    ("PBT's interval between checkpoints", with_(scheduler={"type": "pbt", "perturbation_interval_steps": 7}),
     "scheduler.perturbation_interval_steps", "multiple of base.checkpoint.every_steps"),
    ("PBT mutating a field a resume takes from the checkpoint",
     with_(scheduler="pbt", space={"optim.lr": {"loguniform": [1e-4, 1e-2]}, "optim.weight_decay": {"uniform": [0, 0.1]}}),
     "space.optim.weight_decay", "make it a grid"),
    ("PBT mutating the model", with_(scheduler="pbt", space={"optim.lr": {"loguniform": [1e-4, 1e-2]},
                                                             "model.n_layer": {"choice": [1, 2]}}),
     "space.model.n_layer", "an exploit continues the donor's checkpoint"),
    ("a worker cap below one trial", with_(max_workers=0), "max_workers", "one trial's size"),
    ("a base spec field out of range", with_(base=base_with("train", max_steps=-1)), "base.train.max_steps", ""),
    ("zero samples", with_(num_samples=0), "num_samples", "1..1000"),
    ("more trials than a sweep holds", with_(num_samples=600), "num_samples", "1200 trials"),
]


@pytest.mark.parametrize("raw, field, words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_bad_sweep_is_refused_naming_its_field(raw, field, words):
    with pytest.raises(ServiceInputError) as caught:
        parse_sweep(raw, base_dir="/tmp")
    assert caught.value.field == field, caught.value
    assert words in caught.value.message, caught.value


def test_the_published_schema_requires_and_types_a_sweep_as_parse_sweep_does():
    """The API's schema of a sweep (``sweep_json_schema``, in /openapi.json) requires what
    ``parse_sweep`` requires: a sweep without its base, space or metric fails both, naming it.
    And what it types an integer, both take as an integer: 3.0 is 3, stored as the int."""
    import jsonschema

    schema = sweep_json_schema()
    jsonschema.validate(SWEEP, schema)
    for field in REQUIRED_FIELDS:
        with pytest.raises(jsonschema.ValidationError, match=f"'{field}' is a required property"):
            jsonschema.validate(with_(**{field: None}), schema)
        with pytest.raises(ServiceInputError) as missing:
            parse_sweep(with_(**{field: None}), base_dir="/tmp")
        assert missing.value.field == field
    integral = with_(num_samples=3.0, max_workers=2.0, scheduler={"type": "asha", "reduction_factor": 3.0},
                     space={"optim.lr": {"loguniform": [1e-4, 1e-2]}, "train.seed": {"randint": [0.0, 100.0]}})
    jsonschema.validate(integral, schema)
    sweep = parse_sweep(integral, base_dir="/tmp")
    stored = json.loads(json.dumps(sweep.to_dict()))
    assert (stored["num_samples"], stored["max_workers"], stored["scheduler"]["reduction_factor"],
            stored["space"]["train.seed"]) == (3, 2, 3, {"randint": [0, 100]})
    assert all(type(v) is int for v in (sweep.num_samples, sweep.max_workers, *sweep.space["train.seed"].values))
    for halves in (with_(num_samples=2.5), with_(space={"train.seed": {"randint": [0, 10.5]}})):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(halves, schema)
        with pytest.raises(ServiceInputError, match="integer"):
            parse_sweep(halves, base_dir="/tmp")


def test_a_sweep_round_trips_and_sets_each_trials_fields():
    sweep = parse_sweep(SWEEP, base_dir="/tmp")
    assert sweep.trial_count == 6  # 3 samples x 2 grid values
    assert sweep.scheduler.type == "asha" and sweep.scheduler.grace_period_steps == 5  # the first evaluation
    again = sweep_from_dict(json.loads(json.dumps(sweep.to_dict())))
    assert again == sweep
    spec = trial_spec(sweep, {"optim.lr": 0.004, "optim.weight_decay": 0.1, "trial_id": "x"}, 7, "t1")
    assert spec["optim"]["lr"] == 0.004 and spec["optim"]["weight_decay"] == 0.1
    assert spec["output_dir"] == sweep.base["output_dir"] + "/sweep-7/t1" and spec["name"] == "tiny-t1"
    assert spec["tracking"]["uri"] == f"sqlite:///{sweep.base['output_dir']}/mlflow.db"  # every trial's, and the parent's
    assert sweep.base["optim"]["lr"] != 0.004  # the base is left as it was
    space = tune_space(sweep)
    assert set(space) == {"optim.lr", "optim.weight_decay"}
    assert space["optim.weight_decay"] == {"grid_search": [0.0, 0.1]}


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path}/service.db" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    s = Store.open(url)
    for name in ("a", "b"):
        try:
            s.add_team(Team(name, 4))
        except ServiceInputError:  # the PostgreSQL database is shared by the module's tests
            pass
    yield s
    s.close()


def _trial(store: Store, sweep_id: int, trial_id: str, team: str = "a"):
    return store.submit(team=team, name=f"trial {trial_id}", spec="{}", min_workers=1, max_workers=2,
                        actor="sweep-runner", sweep_id=sweep_id, trial_id=trial_id)


def test_a_sweep_moves_only_along_its_edges_and_a_trial_re_attaches(store):
    sweep = store.submit_sweep(team="a", name="lr-wd", spec="{}", priority=3, max_workers=4,
                               storage_path="/tmp/tune", actor="a")
    assert sweep.state is SweepState.QUEUED and sweep.runner_restarts == 0
    with pytest.raises(TransitionNotAllowed):
        store.transition_sweep(sweep.id, SweepState.QUEUED, SweepState.FINISHED, actor="x", reason="no")
    with pytest.raises(JobStateConflict, match="is queued, not running"):
        store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.PAUSED, actor="x", reason="no")
    running = store.transition_sweep(sweep.id, SweepState.QUEUED, SweepState.RUNNING, actor="reconciler",
                                     reason="sweep runner started", mlflow_parent_run_id="abc")
    assert running.state is SweepState.RUNNING and running.mlflow_parent_run_id == "abc"

    first = _trial(store, sweep.id, "t0001")
    again = _trial(store, sweep.id, "t0001")  # a restored runner drives the same trial
    other = _trial(store, sweep.id, "t0002")
    assert again.id == first.id and other.id != first.id
    assert (first.sweep_id, first.trial_id) == (sweep.id, "t0001")
    assert [j.id for j in store.trials(sweep.id)] == [first.id, other.id]
    with pytest.raises(ServiceInputError, match="team a's"):
        _trial(store, sweep.id, "t0003", team="b")

    store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.CANCELLED, actor="a", reason="cancelled by a")
    with pytest.raises(JobStateConflict, match="submits no more trials"):
        _trial(store, sweep.id, "t0004")
    assert _trial(store, sweep.id, "t0001").id == first.id  # an existing trial is still found
    assert [(t.from_state, t.to_state) for t in store.sweep_history(sweep.id)] == [
        (None, SweepState.QUEUED), (SweepState.QUEUED, SweepState.RUNNING),
        (SweepState.RUNNING, SweepState.CANCELLED)]
    assert store.job(first.id).state is JobState.QUEUED
    assert sweep.id in [s.id for s in store.sweeps(team="a")]
    assert sweep.id not in [s.id for s in store.sweeps(states=[SweepState.RUNNING])]


def test_the_sweeps_mlflow_store_is_made_while_its_runner_starts(store, tmp_path):
    """The reconciler, as it starts a sweep's runner, makes the sweep's SQLite MLflow store in a
    thread: the runner's parent run opens a store whose tables are made."""
    import sqlite3

    from raytrain_sys.service.sweeps.tracking import prepare_tracking

    spec = parse_sweep(SWEEP, base_dir=str(tmp_path))
    sweep = store.submit_sweep(team="a", name="lr-wd", spec=json.dumps(spec.to_dict()), priority=0, max_workers=None,
                               storage_path=str(tmp_path / "tune"), actor="a")
    prepare_tracking(sweep).join(120)
    db = os.path.join(spec.base["output_dir"], "mlflow.db")
    tables = {r[0] for r in sqlite3.connect(db).execute("select name from sqlite_master where type='table'")}
    assert {"experiments", "runs", "alembic_version"} <= tables, tables


@pytest.fixture
def api(tmp_path):
    from raytrain_sys.service.api import serve
    from raytrain_sys.service.auth import init_admin

    store = Store.open(f"sqlite:///{tmp_path}/service.db")
    store.add_team(Team("a", 4))
    store.add_team(Team("b", 2))
    admin = init_admin(store)
    handle = serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs", base_dir=str(tmp_path))
    yield store, handle.url, {"admin": admin, "a": store.issue_token("a"), "b": store.issue_token("b")}
    handle.stop()
    store.close()


def test_the_api_client_and_cli_submit_list_and_end_a_sweep(api, tmp_path):
    import subprocess
    import sys

    import yaml

    from raytrain_sys.errors import ServiceRequestConflict, ServiceRequestError, ServiceRequestInvalid
    from raytrain_sys.service.client import Client

    store, url, tokens = api
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(BASE))
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({**SWEEP, "base": "tiny.yaml"}))  # a base named by its file
    a, b = Client(url, tokens["a"]), Client(url, tokens["b"])
    sweep = a.submit_sweep(sweep_file, priority=2)
    assert (sweep["state"], sweep["team"], sweep["priority"]) == ("queued", "a", 2)
    assert sweep["spec"]["base"]["data"]["path"] == "/data/tiny" and sweep["trials"] is None
    assert sweep["storage_path"] == str(tmp_path / "raytrain-sys-sweeps")  # beside the store's logs: one a store
    assert [s["id"] for s in a.sweeps()] == [sweep["id"]] and b.sweeps() == []
    with pytest.raises(ServiceRequestError) as other:
        b.sweep(sweep["id"])
    assert other.value.status == 403
    assert a.sweep(sweep["id"])["trials"] == []

    with pytest.raises(ServiceRequestInvalid) as bad:
        a.submit_sweep(with_(space={"optim.lrr": {"uniform": [0.1, 0.2]}}))
    assert bad.value.field == "space.optim.lrr"
    with pytest.raises(ServiceRequestInvalid) as over:  # one trial of 5 workers: team b's quota never holds it
        b.submit_sweep(with_(base={**base_with("elastic", min_workers=5, max_workers=6), "resources": {"num_workers": 5}}))
    assert over.value.field == "base.elastic.min_workers" and "could never start" in str(over.value)
    assert len(store.sweeps()) == 1  # nothing written by a refusal

    env = {**os.environ, "RAYTRAIN_SYS_SERVICE_URL": url, "RAYTRAIN_SYS_TOKEN": tokens["a"]}
    cli = [sys.executable, "-m", "raytrain_sys.cli.main", "sweeps"]
    refused = subprocess.run([*cli, "submit", str(tmp_path / "none.yaml")], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "none.yaml" in refused.stderr and "Traceback" not in refused.stderr
    listed = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True)
    assert f"{sweep['id']}" in listed.stdout and "lr-wd" in listed.stdout and "queued" in listed.stdout
    paused = subprocess.run([*cli, "pause", str(sweep["id"])], env=env, capture_output=True, text=True, check=True)
    assert paused.stdout.strip() == f"sweep {sweep['id']}: paused"
    assert a.resume_sweep(sweep["id"])["state"] == "running"
    assert a.cancel_sweep(sweep["id"], reason="enough")["state"] == "cancelled"
    with pytest.raises(ServiceRequestConflict):
        a.cancel_sweep(sweep["id"])
    assert [t.to_state for t in store.sweep_history(sweep["id"])] == [
        SweepState.QUEUED, SweepState.PAUSED, SweepState.RUNNING, SweepState.CANCELLED]
    audit = [(r.action, r.result.split(" ")[0]) for r in store.audit_log() if "sweep" in r.action]
    assert ("submit_sweep", "refused") in audit and ("cancel_sweep", "ok") in audit


def test_the_example_sweep_is_valid():
    from pathlib import Path

    from raytrain_sys.service.sweeps.spec import load_sweep_file

    sweep = parse_sweep(load_sweep_file(str(Path(__file__).parent.parent / "examples" / "sweeps" / "tinygpt_asha.yaml")),
                        base_dir="/tmp")
    assert (sweep.trial_count, sweep.scheduler.type, sweep.max_workers) == (6, "asha", 4)


def test_a_trial_reports_each_evaluation_of_its_job_once_in_step_order(tmp_path):
    from raytrain_sys.service.sweeps.proxy import TrialJobFailed, follow
    from raytrain_sys.service.sweeps.scheduler import rungs_passed

    store = Store.open(f"sqlite:///{tmp_path}/service.db")
    store.add_team(Team("a", 4))
    sweep = store.submit_sweep(team="a", name="s", spec="{}", storage_path="/tmp", actor="a")
    job = _trial(store, sweep.id, "t1")
    logged: list[tuple[int, float]] = []  # what the job's MLflow run holds, as the run logs it
    moves = iter([
        lambda: logged.extend([(3, 2.0)]),
        lambda: logged.extend([(6, 1.5), (9, 1.2)]),  # two evaluations between two polls
        lambda: (logged.append((12, 1.1)), store.transition(job.id, JobState.QUEUED, JobState.CANCELLED,
                                                             actor="t", reason="done")),
    ])
    reports: list[dict] = []
    ended = follow(store, job.id, "eval_loss", reports.append, lambda j, metric: list(logged),
                   sleep=lambda _s: next(moves)())
    assert ended.state is JobState.CANCELLED
    assert [(r["step"], r["eval_loss"]) for r in reports] == [(3, 2.0), (6, 1.5), (9, 1.2), (12, 1.1)]
    assert all(r["job_id"] == job.id for r in reports)

    failed = _trial(store, sweep.id, "t2")
    store.transition(failed.id, JobState.QUEUED, JobState.FAILED, actor="t", reason="no data")
    with pytest.raises(TrialJobFailed, match="no data"):
        follow(store, failed.id, "eval_loss", reports.append, lambda j, metric: [], sleep=lambda _s: None)
    store.close()
    # ASHA's milestones 3, 6 (x2) below max_t 12: a trial at step 6 passed both, at 12 no more.
    assert [rungs_passed(s, 3, 2, 12) for s in (2, 3, 5, 6, 12)] == [0, 1, 1, 2, 2]


def test_a_trial_rides_out_a_store_it_cannot_read_and_gives_up_after_the_outage_budget(tmp_path):
    """A SQLite store busy past its timeout (a sweep on a loaded machine: "database is locked")
    failed the trial's proxy, and Tune saw a trial error; now the proxy reads again."""
    from raytrain_sys.errors import ServiceStoreError
    from raytrain_sys.service.sweeps.proxy import follow

    class Unreadable(Store):  # the real store, unreadable while ``down`` says so
        down = 0

        def job(self, job_id):
            if self.down:
                self.down -= 1
                raise ServiceStoreError("cannot reach the store: database is locked")
            return super().job(job_id)

    store = Store.open(f"sqlite:///{tmp_path}/service.db")
    store.add_team(Team("a", 4))
    sweep = store.submit_sweep(team="a", name="s", spec="{}", storage_path="/tmp", actor="a")
    job = _trial(store, sweep.id, "t1")
    flaky = Unreadable(store.engine, store.url)
    flaky.down = 3
    logged = [(3, 2.0)]
    sleeps: list[float] = []

    def sleep(s):
        sleeps.append(s)
        if not flaky.down and len(sleeps) > 3:
            store.transition(job.id, JobState.QUEUED, JobState.CANCELLED, actor="t", reason="done")

    reports: list[dict] = []
    ended = follow(flaky, job.id, "eval_loss", reports.append, lambda j, m: list(logged), sleep=sleep)
    assert ended.state is JobState.CANCELLED and [r["step"] for r in reports] == [3]
    assert len(sleeps) >= 3  # each unreadable read waited a poll before the next
    flaky.down = 10 ** 6
    with pytest.raises(ServiceStoreError, match="database is locked"):
        follow(flaky, job.id, "eval_loss", reports.append, lambda j, m: [], sleep=lambda _s: None,
               store_outage_s=0.0)
    store.close()


def test_a_trial_hears_its_jobs_evaluations_from_its_runner_and_reads_mlflow_when_none_answers(tmp_path):
    from raytrain_sys.service.sweeps.proxy import follow

    store = Store.open(f"sqlite:///{tmp_path}/service.db")
    store.add_team(Team("a", 4))
    sweep = store.submit_sweep(team="a", name="s", spec="{}", storage_path="/tmp", actor="a")
    job = _trial(store, sweep.id, "t1")
    logged = [(3, 2.0), (6, 1.5), (9, 1.2), (12, 1.1)]  # what its MLflow run holds in the end
    asks: list[int] = []

    answers = iter([([(3, 2.0)], False), ([(6, 1.5), (9, 1.2)], False), None])

    def live(j, after):  # the runner answers twice, is lost once, then its run ends
        asks.append(after)
        answer = next(answers, "ended")
        if answer == "ended":
            store.transition(j.id, JobState.QUEUED, JobState.CANCELLED, actor="t", reason="done")
            return [], True
        return answer

    reads: list[int] = []
    reports: list[dict] = []
    follow(store, job.id, "eval_loss", reports.append, lambda j, m: reads.append(1) or [p for p in logged if p[0] <= 9],
           live=live, sleep=lambda _s: None)
    # Each evaluation once, in step order; MLflow read only while no runner answered, and at the end.
    assert [(r["step"], r["eval_loss"]) for r in reports] == [(3, 2.0), (6, 1.5), (9, 1.2)]
    assert asks == [0, 3, 9, 9] and len(reads) == 2
    store.close()


@pytest.mark.parametrize("state, step, keep_stopped, action", [
    (JobState.RUNNING, 3, False, "cancel"),
    (JobState.RUNNING, 3, True, "pause"),
    (JobState.QUEUED, None, False, "cancel"),
    (JobState.PAUSED, 3, False, "cancel"),
    (JobState.PAUSED, 3, True, None),
    (JobState.PAUSING, 3, True, None),
    (JobState.CANCELLING, 3, False, None),
    (JobState.FINISHED, 3, False, None),
    (JobState.RUNNING, 12, False, None),
], ids=["a running trial ASHA stops is cancelled",
        "with keep_stopped it is paused and held",
        "a trial whose job still waits is cancelled",
        "a paused trial's job is cancelled",
        "with keep_stopped a paused trial stays paused",
        "with keep_stopped a pausing trial is left to pause",
        "a job being cancelled (at ASHA's decision) is not cancelled again when Tune ends the trial",
        "a job that ended is left alone",
        "a trial at max_t is finishing on its own: no cancel skips its last checkpoint"])
def test_what_tunes_end_of_a_trial_does_to_its_job(state, step, keep_stopped, action):
    from raytrain_sys.service.sweeps.stops import stop_action

    assert stop_action(state, step, 12, keep_stopped) == action


@pytest.mark.parametrize("base, coming, cap, wanted", [
    (2, 0, 4, 2),
    (2, 3, 4, 3),
    (2, 6, 4, 4),
    (2, 1, 4, 2),
    (0, 6, 4, 0),
], ids=["no sweep: the service's spares",
        "a sweep's trials to start: one spare each, free workers or not (a stop frees them at once)",
        "never more than the cap",
        "never fewer than the service's spares",
        "spares off: none for a sweep either"])
def test_how_many_spare_runners_the_service_keeps_while_a_sweeps_trials_are_to_start(base, coming, cap, wanted):
    from raytrain_sys.service.reconciler import spare_runners_wanted

    assert spare_runners_wanted(base, coming, cap) == wanted


@pytest.mark.parametrize("coming, cap, kept", [
    (0, 4, 0),  # no sweep trial to start: given-back spares beyond the pool's count are ended
    (2, 4, 2),  # one for each trial to start
    (9, 4, 4),  # up to the cap
    (3, 0, 0),  # the cap 0 keeps none
], ids=["no trial to start", "one a trial", "capped", "off"])
def test_how_many_given_back_spare_workers_the_pool_keeps_while_a_sweeps_trials_are_to_start(coming, cap, kept):
    from raytrain_sys.service.reconciler import spare_workers_kept

    assert spare_workers_kept(coming, cap) == kept


def test_a_sweeps_trials_still_to_start_are_those_with_no_job_or_a_queued_one():
    from types import SimpleNamespace

    from raytrain_sys.service.sweeps.reconcile import trials_to_start

    def job(trial, state):
        return SimpleNamespace(trial_id=trial, state=state)

    assert trials_to_start(6, []) == 6  # Tune has started no proxy yet
    assert trials_to_start(6, [job("a", JobState.QUEUED), job("b", JobState.STARTING)]) == 5
    # A PBT segment is its trial's; a trial that ended has started.
    assert trials_to_start(4, [job("a", JobState.CANCELLED), job("a", JobState.RUNNING), job("b", JobState.FINISHED),
                               job("c", JobState.PAUSED), job("d", JobState.RUNNING)]) == 0


def test_only_pbt_waits_for_the_checkpoint_of_the_step_a_trial_reports():
    from raytrain_sys.service.sweeps.segments import CHECKPOINT_WAIT_S, checkpoint_wait_s

    # PBT's exploit starts from the checkpoint of the step it ranked; ASHA decides at once.
    assert (checkpoint_wait_s("pbt"), checkpoint_wait_s("asha"), checkpoint_wait_s("fifo")) == (CHECKPOINT_WAIT_S, 0, 0)


@pytest.mark.parametrize("mode, curves, best", [
    # a trial ASHA stopped at step 3 whose job logged a better value before its cancel landed
    ("min", {"a": [(3, 4.0), (12, 3.9)], "b": [(3, 4.5), (6, 4.1), (12, 3.8)]}, ("b", 3.8)),
    ("max", {"a": [(3, 0.2), (6, 0.7)], "b": [(3, 0.6)]}, ("a", 0.7)),
    ("min", {"a": [(3, 1.0)], "b": [(3, 1.0)]}, ("a", 1.0)),  # a tie: the first in the table
    ("min", {"a": [], "b": []}, (None, None)),  # nothing logged: no best (the sweep fails)
])
def test_the_best_trial_is_the_one_whose_job_logged_the_best_value(mode, curves, best):
    from raytrain_sys.service.sweeps.outcome import best_of

    assert best_of([{"trial": t, "curve": c} for t, c in curves.items()], mode) == best


def test_the_parent_run_holds_a_plot_of_every_trials_curve_with_the_best_drawn_bold(tmp_path):
    """What a user opens on the sweep's parent run: one line per trial that logged a value
    (a trial ended before its first evaluation has none), the best bold and named, the trials
    stopped early dashed; the PNG is an artifact of the run beside trials.json."""
    import mlflow

    from raytrain_sys.monitor.plots import sweep_curves_figure
    from raytrain_sys.service.sweeps import tracking as st

    table = [{"trial": "t1", "state": "finished", "curve": [(3, 4.2), (6, 3.9), (12, 3.7)]},
             {"trial": "t2", "state": "cancelled", "curve": [(3, 4.6), (6, 4.4)]},
             {"trial": "t3", "state": "cancelled", "curve": []}]
    fig = sweep_curves_figure(table, "eval_loss", best_trial="t1")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"t1 (best)", "t2"}
    assert list(lines["t1 (best)"].get_ydata()) == [4.2, 3.9, 3.7]
    assert lines["t1 (best)"].get_linewidth() > lines["t2"].get_linewidth()
    assert lines["t1 (best)"].get_linestyle() == "-" and lines["t2"].get_linestyle() == "--"
    assert fig.axes[0].get_ylabel() == "eval_loss"
    assert sweep_curves_figure(table[2:], "eval_loss") is None  # nothing logged: no empty plot

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = st.start_parent_run(uri, "sweeps", "sweep-1", {"metric": "eval_loss"}, {})
    st.end_parent_run(uri, run_id, {"best_eval_loss": 3.7}, {"best_trial": "t1"}, {"trials.json": table},
                      figures={"sweep_curves.png": fig})
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert {a.path for a in client.list_artifacts(run_id)} == {"trials.json", "sweep_curves.png"}
    with open(client.download_artifacts(run_id, "sweep_curves.png", str(tmp_path)), "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_pbt_sweep_is_accepted_and_its_segments_start_from_their_donors_checkpoint():
    """PBT mutates what a resume takes from the spec (lr) and any field outside the training
    settings (eval.max_rows); grids are cloned with the donor. A segment's job runs in a
    directory of its own and resumes the donor's checkpoint with its mutated fields allowed."""
    raw = with_(scheduler={"type": "pbt", "quantile_fraction": 0.5},
                space={"optim.lr": {"loguniform": [1e-4, 1e-2]}, "eval.max_rows": {"choice": [8, 16]},
                       "optim.weight_decay": {"grid": [0.0, 0.1]}})
    sweep = parse_sweep(raw, base_dir="/tmp")
    assert (sweep.scheduler.type, sweep.scheduler.perturbation_interval_steps, sweep.scheduler.quantile_fraction) == \
        ("pbt", 5, 0.5)  # the interval defaults to the base's checkpoint interval
    assert sweep_from_dict(json.loads(json.dumps(sweep.to_dict()))) == sweep
    first = trial_spec(sweep, {"optim.lr": 0.004}, 7, "t1")
    assert first["checkpoint"]["resume_from"] == "" and first["checkpoint"]["resume_changes"] == []
    donor = "/runs/sweep-7/t2/tiny/checkpoints/step_00000010"
    seg = trial_spec(sweep, {"optim.lr": 0.005}, 7, "t1", segment=2, donor_checkpoint=donor)
    assert seg["checkpoint"]["resume_from"] == donor and seg["checkpoint"]["resume_changes"] == ["optim.lr"]
    assert seg["output_dir"] == first["output_dir"] + "/segment-2" and seg["name"] == "tiny-t1-s2"
    assert seg["optim"]["lr"] == 0.005


def test_a_checkpoint_resumes_with_the_changes_its_spec_allows_and_no_others():
    from raytrain_sys.checkpoint.checkpointer import CheckpointInfo
    from raytrain_sys.control.supervisor.checkpoints import check_compatible
    from raytrain_sys.errors import CheckpointError
    from raytrain_sys.spec import from_dict

    donor = from_dict({"optim": {"lr": 1e-3}})
    info = CheckpointInfo("/c/step_00000010", 10, {"training_hash": donor.training_hash(),
                                                    "spec": donor.plain_dict()})
    with pytest.raises(CheckpointError, match="optim.lr"):  # a changed lr, not allowed
        check_compatible(from_dict({"optim": {"lr": 2e-3}}), info)
    check_compatible(from_dict({"optim": {"lr": 2e-3}, "checkpoint": {"resume_changes": ["optim.lr"]}}), info)
    with pytest.raises(CheckpointError, match="optim.weight_decay"):  # allowed lr, but weight decay changed too
        check_compatible(from_dict({"optim": {"lr": 2e-3, "weight_decay": 0.5},
                                    "checkpoint": {"resume_changes": ["optim.lr"]}}), info)


def _job(job_id: int, segment: int, state: JobState = JobState.RUNNING, resume_from: str = ""):
    from raytrain_sys.service.model import JobRecord

    return JobRecord(id=job_id, team="a", name="t", spec=json.dumps({"checkpoint": {"resume_from": resume_from}}),
                     priority=0, state=state, held=False, min_workers=1, max_workers=1, elastic=False, workers=1,
                     target_workers=1, restarts=0, mlflow_run_id=None, last_checkpoint_step=None,
                     last_checkpoint_at_s=None, submitted_at_s=0.0, waiting_since_s=0.0, started_at_s=None,
                     updated_at_s=0.0, message="", sweep_id=1, trial_id="a", segment=segment)


def _pointer(trial: str, step: int):
    from raytrain_sys.service.sweeps.segments import Pointer

    return Pointer(trial, 0, 9, step, f"/runs/{trial}/checkpoints/step_{step:08d}")


SEGMENT_PLANS = [
    ("a new trial submits its first segment", None, None, (0, None, None, False)),
    ("a trial driven again before its first report re-attaches", None, _job(4, 0), (0, None, None, False)),
    ("a trial restored with its own checkpoint re-attaches to its newest segment", _pointer("a", 6), _job(5, 1),
     (1, None, None, False)),
    ("an exploit ends the live segment and starts the next from the donor's checkpoint", _pointer("b", 6),
     _job(4, 0), (1, "b", 4, True)),
    ("an exploit of a trial whose segment ended ends nothing", _pointer("b", 6), _job(4, 0, JobState.CANCELLED),
     (1, "b", None, True)),
    ("a proxy driven again after an exploit re-attaches to the segment it started", _pointer("b", 6),
     _job(5, 1, resume_from="/runs/b/checkpoints/step_00000006"), (1, "b", None, False)),
    ("a second exploit from another checkpoint starts a third segment", _pointer("b", 12),
     _job(5, 1, resume_from="/runs/b/checkpoints/step_00000006"), (2, "b", 5, True)),
    ("an exploit from a donor at the last step has nothing to train: the newest segment", _pointer("b", 20),
     _job(4, 0, JobState.FINISHED), (0, None, None, False)),
]


@pytest.mark.parametrize("pointer, newest, expected", [c[1:] for c in SEGMENT_PLANS], ids=[c[0] for c in SEGMENT_PLANS])
def test_the_segment_a_trials_proxy_follows(pointer, newest, expected):
    from raytrain_sys.service.sweeps.segments import segment_plan

    plan = segment_plan("a", pointer, newest, max_steps=20)
    assert (plan.segment, plan.donor.trial_id if plan.donor else None, plan.end_job, plan.new) == expected


CURVES = [
    ("one segment: its curve", [(0, [(3, 4.0), (6, 3.5)])], [(3, 4.0), (6, 3.5)]),
    ("an exploit at step 6: the first segment up to 6, then the clone's",
     [(0, [(3, 4.0), (6, 3.9), (9, 3.8)]), (6, [(9, 3.1), (12, 3.0)])], [(3, 4.0), (6, 3.9), (9, 3.1), (12, 3.0)]),
    ("a segment exploited before it logged anything", [(0, [(3, 4.0)]), (3, []), (3, [(6, 3.0)])],
     [(3, 4.0), (6, 3.0)]),
]


@pytest.mark.parametrize("segments, curve", [c[1:] for c in CURVES], ids=[c[0] for c in CURVES])
def test_a_trials_curve_across_its_segments(segments, curve):
    from raytrain_sys.service.sweeps.outcome import checkpoint_step_of, trial_curve

    assert trial_curve(segments) == curve
    assert [checkpoint_step_of(u) for u in ("", "/c/step_00000012", "s3://b/c/step_00000003/")] == [0, 12, 3]


def test_a_segments_run_is_marked_with_its_donor_once_the_store_has_its_id(tmp_path):
    """A PBT segment's first evaluation can be read from its runner before the service's pass
    records its MLflow run's id (the run opens beside the first steps): its run is marked with
    its donor and mutated lr at the first report after the id is recorded (a report before it
    marked nothing, for good), and once only."""
    import dataclasses

    import mlflow

    from raytrain_sys.service.sweeps.segments import Reporter, SegmentPlan
    from raytrain_sys.service.sweeps import tracking as st

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sweep = parse_sweep(with_(base=base_with("tracking", uri=uri), scheduler={"type": "pbt"},
                              space={"optim.lr": {"loguniform": [1e-4, 1e-2]}}), base_dir=str(tmp_path))
    client = mlflow.MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("sweeps")).info.run_id
    donor = _pointer("b", 6)
    report = Reporter(None, sweep, "a", SegmentPlan(1, donor=donor, end_job=4, new=True), {"optim.lr": 0.005})
    job = dataclasses.replace(_job(5, 1, resume_from=donor.uri), spec=json.dumps({"optim": {"lr": 0.005}}))
    report.mark(job)  # no run id recorded yet
    assert st.TAG_DONOR_STEP not in client.get_run(run_id).data.tags
    for _ in range(2):
        report.mark(dataclasses.replace(job, mlflow_run_id=run_id))
    tags = client.get_run(run_id).data.tags
    assert (tags[st.TAG_SEGMENT], tags[st.TAG_DONOR_TRIAL], tags[st.TAG_DONOR_STEP], tags[st.TAG_DONOR_CHECKPOINT]) == \
        ("1", "b", "6", donor.uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "optim.lr")] == [(6, 0.005)]
