"""Sweeps on the job service, on the session cluster (four 1-CPU worker nodes): Ray Tune decides,
every trial is a service job.

What a user would notice: an ASHA sweep of a tiny GPT ends with its best trial recorded; each
trial is a service job that ends finished, or cancelled when ASHA stopped it; the best value is
the lowest evaluation any trial's job logged; MLflow has one parent run naming the best trial,
every trial's run its child, with each trial's config and curve as its child logged them.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
import ray
import torch

from raytrain_sys.service.model import JobState, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.tracking import mlflow_history
from tests.helpers import read_summary, tiny_spec
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


def wait_for(predicate, what: str, timeout_s: float = WAIT_S, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(every_s)


def tune_trial_states(experiment_dir: str) -> dict[str, str]:
    """Each trial's status as Tune last saved its experiment (what ``Tuner.restore`` reads)."""

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
    from raytrain_sys.service.sweeps.names import experiment_name, find_runner

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

    from raytrain_sys.service.sweeps.spec import spec_of, tracking_uri

    client = MlflowClient(tracking_uri(spec_of(done)))
    parent = client.get_run(done.mlflow_parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_id for r in children) == sorted(t.mlflow_run_id for t in trials)
    assert done.best_trial in {t.trial_id for t in trials}


def trial_summary(tmp_path, sweep_id: int, trial_id: str) -> dict:
    """summary.json of the trial's run (its job runs in <output_dir>/sweep-<id>/<trial>)."""

    runs = [p for p in glob.glob(str(tmp_path / "runs" / f"sweep-{sweep_id}" / trial_id / "*" / "summary.json"))
            if not os.path.islink(os.path.dirname(p))]
    assert len(runs) == 1, runs
    with open(runs[0]) as f:
        return json.load(f)


def pass_of(service_log: str, pattern: str) -> list[tuple[int, int]]:
    """(pass, job) of each line of the reconciler's log that matches ``pattern`` (a regex with one
    group, the job's id, after the line's ``pass N: ``)."""
    import re

    return [(int(m.group(1)), int(m.group(2))) for m in re.finditer(r"pass (\d+): " + pattern, service_log)]


def passes_at(service_log: str, pattern: str) -> list[tuple[float, int, int]]:
    """(time, pass, job) of each line of the reconciler's log that matches ``pattern`` as in
    ``pass_of``, the time the line's (the service logs in this machine's local time), in seconds
    since the epoch as the store's history records them."""
    import re
    from datetime import datetime

    line = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: pass (\d+): "
    return [(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m.group(2)), int(m.group(3)))
            for m in re.finditer(line + pattern, service_log, re.MULTILINE)]


def test_a_six_trial_asha_sweep_over_the_http_api_hands_each_stopped_trials_worker_on_in_one_pass(
        ray_cluster, tiny_dataset, tmp_path, gates):
    """Issue 28's done-when 1: six trials (lr x weight decay) submitted with POST /v1/sweeps, all
    running at once on one worker each (half a CPU; the service counts 6 workers and the team's
    quota, raised from 1 to 6 once every trial's job is queued, starts none grown). Every job is
    held before its first evaluation (step 3, ASHA's only rung) and let go one at a time, the
    learning ones from the worst expected to the best (so each is the best so far and goes on) and
    the two of lr 1e-5 last: ASHA stops both, and they are held after that evaluation until the
    stop reaches them. The survivors wait at step 4 until both have ended: each stopped trial's
    worker goes to a survivor, grown by a pass from the first one after the stop (a cancelling
    job's workers no longer count as held, and ASHA's stop wakes the reconciler) to the one after
    the pass that recorded the stopped job's end ("within one pass", read from the service log,
    whose lines of a pass carry its number; each growth given to one stopped trial only), and that
    survivor commits a step on it (its MLflow world_size; the seconds from the end are printed). The parent run names the best trial, whose config and curve are its child
    run's."""
    from mlflow import MlflowClient

    from raytrain_sys.service.client import Client
    from raytrain_sys.service.teams import Team
    from raytrain_sys.service.sweeps.spec import spec_of, tracking_uri
    from tests.test_jobs_page import free_port

    db = tmp_path / "service.db"
    base = base_spec(tmp_path, tiny_dataset)
    base["resources"]["cpus_per_worker"] = 0.5
    sweep = {"name": "lr-wd", "base": base, "metric": "eval_loss", "mode": "min", "num_samples": 1,
             "space": {"optim.lr": {"grid": [3e-2, 1e-2, 1e-5]}, "optim.weight_decay": {"grid": [0.0, 0.1]}},
             # One rung (3 x 4 reaches max_t): a survivor is never stopped before it trains on its new worker.
             "scheduler": {"type": "asha", "grace_period_steps": 3, "reduction_factor": 4}}
    for job_id in range(1, 7):
        gates.hold(job_id, 2)
        gates.hold(job_id, 4)
    port = free_port()

    def lr(job) -> float:
        return json.loads(job.spec)["optim"]["lr"]

    def worst_first(job) -> tuple:  # a lower lr learns less in 3 steps; weight decay 0.1 costs a little
        return lr(job) < 1e-4, lr(job), -json.loads(job.spec)["optim"]["weight_decay"]

    with running_service(db, gates, serve_api=True, port=port, cluster_workers=6) as svc:
        ray.get(svc.add_team.remote("a", 1))
        store = Store.open(f"sqlite:///{db}")
        try:
            client = Client(f"http://127.0.0.1:{port}", store.issue_token("a"))
            record = client.submit_sweep(sweep)
            assert record["state"] == "queued" and record["team"] == "a", record
            wait_for(lambda: len(store.trials(record["id"])) == 6, "every trial's job submitted")
            store.update_team(Team("a", 6))
            order = [t.id for t in sorted(store.trials(record["id"]), key=worst_first)]
            released: dict[int, set[int]] = {2: set(), 4: set()}

            def release() -> bool:
                trials = {t.id: t for t in store.trials(record["id"])}
                # The next first evaluation once Tune has ranked the one before (rung: it read it).
                ranked = [j for j in order if j in released[2] and trials[j].rung >= 1]
                if len(ranked) == len(released[2]) < 6 and gates.reached(order[len(ranked)], 2):
                    gates.go(order[len(ranked)], 2)
                    released[2].add(order[len(ranked)])
                for t in trials.values():
                    # A trial ASHA stopped goes on from step 4 once the stop has reached its runner: a
                    # tiny trial would otherwise finish before Tune has read its first evaluation.
                    if t.id not in released[4] and gates.reached(t.id, 4) and t.state is JobState.CANCELLING:
                        runner_heard(tmp_path, t.id, "cancel")
                        gates.go(t.id, 4)
                        released[4].add(t.id)
                live = [t for t in trials.values() if t.state is JobState.RUNNING]
                if (len(ranked) < 6 or any(t.state is JobState.CANCELLING for t in trials.values())
                        or not all(gates.reached(t.id, 4) for t in live)
                        or sum(t.target_workers for t in live) < min(6, 2 * len(live))):
                    return False  # a stop still to come or to land, or its workers not given on yet
                for t in live:  # the survivors: each grown one trains on its new worker from its next steps
                    if t.target_workers > t.workers:
                        gates.wait_for_newcomer(t.id)
                    gates.go(t.id, 4)
                return True

            wait_for(release, "both stopped trials' ends and their workers given to the survivors")
            wait_for(lambda: store.sweep(record["id"]).state.terminal, "the sweep's end")
            shown = client.sweep(record["id"])
            done = store.sweep(record["id"])
            trials = store.trials(record["id"])
            history = {t.id: store.history(t.id) for t in trials}
        finally:
            store.close()
    assert shown["state"] == "finished" and shown["best_trial"] == done.best_trial, shown["message"]
    assert len(shown["trials"]) == 6 and all(t.state.terminal for t in trials), [(t.id, t.state) for t in trials]
    stopped = [t for t in trials if t.state is JobState.CANCELLED]
    assert all("stopped by the sweep's scheduler at step 3" in t.message for t in stopped), \
        [(t.id, t.message) for t in stopped]
    assert {t.id for t in trials if lr(t) < 1e-4} <= {t.id for t in stopped}, [(t.id, lr(t), t.state) for t in trials]
    assert len(stopped) >= 2
    # The others ran to their end: ASHA's end of a trial at max_t is no cancel of its job, and a
    # survivor grown into a stopped trial's worker redid no step.
    for t in trials:
        if t not in stopped:
            assert t.state is JobState.FINISHED, (t.id, t.state, t.message)
            assert JobState.CANCELLING not in [h.to_state for h in history[t.id]], (t.id, history[t.id])
            assert trial_summary(tmp_path, record["id"], t.trial_id)["steps_redone"] == 0, t.id

    # Each stopped trial's stop and end, the passes between, and the other trial given its worker.
    service_log = (tmp_path / "raytrain-sys-logs" / "service.log").read_text()
    ended = {job: p for p, job in pass_of(service_log, r"job (\d+): ending its runner: its run ended cancelled")}
    taken = passes_at(service_log, r"(?:admit|grow) job (\d+) ")
    trial_ids = {t.id for t in trials}
    runs = {t.id: t.mlflow_run_id for t in trials}
    client = MlflowClient(tracking_uri(spec_of(done)))
    handed_on, credited = {}, set()
    for t in sorted(stopped, key=lambda t: ended.get(t.id, -2)):
        stop_at = next(h.at_s for h in history[t.id] if h.to_state is JobState.CANCELLING)
        end_at = next(h.at_s for h in history[t.id] if h.to_state is JobState.CANCELLED)
        end_pass = ended.get(t.id, -2)  # no line: its runner was gone already, and the check below fails
        takers = [(p, job) for at, p, job in taken
                  if job in trial_ids and job != t.id and at >= stop_at and p <= end_pass + 1 and (p, job) not in credited]
        for p, job in takers:
            # Its first step on more workers than it had before the end (a new trial: its first step).
            before = [m.value for m in client.get_metric_history(runs[job], "world_size") if m.timestamp / 1e3 < end_at]
            after = [m for m in client.get_metric_history(runs[job], "world_size")
                     if m.timestamp / 1e3 >= end_at and m.value > (before[-1] if before else 0)]
            if after:
                handed_on[t.id] = (job, after[0].step, round(after[0].timestamp / 1e3 - end_at, 2))
                credited.add((p, job))
                break
    print(f"stopped trial's job -> (job given its worker, its step there, s from the end): {handed_on}")
    assert {t.id for t in trials if lr(t) < 1e-4} <= set(handed_on), (handed_on, ended, taken)

    # MLflow: the parent names the best trial; its row holds the child's config and curve.
    parent = client.get_run(done.mlflow_parent_run_id)
    assert parent.data.tags["best_trial"] == done.best_trial and parent.info.status == "FINISHED"
    assert "sweep_curves.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    # The best is the lowest evaluation any trial's job logged, stopped trials' included.
    lowest = min((value, t.trial_id) for t in trials for _, value in mlflow_history(t, "eval_loss"))
    assert (done.best_trial, done.best_value) == (lowest[1], pytest.approx(lowest[0], rel=1e-9))
    for t in trials:
        assert client.get_run(t.mlflow_run_id).data.tags["mlflow.parentRunId"] == parent.info.run_id
    with open(client.download_artifacts(parent.info.run_id, "trials.json", str(tmp_path))) as f:
        table = json.load(f)
    best_job = next(t for t in trials if t.trial_id == done.best_trial)
    best = next(row for row in table if row["trial"] == done.best_trial)
    child_spec = json.loads(best_job.spec)
    assert best["config"] == {"optim.lr": child_spec["optim"]["lr"],
                              "optim.weight_decay": child_spec["optim"]["weight_decay"]}, best["config"]
    assert [tuple(p) for p in best["curve"]] == mlflow_history(best_job, "eval_loss")
    assert done.best_value == pytest.approx(min(v for _, v in best["curve"]), rel=1e-9)


def test_a_trial_loses_a_worker_and_is_shrunk_by_a_higher_priority_job_and_trains_as_if_undisturbed(
        ray_cluster, tiny_dataset, tmp_path, gates):
    """Issue 28's done-when 2 and 3: two fp64 trials, each on 2 of the team's 4 workers. A
    worker of the first is SIGKILLed at step 4; at step 7 a job of priority 10 asking 2 workers
    makes the scheduler shrink both trials to 1. Tune sees no trial error; both trials finish with
    no step redone, each with the losses of the same trial run alone undisturbed (rtol 1e-6), and
    the killed trial's samples each seen once."""
    from raytrain_sys.spec import from_dict
    from raytrain_sys.service.sweeps.names import experiment_name
    from tests.ft_common import expected_sample_ids

    db = tmp_path / "service.db"
    base = base_spec(tmp_path, tiny_dataset)
    base["train"].update(precision="fp64", steps_per_call=1)
    base["data"]["log_sample_ids"] = True
    sweep = {"name": "disturbed", "base": base, "metric": "eval_loss", "mode": "min", "num_samples": 1,
             "space": {"optim.lr": {"grid": [1e-2, 3e-3]}}, "scheduler": {"type": "fifo"}}
    fixed_elastic = tiny_spec(tmp_path, tiny_dataset).to_dict()["elastic"]  # not elastic: one size throughout
    urgent = tiny_spec(tmp_path / "urgent", tiny_dataset, train={"max_steps": 4, "precision": "fp64"},
                       resources={"num_workers": 2}).to_dict() | {"name": "urgent"}
    for job_id in (1, 2):
        gates.hold(job_id, 2)
        gates.hold(job_id, 7)
        gates.hold(job_id, 10)
    gates.hold(1, 4)
    with running_service(db, gates) as svc:
        ray.get(svc.add_team.remote("a", 4))
        record = ray.get(svc.submit_sweep.remote("a", sweep))
        store = Store.open(f"sqlite:///{db}")
        try:
            wait_for(lambda: all(gates.reached(j, 2) and store.job(j).target_workers == 2 for j in (1, 2)),
                     "both trials at step 2, grown into the idle workers")
            for job_id in (1, 2):
                gates.go(job_id, 2)
            wait_for(lambda: gates.reached(1, 4), "trial job 1 at step 4")
            pids = gates.pids(1, 4)
            assert len(pids) == 2, pids
            os.kill(pids[1], signal.SIGKILL)
            gates.wait_for_newcomer(1)  # its replacement joins before step 7: the reclaim finds both on 2
            gates.go(1, 4)
            wait_for(lambda: all(gates.reached(j, 7) and store.job(j).workers == 2 for j in (1, 2)),
                     "both trials at step 7 on 2 workers")
            urgent_id = ray.get(svc.submit.remote("a", urgent, priority=10))["id"]
            wait_for(lambda: all(store.job(j).target_workers == 1 for j in (1, 2)), "the shrink of both trials")
            for job_id in (1, 2):
                runner_heard(tmp_path, job_id, "resize to 1")
                gates.go(job_id, 7)
            # Held at step 10 until the urgent job has run on the workers the trials gave back.
            wait_for(lambda: store.job(urgent_id).state.terminal and gates.reached(1, 10) and gates.reached(2, 10),
                     "the urgent job's end")
            for job_id in (1, 2):
                gates.go(job_id, 10)
            wait_for(lambda: all(store.job(j).state.terminal for j in (1, 2)), "both trials' ends")
            trials = store.trials(record["id"])
            # Each trial again, alone on an idle cluster: a job of its spec on one worker, never resized
            # (submitted as the trials have ended, while the sweep's runner records its end).
            alone = {}
            for t in trials:
                spec = json.loads(t.spec)
                spec.update(output_dir=str(tmp_path / "alone" / t.trial_id), name=f"alone-{t.trial_id}",
                            elastic=fixed_elastic)
                spec["tracking"].update(uri="", parent_run_id="")
                alone[t.id] = ray.get(svc.submit.remote("a", spec))["id"]
            wait_for(lambda: store.sweep(record["id"]).state.terminal, "the sweep's end")
            done = store.sweep(record["id"])
            urgent_job = store.job(urgent_id)
            wait_for(lambda: all(store.job(j).state.terminal for j in alone.values()), "the trials run alone")
            alone_jobs = {t: store.job(j) for t, j in alone.items()}
            shrinks = {j: [h.reason for h in store.history(j) if h.reason.startswith("shrink to 1")] for j in (1, 2)}
            experiment = os.path.join(done.storage_path, experiment_name(done))
        finally:
            store.close()
    assert done.state is SweepState.FINISHED, done.message
    assert urgent_job.state is JobState.FINISHED, urgent_job.message
    assert [t.id for t in trials] == [1, 2] and all(t.state is JobState.FINISHED and t.restarts == 0 for t in trials), \
        [(t.id, t.state, t.restarts, t.message) for t in trials]
    assert all(len(s) == 1 and f"job {urgent_id} (team a" in s[0] for s in shrinks.values()), shrinks
    # Tune saw both trials end well: the worker's loss was the job's business, never a trial error.
    assert sorted(tune_trial_states(experiment).values()) == ["TERMINATED", "TERMINATED"]
    for t in trials:
        summary = trial_summary(tmp_path, record["id"], t.trial_id)
        assert summary["steps_redone"] == 0 and summary["committed_steps"] == 12, summary["world_sizes"]
        assert summary["world_sizes"][9] == 1, summary["world_sizes"]  # shrunk while the urgent job ran
        # The same trial alone, undisturbed (on one worker: in fp64 the world size changes no loss).
        assert alone_jobs[t.id].state is JobState.FINISHED, alone_jobs[t.id].message
        [reference] = [read_summary(os.path.dirname(p)) for p in
                       glob.glob(str(tmp_path / "alone" / t.trial_id / "alone-*" / "summary.json"))]
        assert set(reference["world_sizes"]) == {1} and reference["steps_redone"] == 0
        torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64),
                                   torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-6, atol=0)
    killed = trial_summary(tmp_path, record["id"], trials[0].trial_id)
    assert killed["failures"] == 1 and killed["world_sizes"][3] == 2, killed["world_sizes"]
    # Exactly once: each committed step logged once, its ids the plan's, no sample twice.
    with open(os.path.join(killed["run_dir"], "sample_ids.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == list(range(1, 13))
    ids = [i for line in lines for rank in line["ranks"] for i in rank]
    assert ids == expected_sample_ids(from_dict(json.loads(trials[0].spec)), tiny_dataset, 12)
    assert len(set(ids)) == len(ids)


def local_sweep_files(tmp_path, dataset, **changes) -> str:
    """A sweep file (two trials of a 4-step tiny GPT on one worker, FIFO) beside its base job spec
    file, as a user writes them for ``raytrain-sys sweep``; returns the sweep file's path."""
    import yaml

    base = tiny_spec(tmp_path, dataset, train={"max_steps": 4, "log_every_steps": 2},
                     eval={"every_steps": 2, "max_rows": 16, "batch_rows": 8, "dataset": dataset},
                     resources={"num_workers": 1}).to_dict()
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(base))
    sweep = {"name": "local", "base": "tiny.yaml", "metric": "eval_loss", "mode": "min",
             "space": {"optim.lr": {"grid": [1e-2, 1e-5]}}, "scheduler": "fifo", **changes}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    return str(tmp_path / "sweep.yaml")


def test_raytrain_sys_sweep_runs_a_sweep_on_a_cluster_without_a_service_and_records_its_best(
        ray_cluster, tiny_dataset, tmp_path):
    """`raytrain-sys sweep SWEEP.yaml` on the session's cluster (RAY_ADDRESS; no service running):
    exit 0, the best trial printed, and recorded in its store (sweeps.db in the base's output_dir)
    and in the MLflow parent run."""
    import subprocess
    import sys

    from mlflow import MlflowClient

    from raytrain_sys.service.sweeps.spec import spec_of, tracking_uri

    path = local_sweep_files(tmp_path, tiny_dataset)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    ran = subprocess.run([sys.executable, "-m", "raytrain_sys.cli.main", "sweep", path], env=env,
                         capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    store = Store.open(f"sqlite:///{tmp_path / 'runs' / 'sweeps.db'}")
    try:
        [done] = store.sweeps()
        trials = store.trials(done.id)
    finally:
        store.close()
    assert done.state is SweepState.FINISHED and len(trials) == 2, done.message
    assert all(t.state is JobState.FINISHED for t in trials), [(t.id, t.state, t.message) for t in trials]
    # The trial of lr 1e-2 learns: it is the best, printed as the store and the parent run record it.
    best = next(t for t in trials if t.trial_id == done.best_trial)
    assert json.loads(best.spec)["optim"]["lr"] == 1e-2
    assert f"best             {done.best_trial} ({done.best_value})" in ran.stdout, ran.stdout
    assert "state            finished" in ran.stdout
    parent = MlflowClient(tracking_uri(spec_of(done))).get_run(done.mlflow_parent_run_id)
    assert parent.data.tags["best_trial"] == done.best_trial
    assert parent.data.metrics["best_eval_loss"] == pytest.approx(done.best_value, rel=1e-9)


def test_raytrain_sys_sweep_refuses_a_bad_sweep_file_naming_the_field(tmp_path, tiny_dataset, capsys):
    """A space over a field the job spec does not have: exit 2 before any cluster is touched, one
    line naming the field."""
    from raytrain_sys.cli.main import main

    path = local_sweep_files(tmp_path, tiny_dataset, space={"optim.lrr": {"grid": [1e-2]}})
    assert main(["sweep", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raytrain-sys: error: field 'space.optim.lrr': ") and "\n" not in err, err
    assert "did you mean 'lr'" in err
    assert not (tmp_path / "runs").exists()  # no store, no run


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

    from raytrain_sys.service.sweeps.outcome import checkpoint_step_of, trial_table
    from raytrain_sys.service.sweeps.segments import resumed_from
    from raytrain_sys.service.sweeps.spec import spec_of, tracking_uri
    from raytrain_sys.service.sweeps.tracking import TAG_DONOR_CHECKPOINT, TAG_DONOR_STEP, TAG_DONOR_TRIAL
    from raytrain_sys.tracking.mlflow_tracker import TAG_PARENT_RUN

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
        assert run.data.tags[TAG_PARENT_RUN] == done.mlflow_parent_run_id
        assert run.data.tags[TAG_DONOR_STEP] == str(start) and run.data.tags[TAG_DONOR_CHECKPOINT] == donor_uri
        donor_trial = run.data.tags[TAG_DONOR_TRIAL]
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
