"""The job service in the cluster: the service actor, its reconciler and one runner per job, on the
session's cluster (four 1-CPU worker nodes).

What a user would notice: a job that borrowed idle workers gives them back at a step boundary
when another team is owed its quota, losing no step, and grows back when they are free; a paused
job frees its workers and resumes into the same MLflow run; cancelled jobs end and release their
workers; a service killed mid-run comes back with its queue, teams and audit intact and finishes
the running job once; a runner killed mid-run restarts from its newest checkpoint within the
job's restart budget, and fails with the reason past it. Every finished job's parameters equal
an uninterrupted run's.

Events are made to land mid-run with step gates (``tests/service_common.StepGates``): the
runner's step loop holds at a chosen step until the test says go.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
import ray

from raytrain_sys.control.supervisor import run_job
from raytrain_sys.service import requests as user_requests
from raytrain_sys.service.model import JobState
from raytrain_sys.service.runner import find_runner
from raytrain_sys.service.service import get_service, start_service
from raytrain_sys.service.store import Store
from tests.ft_common import assert_no_leftovers, ft_spec, pid_alive, wait_until
from tests.helpers import assert_params_close, exported_series, final_params, read_summary
from tests.service_common import StepGates, runner_actors, runner_heard, running_service

STEPS = 24  # checkpoints every 5 steps (ft_spec)
WAIT_S = 180.0


def job_spec(tmp_path, dataset, name: str, steps: int = STEPS, **sections) -> dict:
    """A tiny fp64 job (ft_spec) with its own output dir: one MLflow store a job."""
    return ft_spec(tmp_path / name, dataset, steps, **sections).to_dict() | {"name": name}


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dataset, tmp_path_factory):
    """The uninterrupted run every service job is compared with (world size does not change it)."""
    spec = ft_spec(tmp_path_factory.mktemp("ref"), tiny_dataset, STEPS)
    return final_params(run_job(spec).newest_checkpoint)


@pytest.fixture
def gates(tmp_path):
    root = tmp_path / "gates"
    root.mkdir()
    return StepGates(str(root))


def state_of(svc, job_id: int) -> dict:
    return ray.get(svc.job.remote(job_id))


def wait_for(svc, job_id: int, pred, what: str, timeout_s: float = WAIT_S) -> dict:
    job = wait_until(lambda: (lambda j: j if pred(j) else None)(state_of(svc, job_id)), timeout_s, 0.1)
    assert job, f"job {job_id}: {what} not within {timeout_s:g} s; now {state_of(svc, job_id)}"
    return job


def wait_state(svc, job_id: int, state: str, timeout_s: float = WAIT_S) -> dict:
    return wait_for(svc, job_id, lambda j: j["state"] == state, state, timeout_s)


def run_dir_of(output_dir) -> str:
    """The job's run dir (the one with a summary.json); asserts there is exactly one."""
    runs = [os.path.dirname(p) for p in glob.glob(os.path.join(str(output_dir), "runs", "*", "summary.json"))
            if not os.path.islink(os.path.dirname(p))]
    assert len(runs) == 1, f"expected one run dir, found {runs}"
    return runs[0]


def states(svc, job_id: int) -> list[str]:
    return [t["to"] for t in ray.get(svc.history.remote(job_id))]


def assert_cluster_idle(timeout_s: float = 30.0) -> None:
    total = ray.cluster_resources().get("CPU", 0)
    assert wait_until(lambda: ray.available_resources().get("CPU", 0) >= total, timeout_s), \
        f"CPUs still held: {ray.available_resources()}"


def test_borrowed_workers_are_given_back_at_a_boundary_and_grown_into_again(
        ray_cluster, tiny_dataset, tmp_path, gates, reference):
    """Teams a and b, 2 workers each in one cohort. A's elastic 1..4 job borrows b's idle quota
    and runs on 4; b's 2-worker job makes it shrink to 2 at a step boundary (nothing redone) and
    starts; when it ends, A grows back to 4 and finishes equal to an uninterrupted run."""
    a_spec = job_spec(tmp_path, tiny_dataset, "a-elastic", resources={"num_workers": 4},
                      elastic={"min_workers": 1, "max_workers": 4})
    b_spec = job_spec(tmp_path, tiny_dataset, "b-fixed", steps=8, resources={"num_workers": 2})
    with running_service(tmp_path / "svc.db", gates) as svc:
        ray.get([svc.add_team.remote("a", 2, cohort="research"), svc.add_team.remote("b", 2, cohort="research")])
        gates.hold(1, 6)
        gates.hold(1, 14)
        a = ray.get(svc.submit.remote("a", a_spec))["id"]
        assert wait_until(lambda: gates.reached(a, 6), WAIT_S), state_of(svc, a)
        job = wait_for(svc, a, lambda j: j["workers"] == 4, "running on 4 workers")
        assert job["state"] == "running" and job["target_workers"] == 4

        b = ray.get(svc.submit.remote("b", b_spec))["id"]
        wait_for(svc, a, lambda j: j["target_workers"] == 2, "the shrink to 2")
        assert state_of(svc, b)["state"] == "queued"  # admitted only once A's workers are free
        gates.go(a, 6)
        wait_for(svc, a, lambda j: j["workers"] == 2, "the drain to 2")
        wait_state(svc, b, "finished")
        assert wait_until(lambda: gates.reached(a, 14), WAIT_S)
        wait_for(svc, a, lambda j: j["target_workers"] == 4, "the grow back to 4")
        gates.wait_for_newcomer(a)
        gates.go(a, 14)
        job = wait_state(svc, a, "finished")

        assert states(svc, b) == ["queued", "starting", "running", "finished"]
        history = ray.get(svc.history.remote(a))
        shrink = [t for t in history if t["reason"].startswith("shrink to 2")]
        assert len(shrink) == 1 and "job 2 (team b" in shrink[0]["reason"], history
        assert any(t["reason"].startswith("grow to 4") for t in history), history
        with open(ray.get(svc.job_log_path.remote(a))) as f:
            log_text = f.read()  # the job's log: the Supervisor's transitions with their reasons
        assert "shrinking to 2 worker(s)" in log_text and "reached train.max_steps" in log_text

    summary = read_summary(run_dir_of(tmp_path / "a-elastic"))
    worlds = summary["world_sizes"]
    assert worlds[:6] == [4] * 6 and 2 in worlds and worlds[-1] == 4, worlds
    assert summary["steps_redone"] == 0 and summary["failures"] == 0
    assert summary["mlflow_run_id"] == job["mlflow_run_id"]
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)


@pytest.fixture(params=["sqlite", "postgresql"])
def service_db(request, tmp_path):
    """The service's store: a SQLite file, or a new database on the session's real PostgreSQL
    server (Done-when 6: the same lifecycle on the production path)."""
    if request.param == "sqlite":
        return tmp_path / "svc.db"
    return request.getfixturevalue("postgres_url")


def test_pause_frees_the_workers_and_resume_continues_the_same_run(
        ray_cluster, tiny_dataset, tmp_path, gates, reference, service_db):
    spec = job_spec(tmp_path, tiny_dataset, "p", resources={"num_workers": 2})
    with running_service(service_db, gates) as svc:
        ray.get(svc.add_team.remote("a", 4))
        gates.hold(1, 8)
        job_id = ray.get(svc.submit.remote("a", spec))["id"]
        assert wait_until(lambda: gates.reached(job_id, 8), WAIT_S), state_of(svc, job_id)
        first = wait_state(svc, job_id, "running")
        ray.get(svc.pause.remote(job_id, "a", "the weekend"))
        runner_heard(tmp_path, job_id, "pause")
        gates.go(job_id, 8)
        paused = wait_state(svc, job_id, "paused")
        assert paused["held"] and paused["workers"] == 0
        assert paused["last_checkpoint_step"] is not None and paused["last_checkpoint_step"] >= 8
        run_dir = run_dir_of(tmp_path / "p")
        assert_no_leftovers(ray_cluster, os.path.basename(run_dir))
        assert_cluster_idle()
        # Held: the scheduler leaves it paused, pass after pass.
        passes = ray.get(svc.info.remote())["passes"]
        assert wait_until(lambda: ray.get(svc.info.remote())["passes"] >= passes + 5, 30)
        assert state_of(svc, job_id)["state"] == "paused"

        ray.get(svc.resume.remote(job_id, "a"))
        done = wait_state(svc, job_id, "finished")
        assert states(svc, job_id) == ["queued", "starting", "running", "pausing", "paused", "paused",
                                       "resuming", "running", "finished"]
    assert done["mlflow_run_id"] == first["mlflow_run_id"]
    summary = read_summary(run_dir_of(tmp_path / "p"))  # one run dir: the resume continued it
    assert summary["mlflow_run_id"] == first["mlflow_run_id"] and summary["committed_steps"] == STEPS
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)


def test_cancel_a_queued_and_a_running_job(ray_cluster, tiny_dataset, tmp_path, gates, service_db):
    spec = job_spec(tmp_path, tiny_dataset, "c", resources={"num_workers": 1})
    with running_service(service_db, gates) as svc:
        ray.get(svc.add_team.remote("a", 1))  # room for one job: the second waits
        gates.hold(1, 3)
        running = ray.get(svc.submit.remote("a", spec))["id"]
        queued = ray.get(svc.submit.remote("a", spec | {"output_dir": str(tmp_path / "c2")}))["id"]
        assert wait_until(lambda: gates.reached(running, 3), WAIT_S)
        # Its runner runs it at nice 0 (RUN_NICENESS), not at Ray's 15 beside training workers at 0.
        nice = ray.get(find_runner(running).status.remote()).nice
        assert (nice == 0) if os.geteuid() == 0 else (nice > 0), nice  # without root: Ray's, said once
        assert state_of(svc, queued)["state"] == "queued"
        assert ray.get(svc.cancel.remote(queued, "a"))["state"] == "cancelled"  # at once: it holds nothing
        assert ray.get(svc.cancel.remote(running, "a", "wrong data"))["state"] == "cancelling"
        runner_heard(tmp_path, running, "cancel")
        gates.go(running, 3)
        job = wait_state(svc, running, "cancelled")
        assert "cancelled by a: wrong data" in job["message"] and job["workers"] == 0
        assert states(svc, queued) == ["queued", "cancelled"]
        run_dir = run_dir_of(tmp_path / "c")
        assert read_summary(run_dir)["status"] == "cancelled"
        assert_no_leftovers(ray_cluster, os.path.basename(run_dir))
        assert_cluster_idle()
        assert not os.path.exists(tmp_path / "c2" / "runs")  # the queued one never ran
        audit = ray.get(svc.audit_log.remote())
        assert [(r["action"], r["target"], r["result"]) for r in audit if r["action"] == "cancel"] == [
            ("cancel", f"job {queued}", "ok"), ("cancel", f"job {running}", "ok")]


def test_cancel_keeps_the_checkpoints_unless_asked_to_delete_them(ray_cluster, tiny_dataset, tmp_path, gates):
    kept_spec = job_spec(tmp_path, tiny_dataset, "kept", resources={"num_workers": 1})
    gone_spec = job_spec(tmp_path, tiny_dataset, "gone", resources={"num_workers": 1})
    with running_service(tmp_path / "svc.db", gates) as svc:
        ray.get(svc.add_team.remote("a", 2))
        gates.hold(1, 7)
        gates.hold(2, 7)
        kept = ray.get(svc.submit.remote("a", kept_spec))["id"]
        gone = ray.get(svc.submit.remote("a", gone_spec))["id"]
        for job_id in (kept, gone):  # both past their checkpoint at step 5
            assert wait_until(lambda: gates.reached(job_id, 7), WAIT_S), state_of(svc, job_id)
            wait_for(svc, job_id, lambda j: j["last_checkpoint_step"] == 5, "the checkpoint at step 5 recorded")
        ray.get(svc.cancel.remote(kept, "a"))
        ray.get(svc.cancel.remote(gone, "a", "bad run", True))
        runner_heard(tmp_path, kept, "cancel")
        runner_heard(tmp_path, gone, "cancel")
        gates.go(kept, 7)
        gates.go(gone, 7)
        wait_state(svc, kept, "cancelled")
        done = wait_for(svc, gone, lambda j: j["state"] == "cancelled" and not j["delete_checkpoints"],
                        "cancelled, checkpoints deleted")
        history = ray.get(svc.history.remote(gone))
    kept_dir = os.path.join(run_dir_of(tmp_path / "kept"), "checkpoints")
    gone_dir = os.path.join(run_dir_of(tmp_path / "gone"), "checkpoints")
    assert "step_00000005" in os.listdir(kept_dir)
    assert not os.path.exists(gone_dir)
    assert history[-1]["from"] == history[-1]["to"] == "cancelled"
    assert history[-1]["reason"].startswith(f"checkpoints deleted as the cancel asked: {gone_dir}"), history[-1]
    assert done["message"] == history[-1]["reason"]


def test_a_stop_that_does_not_land_in_time_is_made_hard_but_a_pause_never_loses_the_run(
        ray_cluster, tiny_dataset, tmp_path, gates):
    """The step loop is held (as a hung step would hold it) before the first checkpoint: a pause
    past its deadline waits on (killing now would lose every step); a cancel past its deadline
    kills the runner, and with it the run's workers."""
    spec = job_spec(tmp_path, tiny_dataset, "s", resources={"num_workers": 1})
    with running_service(tmp_path / "svc.db", gates, stop_deadline_s=2.0) as svc:
        ray.get(svc.add_team.remote("a", 1))
        gates.hold(1, 3)
        job_id = ray.get(svc.submit.remote("a", spec))["id"]
        assert wait_until(lambda: gates.reached(job_id, 3), WAIT_S)
        ray.get(svc.pause.remote(job_id, "a"))
        service_log = tmp_path / "raytrain-sys-logs" / "service.log"
        assert wait_until(lambda: "has no committed checkpoint: not killed" in service_log.read_text(), 60)
        job = state_of(svc, job_id)
        assert job["state"] == "pausing" and job["last_checkpoint_step"] is None
        ray.get(svc.cancel.remote(job_id, "a"))
        job = wait_state(svc, job_id, "cancelled", timeout_s=60)
        assert "did not stop within 2 s: runner killed" in job["message"], job
        run_dir = run_dir_of(tmp_path / "s")
        assert wait_until(lambda: not runner_actors(), 30)
        assert_no_leftovers(ray_cluster, os.path.basename(run_dir))
        assert_cluster_idle()


def test_service_killed_mid_run_comes_back_and_finishes_the_job_once(
        ray_cluster, tiny_dataset, tmp_path, gates, reference):
    spec = job_spec(tmp_path, tiny_dataset, "k", resources={"num_workers": 1})
    db = tmp_path / "svc.db"
    # With a pool of warm spares, as a service runs by default, before the kill and after it.
    with running_service(db, gates, warm_workers_per_node=1) as svc:
        ray.get([svc.add_team.remote("a", 1), svc.add_team.remote("b", 1)])
        gates.hold(1, 7)
        gates.hold(3, 2)
        running = ray.get(svc.submit.remote("a", spec))["id"]
        queued = ray.get(svc.submit.remote("a", spec | {"output_dir": str(tmp_path / "q")}))["id"]
        # Its 24 steps take seconds, and it is admitted as soon as the running job's run has let
        # its worker go (before that job's end is recorded): held at step 1 so that the cancel
        # below lands on a running job, whatever the order of the two.
        gates.hold(queued, 1)
        held = ray.get(svc.submit.remote("b", spec | {"output_dir": str(tmp_path / "h")}, 0, "", "b"))["id"]
        assert wait_until(lambda: gates.reached(running, 7), WAIT_S)
        # b's job runs (b has room): its user pauses it, and it is held paused.
        assert wait_until(lambda: gates.reached(held, 2), WAIT_S)
        ray.get(svc.pause.remote(held, "b"))
        runner_heard(tmp_path, held, "pause")
        gates.go(held, 2)
        wait_for(svc, held, lambda j: j["state"] == "paused" and j["held"], "held")
        # Both waiting jobs' reasons written by a pass (a pass after the restart writes them too,
        # so the records compared below are the settled ones).
        for job_id, cause in ((queued, "team_quota"), (held, "held")):
            wait_for(svc, job_id, lambda j, cause=cause: j["wait_cause"] == cause, f"its wait reason ({cause})")
        before = {j["id"]: j for j in ray.get(svc.jobs.remote())}
        audit = ray.get(svc.audit_log.remote())
        teams = ray.get(svc.teams.remote())
        pid = ray.get(svc.info.remote())["pid"]

        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: get_service() is None, 30), "the killed service is still named"
        # An admission whose intent was written just before the service died, its runner never made.
        store = Store.open(f"sqlite:///{db}")
        intent = user_requests.submit(store, team="b", spec=spec | {"output_dir": str(tmp_path / "i")}, by="b").id
        store.transition(intent, JobState.QUEUED, JobState.STARTING, actor="scheduler", target_workers=1,
                         reason="admitted just before the service died")
        store.close()
        svc = start_service(f"sqlite:///{db}", serve_api=False, step_hook=gates, poll_s=0.2,
                            warm_workers_per_node=1)
        assert ray.get(svc.info.remote())["pid"] != pid
        assert ray.get(svc.teams.remote()) == teams
        assert ray.get(svc.audit_log.remote())[:len(audit)] == audit
        after = {j["id"]: j for j in ray.get(svc.jobs.remote())}
        for job_id in (queued, held):
            assert after[job_id] == before[job_id]
        assert after[running]["state"] == "running"
        wait_state(svc, intent, "running")  # the recorded intent finished: started once
        assert states(svc, intent) == ["queued", "starting", "running"]
        gates.go(running, 7)
        job = wait_state(svc, running, "finished")
        assert states(svc, running).count("starting") == 1 and job["restarts"] == 0
        # The queue moves on: the queued job is admitted once the running one has finished.
        wait_for(svc, queued, lambda j: j["state"] != "queued", "admission")
        ray.get([svc.cancel.remote(queued, "a"), svc.cancel.remote(held, "b")])
        runner_heard(tmp_path, queued, "cancel")
        gates.go(queued, 1)
        wait_state(svc, queued, "cancelled")
        wait_state(svc, intent, "finished")
        history = ray.get(svc.history.remote(intent))
        assert [t["to"] for t in history].count("starting") == 1 and history[-1]["to"] == "finished", history
        assert state_of(svc, held)["state"] == "cancelled"
    service_log = open(tmp_path / "raytrain-sys-logs" / "service.log").read()
    assert f"job {running}: re-attached to its runner" in service_log
    assert f"job {intent} is starting with no runner: launching it" in service_log
    summary = read_summary(run_dir_of(tmp_path / "k"))  # one run dir
    assert summary["mlflow_run_id"] == job["mlflow_run_id"] and summary["steps_redone"] == 0
    import mlflow

    runs = mlflow.MlflowClient(summary["tracking_uri"]).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(summary["tracking_uri"]).search_experiments()])
    assert [r.info.run_id for r in runs] == [job["mlflow_run_id"]]  # one MLflow run
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)


def kill_agents(output_dir) -> int:
    """Kill the node agents of the job whose output dir is ``output_dir`` (its workers end with
    them): what a runner's loss leaves of the job is then nothing a new runner can adopt."""
    from raytrain_sys.control.adoption import agents_of
    from raytrain_sys.control.launches import launches, run_name_prefix

    prefix = run_name_prefix(os.path.basename(run_dir_of(output_dir)))
    agents = [a for launch in launches() if launch.startswith(prefix) for a in agents_of(launch).values()]
    for agent in agents:
        ray.kill(agent, no_restart=True)
    return len(agents)


def test_runner_killed_restarts_from_its_checkpoint_within_the_budget(
        ray_cluster, tiny_dataset, tmp_path, gates, reference):
    """Budget 1: one job's runner is killed once, with its node agents (and so its workers: nothing
    is left to adopt), and restarts from step 5's checkpoint, finishing equal to an uninterrupted
    run; another's twice (fails, saying the budget is used up). Each restart counts the steps
    trained again, from the step the service saw the lost runner commit (not from the lost run's
    summary.json, written seconds apart), in the job's record, its transition's reason and the
    resumed run's summary.json."""
    spec = job_spec(tmp_path, tiny_dataset, "r1", resources={"num_workers": 1})
    spec2 = job_spec(tmp_path, tiny_dataset, "r2", resources={"num_workers": 1})
    with running_service(tmp_path / "svc.db", gates, max_restarts=1) as svc:
        ray.get(svc.add_team.remote("a", 4))
        gates.hold(1, 8)
        gates.hold(2, 7)
        gates.hold(2, 12)
        survivor = ray.get(svc.submit.remote("a", spec))["id"]
        doomed = ray.get(svc.submit.remote("a", spec2))["id"]

        def kill_runner_at(job_id, step):
            assert wait_until(lambda: gates.reached(job_id, step), WAIT_S), state_of(svc, job_id)
            wait_for(svc, job_id, lambda j: j["last_checkpoint_step"] is not None, "a checkpoint recorded")
            runner = find_runner(job_id)  # named after the job, or a spare
            assert wait_until(lambda: ray.get(runner.status.remote()).committed_step == step, 30)
            passes = ray.get(svc.info.remote())["passes"]  # two passes see the runner at this step
            assert wait_until(lambda: ray.get(svc.info.remote())["passes"] >= passes + 2, 30)
            pid = ray.get(runner.ping.remote())
            os.kill(pid, signal.SIGKILL)
            assert kill_agents(tmp_path / ("r1" if job_id == survivor else "r2")) >= 1
            assert wait_until(lambda: not pid_alive(pid), 30)
            gates.go(job_id, step)  # for the restarted run, which passes this step again

        kill_runner_at(survivor, 8)
        kill_runner_at(doomed, 7)
        job = wait_state(svc, survivor, "finished")
        assert job["restarts"] == 1
        assert job["steps_redone"] == 3, job  # committed 6..8 past the checkpoint of step 5, trained again
        restart = [t["reason"] for t in ray.get(svc.history.remote(survivor)) if "restarting" in t["reason"]]
        assert len(restart) == 1 and "adopting its live workers, or if they are gone from its checkpoint at " \
            "step 5" in restart[0] and "steps 6..8 would be trained again (3 steps)" in restart[0], restart
        kill_runner_at(doomed, 12)
        failed = wait_state(svc, doomed, "failed")
        assert "restart budget used up (1 of 1 restarts)" in failed["message"], failed
        assert failed["steps_redone"] == 2, failed  # 6..7 after its first loss; the second ended it
    summary = read_summary(run_dir_of(tmp_path / "r1"))  # the restart resumed the same run
    assert summary["mlflow_run_id"] == job["mlflow_run_id"] and summary["committed_steps"] == STEPS
    assert summary["resumed_from"][-1].rstrip("/").endswith("00000005"), summary["resumed_from"]
    assert summary["steps_redone"] == 3 and summary["recoveries"][-1]["from"] == "checkpoint", summary["recoveries"]
    assert any("could not adopt the lost driver's workers" in t["reason"] for t in summary["transitions"])
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)
    assert_no_leftovers(ray_cluster, os.path.basename(run_dir_of(tmp_path / "r2")))
    assert_cluster_idle()


def submit_held_at_8(svc, gates, spec: dict) -> int:
    """Team a (2 workers) submits ``spec``, held at steps 8 and 14 (``gates``): returns its id once
    it holds at 8 with a checkpoint recorded (a runner lost there has a run to resume)."""
    ray.get(svc.add_team.remote("a", 2))
    gates.hold(1, 8)
    gates.hold(1, 14)
    job_id = ray.get(svc.submit.remote("a", spec))["id"]
    assert wait_until(lambda: gates.reached(job_id, 8), WAIT_S), state_of(svc, job_id)
    wait_for(svc, job_id, lambda j: j["last_checkpoint_step"] is not None, "a checkpoint recorded")
    return job_id


def test_runner_killed_its_workers_adopted_by_the_next_runner(ray_cluster, tiny_dataset, tmp_path, gates,
                                                              reference):
    """A running job's runner SIGKILLed: the next runner adopts the job's live workers (the same
    processes), restores nothing, trains no step twice, and the job finishes equal to an
    uninterrupted run, every sample once, each step's loss once in its MLflow run."""
    spec = job_spec(tmp_path, tiny_dataset, "a1", resources={"num_workers": 2})
    with running_service(tmp_path / "svc.db", gates, max_restarts=1) as svc:
        job_id = submit_held_at_8(svc, gates, spec)
        runner = find_runner(job_id)
        pid = ray.get(runner.ping.remote())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert wait_until(lambda: not pid_alive(pid), 30)
        gates.go(job_id, 8)
        # The next runner trains on from where the workers' lease ended.
        assert wait_until(lambda: gates.reached(job_id, 14), WAIT_S), state_of(svc, job_id)
        to_step_14_s = time.monotonic() - killed_at
        gates.go(job_id, 14)
        job = wait_state(svc, job_id, "finished")
    assert gates.pids(job_id, 14) == gates.pids(job_id, 8)  # the same worker processes
    assert job["restarts"] == 1 and job["steps_redone"] == 0, job
    summary = read_summary(run_dir_of(tmp_path / "a1"))
    assert summary["steps_redone"] == 0 and summary["recoveries"] == [] and summary["failures"] == 0
    assert summary["committed_steps"] == STEPS and summary["mlflow_run_id"] == job["mlflow_run_id"]
    assert [t for t in summary["transitions"] if "adopted the 2 live workers" in t["reason"]], summary["transitions"]
    assert not any("could not adopt" in t["reason"] for t in summary["transitions"])
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=summary["tracking_uri"]).get_metric_history(job["mlflow_run_id"],
                                                                                          "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    with open(os.path.join(run_dir_of(tmp_path / "a1"), "sample_ids.jsonl")) as f:
        by_step = {line["step"]: line for line in map(json.loads, f)}
    ids = [i for step in sorted(by_step) for rank in by_step[step]["ranks"] for i in rank]
    assert sorted(by_step) == list(range(1, STEPS + 1)) and len(ids) == len(set(ids))
    print(json.dumps({"kill_to_step_14_s": round(to_step_14_s, 2)}))
    assert_cluster_idle()


def test_the_node_holding_a_jobs_runner_lost_its_workers_adopted(ray_nodes, tiny_dataset, tmp_path, gates,
                                                                  reference):
    """The node that holds a running job's runner removed without grace (its machine gone), the
    service on another: the next runner adopts the job's live workers on their own nodes (the
    same processes), trains no step twice, and the job finishes equal to an uninterrupted run."""
    from ray._private.state import state

    from raytrain_sys.control import control_actors

    spec = job_spec(tmp_path, tiny_dataset, "n1", resources={"num_workers": 2})
    # The service starts before the control node joins (no safe node: it lands on another); the
    # job's runner, started after, lands on the control node (control_actors.control_options).
    with running_service(tmp_path / "svc.db", gates, max_restarts=1) as svc:
        control = ray_nodes.add_node(num_cpus=0, resources={"raytrain_control": 1000}, **ray_nodes.node_args)
        try:
            assert wait_until(lambda: control_actors.placement().safe_nodes == 1, 30)
            job_id = submit_held_at_8(svc, gates, spec)
            runner = find_runner(job_id)
            assert state.actor_table(None)[runner._actor_id.hex()]["Address"]["NodeID"] == control.node_id
            pid = ray.get(runner.ping.remote())
            ray_nodes.remove_node(control, allow_graceful=False)
            control, removed_at = None, time.monotonic()
            assert wait_until(lambda: not pid_alive(pid), 30)  # its processes end with their raylet
            gates.go(job_id, 8)
            assert wait_until(lambda: gates.reached(job_id, 14), WAIT_S), state_of(svc, job_id)
            to_step_14_s = time.monotonic() - removed_at
            gates.go(job_id, 14)
            job = wait_state(svc, job_id, "finished")
        finally:
            if control is not None:
                ray_nodes.remove_node(control)
            # Listed alive until Ray's health checks declare it dead: a control actor started
            # before then (the next test's service) would be placed there.
            assert wait_until(lambda: control_actors.placement().safe_nodes == 0, 90)
    assert gates.pids(job_id, 14) == gates.pids(job_id, 8)  # the same worker processes
    assert job["restarts"] == 1 and job["steps_redone"] == 0, job
    summary = read_summary(run_dir_of(tmp_path / "n1"))
    assert summary["steps_redone"] == 0 and summary["recoveries"] == [] and summary["committed_steps"] == STEPS
    assert [t for t in summary["transitions"] if "adopted the 2 live workers" in t["reason"]], summary["transitions"]
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)
    with open(os.path.join(run_dir_of(tmp_path / "n1"), "sample_ids.jsonl")) as f:
        ids = [i for line in map(json.loads, f) for rank in line["ranks"] for i in rank]
    assert len(ids) == len(set(ids))
    print(json.dumps({"node_removed_to_step_14_s": round(to_step_14_s, 2)}))
    assert_cluster_idle()


def test_service_and_runner_killed_together_the_restarted_service_adopts_the_workers(
        ray_cluster, tiny_dataset, tmp_path, gates, reference):
    """The service and a job's runner SIGKILLed at once (a control node lost): the service started
    again finds the runner gone and restarts the job with a runner that adopts its live workers:
    the same processes, no step trained twice, equal to an uninterrupted run."""
    spec = job_spec(tmp_path, tiny_dataset, "t1", resources={"num_workers": 2})
    db = tmp_path / "svc.db"
    with running_service(db, gates, max_restarts=1) as svc:
        job_id = submit_held_at_8(svc, gates, spec)
        pids = [ray.get(svc.info.remote())["pid"], ray.get(find_runner(job_id).ping.remote())]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: get_service() is None and not any(map(pid_alive, pids)), 30)
        gates.go(job_id, 8)
        svc = start_service(f"sqlite:///{db}", serve_api=False, step_hook=gates, poll_s=0.2, max_restarts=1,
                            warm_workers_per_node=0, log_dir=str(tmp_path / "raytrain-sys-logs"))
        assert wait_until(lambda: gates.reached(job_id, 14), WAIT_S), state_of(svc, job_id)
        gates.go(job_id, 14)
        job = wait_state(svc, job_id, "finished")
    assert gates.pids(job_id, 14) == gates.pids(job_id, 8)
    assert job["restarts"] == 1 and job["steps_redone"] == 0, job
    summary = read_summary(run_dir_of(tmp_path / "t1"))
    assert summary["steps_redone"] == 0 and summary["recoveries"] == [] and summary["committed_steps"] == STEPS
    assert [t for t in summary["transitions"] if "adopted the 2 live workers" in t["reason"]], summary["transitions"]
    assert_params_close(final_params(summary["newest_checkpoint"]), reference, rtol=1e-6, atol=1e-9)
    assert_cluster_idle()


def test_a_runner_that_does_not_answer_holds_up_no_other_job(ray_cluster, tiny_dataset, tmp_path, gates):
    """A running job's runner stopped (SIGSTOP: alive, silent): the service's passes go on, each
    waiting for it at most ``status_wait_s``, so another job submitted meanwhile is admitted and
    trains to its end; once the runner answers again its own job finishes, nothing lost. (Before,
    every pass waited ``status_timeout_s``, 10 s, for the silent runner.)"""
    spec = job_spec(tmp_path, tiny_dataset, "s1", steps=6, resources={"num_workers": 1})
    spec2 = job_spec(tmp_path, tiny_dataset, "s2", steps=6, resources={"num_workers": 1})
    with running_service(tmp_path / "svc.db", gates) as svc:
        ray.get(svc.add_team.remote("a", 2))
        gates.hold(1, 3)
        silent = ray.get(svc.submit.remote("a", spec))["id"]
        assert wait_until(lambda: gates.reached(silent, 3), WAIT_S), state_of(svc, silent)
        wait_state(svc, silent, "running")
        pid = ray.get(find_runner(silent).ping.remote())
        os.kill(pid, signal.SIGSTOP)
        try:
            passes = ray.get(svc.info.remote())["passes"]
            assert wait_until(lambda: ray.get(svc.info.remote())["passes"] >= passes + 5, 20), \
                "the service's passes wait for a runner that does not answer"
            other = ray.get(svc.submit.remote("a", spec2))["id"]
            wait_state(svc, other, "finished")
            assert state_of(svc, silent)["state"] == "running"
        finally:
            os.kill(pid, signal.SIGCONT)
        gates.go(silent, 3)
        job = wait_state(svc, silent, "finished")
    assert job["restarts"] == 0
    summary = read_summary(run_dir_of(tmp_path / "s1"))
    assert summary["committed_steps"] == 6 and summary["steps_redone"] == 0
    assert_cluster_idle()


def test_a_job_over_its_teams_quota_says_why_everywhere_until_it_runs(ray_cluster, tiny_dataset, tmp_path, gates,
                                                                     capsys, monkeypatch):
    """Team q has one worker: its second job waits queued, saying it is over its team's quota in
    `jobs list`, `jobs status`, the HTTP API and the waiting-jobs gauge; once the first job
    ends it starts, runs, and shows no reason any more (the gauge back at 0)."""
    from raytrain_sys.cli.main import main
    from raytrain_sys.service.client import Client
    from tests.test_jobs_page import free_port

    spec = job_spec(tmp_path, tiny_dataset, "q1", steps=6, resources={"num_workers": 1})
    port = free_port()
    with running_service(tmp_path / "svc.db", gates, serve_api=True, port=port) as svc:
        ray.get(svc.add_team.remote("q", 1))
        store = Store.open(f"sqlite:///{tmp_path / 'svc.db'}")
        token = store.issue_token("q")
        store.close()
        url = f"http://127.0.0.1:{port}"
        gates.hold(1, 2)
        first = ray.get(svc.submit.remote("q", spec))["id"]
        assert wait_until(lambda: gates.reached(first, 2), WAIT_S), state_of(svc, first)
        second = ray.get(svc.submit.remote("q", spec | {"output_dir": str(tmp_path / "q2")}))["id"]
        job = wait_for(svc, second, lambda j: j["wait_cause"] == "team_quota", "the quota reason")
        reason = job["wait_reason"]
        assert job["state"] == "queued" and reason.startswith("over its team's quota: needs 1 worker"), job
        assert "team q uses 1 of nominal 1" in reason

        shown = Client(url, token).job(second)
        assert (shown["state"], shown["wait_cause"], shown["wait_reason"]) == ("queued", "team_quota", reason)
        monkeypatch.setenv("COLUMNS", "120")
        assert main(["jobs", "list", "--url", url, "--token", token]) == 0
        header, *rows = capsys.readouterr().out.splitlines()
        [row] = [r for r in rows if r.split()[0] == str(second)]
        assert row.split()[3] == "queued" and row[header.index("REASON"):].startswith("over its team's quota")
        assert main(["jobs", "status", str(second), "--url", url, "--token", token]) == 0
        status = capsys.readouterr().out
        assert f"reason      {reason}\n" in status and "waits on    team_quota since " in status
        assert wait_until(lambda: [s for s in exported_series("raytrain_service_waiting_jobs", 'team="q"',
                                                              'cause="team_quota"') if s.endswith(" 1.0")], 60), \
            exported_series("raytrain_service_waiting_jobs")

        gates.go(first, 2)
        ran = wait_for(svc, second, lambda j: j["state"] in ("running", "finished"), "its start")
        assert (ran["wait_cause"], ran["wait_reason"], ran["wait_cause_since_s"]) == (None, None, None)
        history = ray.get(svc.history.remote(second))
        assert [t["to"] for t in history][:3] == ["queued", "starting", "running"]
        assert wait_until(lambda: (lambda lines: lines and all(s.endswith(" 0.0") for s in lines))(
            exported_series("raytrain_service_waiting_jobs", 'team="q"', 'cause="team_quota"')), 60)
        wait_state(svc, second, "finished")


def test_a_start_whose_workers_cannot_be_placed_goes_back_to_the_queue_then_fails_saying_why(
        ray_cluster, tiny_dataset, tmp_path, gates):
    """Six workers on the session's four CPUs (the service told it has eight): the start shows
    the placement reason, is given up after start_stall_s and goes back to the queue saying so;
    admitted again and given up again, it fails (max_start_returns 1), never bouncing on. Its
    runner and its placement groups are gone each time."""
    spec = job_spec(tmp_path, tiny_dataset, "big", resources={"num_workers": 6})
    stall_s = 12.0  # above the run's own preparation on a loaded machine: placement is what stalls
    with running_service(tmp_path / "svc.db", gates, cluster_workers=8, start_stall_s=stall_s,
                         max_start_returns=1, warm_workers_per_node=1) as svc:
        ray.get(svc.add_team.remote("a", 8))
        # Both starts on a spare runner (up in a second): a fresh one's first answer holds a pass
        # for the status timeout (10 s), which would only make the test longer.
        assert wait_until(lambda: ray.get(svc.info.remote())["spare_runners"]["up"] == 2, 60)
        job_id = ray.get(svc.submit.remote("a", spec))["id"]
        starting = wait_for(svc, job_id, lambda j: j["wait_cause"] == "placement", "the placement reason")
        assert starting["state"] == "starting"
        assert starting["wait_reason"] == "waiting for the cluster to place its 6 workers: Ray has not found room " \
                                          "for them yet"
        failed = wait_state(svc, job_id, "failed", timeout_s=4 * stall_s + 60)
        history = ray.get(svc.history.remote(job_id))
        assert [t["to"] for t in history] == ["queued", "starting", "queued", "starting", "failed"], history
        back = history[2]["reason"]
        assert back.startswith(starting["wait_reason"]) and f"no progress for {stall_s:g} s (start_stall_s)" in back
        assert back.endswith("back in the queue (1 of 1 returns before it fails)")
        assert failed["message"].startswith("could not start: waiting for the cluster to place its 6 workers")
        assert failed["message"].endswith("2 starts in a row given up (max_start_returns 1)")
        assert (failed["wait_cause"], failed["start_returns"], failed["workers"]) == (None, 2, 0)
        assert wait_until(lambda: not runner_actors(), 30)
        assert_cluster_idle()


def test_cli_starts_reports_and_stops_the_service(ray_cluster, tmp_path, capsys, monkeypatch):
    from raytrain_sys.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["service", "start", "--db", "sqlite:///svc.db", "--cluster-workers", "3"]) == 0
    started = capsys.readouterr().out
    assert started.startswith("started:") and str(tmp_path / "svc.db") in started
    assert main(["service", "status"]) == 0
    status = capsys.readouterr().out
    assert '"cluster_workers": 3' in status and "no HTTP API" in status or "HTTP API on" in status
    assert main(["service", "stop"]) == 0 and capsys.readouterr().out.strip() == "stopped"
    assert get_service() is None
    assert main(["service", "status"]) == 1 and capsys.readouterr().out.strip() == "not running"


@pytest.mark.parametrize("state, tracking, run_id, reported", [
    ("running", True, "", "starting"),
    ("running", True, "abc", "running"),
    ("checkpointing", True, "", "starting"),
    ("running", False, "", "running"),
    ("starting", True, "", "starting"),
    ("restoring", True, "", "restoring"),
    ("failed", True, "", "failed"),
    ("finished", True, "abc", "finished"),
], ids=[
    "a run that trains while its MLflow run still opens is reported starting",
    "once its run id is known it is reported running",
    "any training state counts, not only running",
    "a run that tracks nothing is reported as it is",
    "a run still starting is reported starting",
    "a resume restoring keeps its state",
    "a run that failed to open its MLflow run is reported failed, not starting",
    "an ended run is reported as it is",
])
def test_reported_state(state, tracking, run_id, reported):
    from raytrain_sys.service.model import RunnerState
    from raytrain_sys.service.runner import reported_state

    assert reported_state(RunnerState(state), tracking, run_id) is RunnerState(reported)


def test_every_supervisor_state_is_a_state_the_runner_can_report():
    """The runner reports the Supervisor's state as a ``RunnerState``: a state the Supervisor gains
    without one here would make every ``status`` of such a run raise."""
    from raytrain_sys.control.supervisor import State
    from raytrain_sys.service.model import RunnerState

    assert {s.value for s in State} <= {s.value for s in RunnerState}
    assert {s.value for s in State if s.terminal} == {s.value for s in RunnerState if s.ended}
