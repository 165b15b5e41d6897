"""Sweeps on the job service, on the session cluster (four 1-CPU worker nodes): Ray Tune decides,
every trial is a service job.

What a user would notice: an ASHA sweep of a tiny GPT ends with its best trial recorded; each
trial is a service job that ends finished, or cancelled when ASHA stopped it; the best value is
the lowest evaluation any trial's job logged; MLflow has one parent run naming the best trial,
every trial's run its child, with each trial's config and curve as its child logged them.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import ray

from raytrain_sys.service.model import JobState, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.sweeps.runner import mlflow_history
from tests.helpers import tiny_spec
from tests.service_common import StepGates, runner_heard, running_service

WAIT_S = 420.0


@pytest.fixture
def gates(tmp_path):
    root = tmp_path / "gates"
    root.mkdir()
    return StepGates(str(root))


def base_spec(tmp_path, dataset) -> dict:
    """A tiny GPT of 12 steps, evaluated (on the first rows of its own data) and checkpointed every
    3, elastic in 1..2 workers."""
    return tiny_spec(tmp_path, dataset, train={"max_steps": 12, "log_every_steps": 3},
                     eval={"every_steps": 3, "max_rows": 16, "batch_rows": 8, "dataset": dataset},
                     checkpoint={"every_steps": 3, "keep_last": 2},
                     elastic={"min_workers": 1, "max_workers": 2},
                     resources={"num_workers": 1}).to_dict()


def wait_for(predicate, what: str, timeout_s: float = WAIT_S, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(every_s)


def test_an_asha_sweep_stops_trials_as_cancelled_jobs_and_records_its_best(ray_cluster, tiny_dataset, tmp_path,
                                                                            gates):
    db = tmp_path / "service.db"
    sweep = {"name": "lr", "base": base_spec(tmp_path, tiny_dataset), "metric": "eval_loss", "mode": "min",
             "num_samples": 1, "space": {"optim.lr": {"grid": [3e-2, 1e-2, 3e-3, 1e-5]}},
             "scheduler": {"type": "asha", "grace_period_steps": 3, "reduction_factor": 2}}
    with running_service(db, gates) as svc:
        ray.get(svc.add_team.remote("a", 4))
        record = ray.get(svc.submit_sweep.remote("a", sweep))
        store = Store.open(f"sqlite:///{db}")
        try:
            wait_for(lambda: store.sweep(record["id"]).state.terminal, "the sweep's end")
            done = store.sweep(record["id"])
            trials = store.trials(record["id"])
        finally:
            store.close()
    assert done.state is SweepState.FINISHED, done.message
    assert len(trials) == 4 and all(t.state.terminal for t in trials), [(t.id, t.state) for t in trials]
    # A trial ends finished, or cancelled because ASHA stopped it (whether ASHA stops one here
    # depends on the order the trials reach its rungs: the first at a rung always goes on).
    stopped = [t for t in trials if t.state is JobState.CANCELLED]
    assert all("stopped by the sweep's scheduler" in t.message for t in stopped), \
        [(t.id, t.state, t.message) for t in trials]
    finished = [t for t in trials if t.state is JobState.FINISHED]
    assert finished and len(finished) + len(stopped) == 4, [(t.id, t.state, t.message) for t in trials]
    # The best is the lowest evaluation any trial's job logged, and it names that trial.
    curves = {t.trial_id: mlflow_history(t, "eval_loss") for t in trials}
    lowest = min((value, trial) for trial, curve in curves.items() for _, value in curve)
    assert done.best_trial == lowest[1]
    assert done.best_value == pytest.approx(lowest[0], rel=1e-9)
    # MLflow: one parent run naming the best trial; every trial's run is its child, and the
    # parent's table holds each trial's curve as the child logged it.
    from mlflow import MlflowClient

    from raytrain_sys.sweeps.spec import tracking_uri
    from raytrain_sys.sweeps.runner import spec_of

    client = MlflowClient(tracking_uri(spec_of(done)))
    parent = client.get_run(done.mlflow_parent_run_id)
    assert parent.data.tags["best_trial"] == done.best_trial and parent.info.status == "FINISHED"
    for t in trials:
        assert client.get_run(t.mlflow_run_id).data.tags["mlflow.parentRunId"] == parent.info.run_id
    table = json.loads(open(client.download_artifacts(parent.info.run_id, "trials.json", str(tmp_path))).read())
    assert "sweep_curves.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    best = next(row for row in table if row["trial"] == done.best_trial)
    assert [tuple(p) for p in best["curve"]] == curves[done.best_trial]
    assert best["config"]["optim.lr"] == json.loads(
        next(t for t in trials if t.trial_id == done.best_trial).spec)["optim"]["lr"]


def tune_trial_states(experiment_dir: str) -> dict[str, str]:
    """Each trial's status as Tune last saved its experiment (what ``Tuner.restore`` reads)."""
    import glob

    states: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(experiment_dir, "experiment_state-*.json"))):
        with open(path) as f:
            data = json.load(f)
        for trial_json, _ in data.get("trial_data", []):
            trial = json.loads(trial_json)
            states[trial["trial_id"]] = trial["status"]
    return states


def test_a_lost_sweep_runner_comes_back_through_restore_and_reruns_nothing(ray_cluster, tiny_dataset, tmp_path,
                                                                            gates):
    """The sweep runner killed mid-sweep, one trial finished and one training: the running trial's
    job keeps committing steps while no runner is up; the reconciler starts another, which
    restores Tune's experiment: the finished trial is not run again, no trial's job is submitted
    twice or restarted, and MLflow holds one child run per trial."""
    from raytrain_sys.sweeps.runner import experiment_name, find_runner

    db = tmp_path / "service.db"
    base = base_spec(tmp_path, tiny_dataset)
    base["checkpoint"]["every_steps"] = 1  # a committed step each step: the outage's progress is seen
    sweep = {"name": "restore", "base": base, "metric": "eval_loss", "mode": "min", "num_samples": 1,
             "space": {"optim.lr": {"grid": [1e-2, 3e-3]}}, "scheduler": {"type": "fifo"}}
    gates.hold(2, 3)  # the second trial's job waits at step 3 until the first has finished
    with running_service(db, gates) as svc:
        ray.get(svc.add_team.remote("a", 4))
        record = ray.get(svc.submit_sweep.remote("a", sweep))
        store = Store.open(f"sqlite:///{db}")
        try:
            wait_for(lambda: gates.reached(2, 3) and store.job(1).state is JobState.FINISHED, "trial job 1's end")
            first = store.job(1)
            experiment = os.path.join(store.sweep(record["id"]).storage_path,
                                      experiment_name(store.sweep(record["id"])))
            wait_for(lambda: tune_trial_states(experiment).get(first.trial_id) == "TERMINATED",
                     "Tune's saved state of the finished trial")
            handle = find_runner(store.sweep(record["id"]))
            old_pid = ray.get(handle.status.remote())["pid"]
            at_kill = store.job(2).last_checkpoint_step
            ray.kill(handle, no_restart=True)
            gates.hold(2, 12)  # live when the runner is back, whatever the outage's length
            gates.go(2, 3)
            log_path = tmp_path / "raytrain-sys-logs" / f"sweep-{record['id']}.log"
            wait_for(lambda: "restoring its Tune experiment" in log_path.read_text(), "the runner's restore")
            during_outage = store.job(2).last_checkpoint_step
            new = find_runner(store.sweep(record["id"]))
            assert new is not None and ray.get(new.status.remote())["pid"] != old_pid
            gates.go(2, 12)
            wait_for(lambda: store.sweep(record["id"]).state.terminal, "the sweep's end")
            done = store.sweep(record["id"])
            trials = store.trials(record["id"])
            jobs = store.jobs()
            submits = [(a.target, a.result) for a in store.audit_log(actor=f"sweep {record['id']}")
                       if a.action == "submit"]
        finally:
            store.close()
    assert done.state is SweepState.FINISHED and done.runner_restarts == 1, (done.state, done.message)
    # The running trial trained on while no runner was up, and was never restarted.
    assert during_outage > at_kill, (at_kill, during_outage)
    assert [t.id for t in trials] == [j.id for j in jobs] == [1, 2]
    assert all(t.state is JobState.FINISHED and t.restarts == 0 for t in trials), \
        [(t.id, t.state, t.restarts, t.message) for t in trials]
    # Each time a trial's proxy runs it submits (and re-attaches to) its job: the finished trial
    # was driven once, the running one once before the loss and once after the restore.
    assert sorted(submits) == [("job 1 (team a)", "ok"), ("job 2 (team a)", "ok"), ("job 2 (team a)", "ok")], submits
    from mlflow import MlflowClient

    from raytrain_sys.sweeps.runner import spec_of
    from raytrain_sys.sweeps.spec import tracking_uri

    client = MlflowClient(tracking_uri(spec_of(done)))
    parent = client.get_run(done.mlflow_parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_id for r in children) == sorted(t.mlflow_run_id for t in trials)
    assert done.best_trial in {t.trial_id for t in trials}


def trial_summary(tmp_path, sweep_id: int, trial_id: str) -> dict:
    """summary.json of the trial's run (its job runs in <output_dir>/sweep-<id>/<trial>)."""
    import glob

    runs = [p for p in glob.glob(str(tmp_path / "runs" / f"sweep-{sweep_id}" / trial_id / "*" / "summary.json"))
            if not os.path.islink(os.path.dirname(p))]
    assert len(runs) == 1, runs
    with open(runs[0]) as f:
        return json.load(f)


def test_an_asha_stop_cancels_the_trial_and_the_survivor_grows_into_its_worker(ray_cluster, tiny_dataset, tmp_path,
                                                                               gates):
    """Two trials in a team of 2 workers, one worker each; the worse one reaches ASHA's first
    rung (step 3) after the better one, so ASHA stops it: its job is cancelled at step 3, and the
    scheduler grows the survivor into the freed worker, where it commits its next steps on 2."""
    db = tmp_path / "service.db"
    sweep = {"name": "stop", "base": base_spec(tmp_path, tiny_dataset), "metric": "eval_loss", "mode": "min",
             "num_samples": 1, "space": {"optim.lr": {"grid": [3e-2, 1e-5]}},
             "scheduler": {"type": "asha", "grace_period_steps": 3, "reduction_factor": 2}}
    gates.hold(1, 2)
    gates.hold(2, 2)  # both before their first evaluation (step 3): the test orders them
    with running_service(db, gates) as svc:
        ray.get(svc.add_team.remote("a", 2))
        record = ray.get(svc.submit_sweep.remote("a", sweep))
        store = Store.open(f"sqlite:///{db}")
        try:
            wait_for(lambda: gates.reached(1, 2) and gates.reached(2, 2), "both trials at step 2")
            lr = {j: json.loads(store.job(j).spec)["optim"]["lr"] for j in (1, 2)}
            good, bad = sorted((1, 2), key=lambda j: -lr[j])  # 3e-2 learns, 1e-5 hardly moves
            gates.hold(good, 6)
            gates.go(good, 2)
            wait_for(lambda: store.job(good).rung >= 1, "the better trial past ASHA's first rung")
            gates.hold(bad, 4)  # it cannot finish before its cancel lands, however late
            gates.go(bad, 2)
            wait_for(lambda: store.job(bad).state is JobState.CANCELLING, "ASHA's stop of the worse trial")
            gates.go(bad, 4)
            wait_for(lambda: store.job(bad).state is JobState.CANCELLED, "the stopped trial's cancel")
            wait_for(lambda: gates.reached(good, 6) and store.job(good).target_workers == 2,
                     "the survivor's growth into the freed worker")
            gates.wait_for_newcomer(good)
            gates.go(good, 6)
            wait_for(lambda: store.sweep(record["id"]).state.terminal, "the sweep's end")
            done = store.sweep(record["id"])
            stopped, survivor = store.job(bad), store.job(good)
            stopped_at = next(t.at_s for t in store.history(bad) if t.to_state is JobState.CANCELLING)
            grows = [t for t in store.history(good) if t.reason.startswith("grow to 2")]
            survivor_states = [t.to_state for t in store.history(good)]
        finally:
            store.close()
    assert done.state is SweepState.FINISHED, done.message
    assert "stopped by the sweep's scheduler at step 3" in stopped.message, stopped.message
    # The survivor ran to its end (ASHA's end of a trial at max_t is no cancel of its job).
    assert survivor.state is JobState.FINISHED and JobState.CANCELLING not in survivor_states, survivor_states
    assert done.best_trial == survivor.trial_id
    # The freed worker went to the survivor, decided after the stop, and it trained on it (it
    # started on 2, the team's 2 free, and shrank to 1 for the second trial).
    assert grows and grows[0].at_s >= stopped_at, (stopped_at, [(t.at_s, t.reason) for t in grows])
    summary = trial_summary(tmp_path, record["id"], survivor.trial_id)
    worlds = summary["world_sizes"]
    assert worlds[5] == 1 and worlds[-1] == 2, worlds
    assert summary["steps_redone"] == 0
    assert trial_summary(tmp_path, record["id"], stopped.trial_id)["world_sizes"][-1] == 1


def job_summary(job) -> dict:
    """summary.json of the job's run (in its spec's output_dir; a segment's is its own)."""
    import glob

    out = json.loads(job.spec)["output_dir"]
    runs = [p for p in glob.glob(os.path.join(out, "*", "summary.json")) if not os.path.islink(os.path.dirname(p))]
    assert len(runs) == 1, (job.id, runs)
    with open(runs[0]) as f:
        return json.load(f)


def eval_at(job, step: int) -> float | None:
    return dict(mlflow_history(job, "eval_loss")).get(step) if job.mlflow_run_id else None


def test_a_pbt_exploit_starts_the_next_segment_from_the_donors_committed_checkpoint(ray_cluster, tiny_dataset,
                                                                                     tmp_path, gates):
    """Four PBT trials of one worker each (11 steps, evaluated and checkpointed every 3, perturbed
    at 6, half the population in each quantile). Once all four have reported step 6, PBT ranks
    them and exploits the lower two; their jobs (held at step 7) are cancelled and each
    trial's next segment, a job of its own, starts from its donor's committed checkpoint with the
    mutated lr: the clone's parameters at its first step (the state its workers saved at the
    start) equal the donor's checkpoint tensor for tensor. Tune never skips an exploit; every
    job trains each step once and reads its data on from the checkpoint's position; a segment's
    MLflow run is a child of the sweep's, tagged with its donor; the trial's curve runs across
    its segments."""
    from tests.helpers import assert_params_equal, final_params

    db = tmp_path / "service.db"
    base = base_spec(tmp_path, tiny_dataset)
    base["train"]["max_steps"] = 11  # one perturbation (at 6; at 12 there would be another)
    base["checkpoint"]["keep_last"] = 10  # a donor's checkpoint outlives the exploits of this short sweep
    base["elastic"] = {"min_workers": 0, "max_workers": 0}
    sweep = {"name": "pbt", "base": base, "metric": "eval_loss", "mode": "min", "num_samples": 4,
             "space": {"optim.lr": {"loguniform": [1e-5, 3e-2]}},
             "scheduler": {"type": "pbt", "perturbation_interval_steps": 6, "quantile_fraction": 0.5,
                           "resample_probability": 0.0}}
    for job_id in (1, 2, 3, 4):
        gates.hold(job_id, 7)  # no first segment finishes before the exploits' cancels land (at 9)
    with running_service(db, gates) as svc:
        ray.get(svc.add_team.remote("a", 4))
        record = ray.get(svc.submit_sweep.remote("a", sweep))
        log_path = tmp_path / "raytrain-sys-logs" / f"sweep-{record['id']}.log"
        store = Store.open(f"sqlite:///{db}")
        try:
            exploited_ids = wait_for(lambda: (lambda ids: ids if len(ids) == 2 else None)(
                [t.id for t in store.trials(record["id"]) if t.state is JobState.CANCELLING]),
                "PBT's exploits ending the lower half's jobs")
            for j in exploited_ids:
                runner_heard(tmp_path, j, "cancel")  # else its step loop may end the run first
            for j in (1, 2, 3, 4):
                gates.go(j, 7)
            wait_for(lambda: store.sweep(record["id"]).state.terminal, "the sweep's end")
            done = store.sweep(record["id"])
            trials = store.trials(record["id"])
        finally:
            store.close()
    sweep_log = log_path.read_text()
    assert done.state is SweepState.FINISHED, done.message
    assert "Skip exploit" not in sweep_log
    assert "[Exploit] Cloning trial" in sweep_log
    exploited = store_job = next(t for t in trials if t.id == exploited_ids[0])
    for job in (t for t in trials if t.id in exploited_ids):
        assert job.state is JobState.CANCELLED and "exploited by PBT" in job.message, job.message
    segments = [t for t in trials if t.segment > 0]
    assert sorted(s.trial_id for s in segments if s.segment == 1) == \
        sorted(t.trial_id for t in trials if t.id in exploited_ids), [(t.id, t.trial_id, t.segment) for t in trials]
    from mlflow import MlflowClient

    from raytrain_sys.sweeps.runner import checkpoint_step_of, resumed_from, spec_of, trial_table
    from raytrain_sys.sweeps.spec import tracking_uri
    from raytrain_sys.tracking import mlflow_tracker as mt

    client = MlflowClient(tracking_uri(spec_of(done)))
    gbs = base["train"]["global_batch_size"]
    for seg in segments:
        donor_uri = resumed_from(seg)
        start = checkpoint_step_of(donor_uri)
        summary = job_summary(seg)
        # The clone at its first step: the state its workers saved at the start (in its own root)
        # is the donor's checkpoint, tensor for tensor.
        own = next(c for c in summary["checkpoints"] if c["step"] == start)
        assert os.path.dirname(own["uri"].rstrip("/")) != os.path.dirname(donor_uri.rstrip("/"))
        assert_params_equal(final_params(own["uri"]), final_params(donor_uri))
        run = client.get_run(seg.mlflow_run_id)
        assert run.data.tags[mt.TAG_PARENT_RUN] == done.mlflow_parent_run_id
        assert run.data.tags[mt.TAG_DONOR_STEP] == str(start) and run.data.tags[mt.TAG_DONOR_CHECKPOINT] == donor_uri
        donor_trial = run.data.tags[mt.TAG_DONOR_TRIAL]
        assert donor_trial != seg.trial_id and donor_uri.split("/sweep-")[1].split("/")[1] == donor_trial
        lr = json.loads(seg.spec)["optim"]["lr"]
        assert [(m.step, m.value) for m in client.get_metric_history(seg.mlflow_run_id, "optim.lr")] == [(start, lr)]
        assert min(step for step, _ in mlflow_history(seg, "eval_loss")) > start  # it evaluates after its start
    # Every job trained each of its steps once, its data read on from where its start left it.
    for job in trials:
        summary = job_summary(job)
        assert summary["steps_redone"] == 0, (job.id, summary["steps_redone"])
        assert summary["data_cursor"] == summary["committed_steps"] * gbs, (job.id, summary["data_cursor"])
    assert all(t.state in (JobState.FINISHED, JobState.CANCELLED) for t in trials)
    # The exploited trial's curve: its first job's up to the donor's step, then its segment's.
    spec = spec_of(done)
    store = Store.open(f"sqlite:///{db}")
    try:
        row = next(r for r in trial_table(store, done.id, spec) if r["trial"] == exploited.trial_id)
    finally:
        store.close()
    first_seg = min((s for s in segments if s.trial_id == exploited.trial_id), key=lambda s: s.segment)
    start = checkpoint_step_of(resumed_from(first_seg))
    assert [p for p in row["curve"] if p[0] <= start] == [p for p in mlflow_history(store_job, "eval_loss")
                                                           if p[0] <= start]
    newest = max((t for t in trials if t.trial_id == exploited.trial_id), key=lambda t: t.segment)
    assert row["curve"][-1] == mlflow_history(newest, "eval_loss")[-1] and len(row["segments"]) >= 2
    assert row["job"] == newest.id and row["config"]["optim.lr"] == json.loads(newest.spec)["optim"]["lr"]
