"""Driver loss: the supervisor process itself dies mid-run, and `raytrain-sys resume` carries on.

Resumed within elastic.orphan_timeout_s, the new driver adopts the live workers (the same
processes, no step trained again: control/adoption.py); resumed after it, the agents have ended
them and the resume restores the newest checkpoint.

The driver runs as `raytrain-sys run` in a subprocess attached to the session cluster
(RAY_ADDRESS), tracked on a real `mlflow server` (a driver stopped in the middle of a SQLite
write would lock the store for the resume). What Ray does with a SIGKILLed driver's actors and
placement groups, and what the resume does about leftovers, are both asserted:

* while the old driver is alive (SIGSTOP: alive but silent), a resume refuses with a clear
  error and touches nothing of the run;
* once the driver is SIGKILLed, its workers train on nothing but live on (they answer to their
  nodes' agents, not to the driver: control/node_agent.py), and the agents end the launch, every
  actor and placement group of it, once the driver has been gone for elastic.orphan_timeout_s;
* the resume continues from the newest committed checkpoint in the same MLflow run and run
  dir, ends with the same parameters as an uninterrupted run, every sample exactly once, and
  leaves nothing of the run on the cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from raytrain_sys.control.supervisor import run_job
from raytrain_sys.control.supervisor.journal import State
from raytrain_sys.control.launches import find_leftovers, run_name_prefix
from tests.ft_common import (assert_like_reference, assert_no_leftovers, ft_spec, wait_until)
from tests.helpers import final_params, read_summary

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS = 40
KILL_AFTER_STEP = 12  # checkpoints every 5 steps: the resume redoes the steps after step 10
ORPHAN_S = 8.0  # elastic.orphan_timeout_s: the agents end the run this long after its driver's death
RAYTRAIN_SYS = str(Path(sys.executable).parent / "raytrain-sys")
REPO = Path(__file__).resolve().parents[1]


def driver_spec(tmp_path, dataset, mlflow_uri, orphan_s: float = ORPHAN_S, **train):
    return ft_spec(tmp_path, dataset, STEPS, train={"log_every_steps": 1, **train},
                   elastic={"orphan_timeout_s": orphan_s}, tracking={"uri": mlflow_uri, "experiment": "driver-loss"})


@pytest.fixture(scope="module")
def reference(ray_nodes, tiny_dataset, tmp_path_factory, mlflow_server):
    """The uninterrupted run (final parameters, result) both driver losses must end equal to."""
    ref = run_job(driver_spec(tmp_path_factory.mktemp("ref"), tiny_dataset, mlflow_server))
    return final_params(ref.newest_checkpoint), ref


def start_driver(spec, tmp_path, address: str, **env_vars: str):
    """``raytrain-sys run`` of ``spec`` in a subprocess attached to the session cluster: (process,
    its log's path, the environment for the resume)."""
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(spec.to_dict()))
    env = {**os.environ, "RAY_ADDRESS": address,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env_vars}
    log_path = tmp_path / "driver.log"
    with open(log_path, "w") as log_file:
        driver = subprocess.Popen([RAYTRAIN_SYS, "run", str(job_yaml)], cwd=tmp_path, env=env,
                                  stdout=log_file, stderr=subprocess.STDOUT)
    return driver, log_path, env


def resume_command(run_id: str, mlflow_uri: str, output_dir: str) -> list[str]:
    return [RAYTRAIN_SYS, "resume", "--mlflow-run", run_id, "--tracking-uri", mlflow_uri, "--output-dir", output_dir]


def run_workers(run_key: str) -> list[tuple[str, int]]:
    """The run's live TrainWorker actors: (name, pid), sorted."""
    from ray._private import state

    prefix = run_name_prefix(run_key)
    return sorted((a["Name"], a["Pid"]) for a in state.actors().values()
                  if a["State"] == "ALIVE" and a["ActorClassName"] == "TrainWorker"
                  and (a.get("Name") or "").startswith(prefix))


def run_agents(run_key: str) -> list[str]:
    """The names of the run's live node agents."""
    from ray._private import state

    prefix = run_name_prefix(run_key)
    return [a["Name"] for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"] == "NodeAgent" and (a.get("Name") or "").startswith(prefix)]


def committed(run_dir: str) -> int:
    try:
        return read_summary(run_dir)["committed_steps"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_driver_killed_mid_run_then_resumed(ray_nodes, tiny_dataset, tmp_path, mlflow_server, reference):
    ref = reference[1]
    spec = driver_spec(tmp_path / "job", tiny_dataset, mlflow_server)
    driver, log_path, env = start_driver(spec, tmp_path, ray_nodes.address)
    try:
        latest = os.path.join(spec.output_dir, "latest")
        assert wait_until(lambda: os.path.exists(os.path.join(latest, "summary.json")), 180), \
            log_path.read_text()[-3000:]
        run_dir = os.path.realpath(latest)
        assert wait_until(lambda: committed(run_dir) >= KILL_AFTER_STEP, 180, interval_s=0.01), \
            log_path.read_text()[-3000:]
        # Alive but silent: the driver holds its workers and answers nothing.
        driver.send_signal(signal.SIGSTOP)
        at_stop = read_summary(run_dir)
        # Mid-run: any live state (a lease of several steps can reach step 15's checkpoint
        # before the stop lands, so "checkpointing" is as likely as "running").
        assert not State(at_stop["status"]).terminal, at_stop["status"]
        assert at_stop["committed_steps"] < STEPS
        run_id, run_key = at_stop["mlflow_run_id"], os.path.basename(run_dir)
        assert find_leftovers(run_key), "the running driver's workers should be visible"
        summary_before = Path(run_dir, "summary.json").read_text()

        resume = resume_command(run_id, mlflow_server, spec.output_dir)
        refused = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=300)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"run {run_key} is still running" in refused.stderr
        assert "stop that driver" in refused.stderr
        assert Path(run_dir, "summary.json").read_text() == summary_before  # untouched

        workers = run_workers(run_key)
        assert len(workers) == 2 and len(run_agents(run_key)) >= 1, (workers, run_agents(run_key))
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
        killed_at = time.monotonic()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=60)
    # The workers answer to their node's agent, not to the driver: the same processes live on...
    time.sleep(2.0)
    assert run_workers(run_key) == workers, "the workers died with their driver"
    # ...until the driver has been gone for elastic.orphan_timeout_s: then the agents end the
    # launch, and nothing of it is left.
    assert wait_until(lambda: find_leftovers(run_key) == [], ORPHAN_S + 30.0), find_leftovers(run_key)
    assert time.monotonic() - killed_at >= ORPHAN_S - 1.0

    resumed = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "finished: 40 steps" in resumed.stdout

    summary = read_summary(run_dir)
    assert summary["mlflow_run_id"] == run_id
    # Continued from the newest committed checkpoint the lost driver wrote (step 10 or later).
    resumed_step = int(os.path.basename(summary["resumed_from"][-1]).split("_")[-1])
    assert resumed_step >= 10 and resumed_step % 5 == 0
    # Nothing was left to adopt (the agents had ended the launch): no adoption tried, none said.
    assert not any("adopt" in t["reason"] for t in summary["transitions"]), summary["transitions"]
    # The steps the lost driver committed past that checkpoint are trained again, and counted.
    redone = at_stop["committed_steps"] - resumed_step
    assert summary["steps_redone"] == redone, (summary["steps_redone"], at_stop["committed_steps"], resumed_step)
    if redone:
        assert summary["recoveries"][-1]["from"] == "checkpoint" and summary["recoveries"][-1]["steps_redone"] == redone
        assert any(f"steps {resumed_step + 1}..{at_stop['committed_steps']} were committed by the lost driver"
                   in t["reason"] for t in summary["transitions"]), summary["transitions"]
    result = type(ref)(summary["status"], run_dir, summary["committed_steps"], summary["losses"],
                       run_id, summary["newest_checkpoint"], os.path.join(run_dir, "summary.json"))
    assert_like_reference(result, [], reference, spec, tiny_dataset, STEPS, redone_ok=True)
    assert_no_leftovers(ray_nodes.address, run_key)

    import mlflow

    run = mlflow.MlflowClient(tracking_uri=mlflow_server).get_run(run_id)
    assert run.info.status == "FINISHED"
    print(json.dumps({"killed_after_step": at_stop["committed_steps"],
                      "resumed_from_step": resumed_step}))


def held_step(run_key: str) -> int:
    """The newest step every worker of the run's live launch holds (0: none found)."""
    import ray

    from raytrain_sys.control.adoption import named_ranks
    from raytrain_sys.control.launches import launches

    held = [ray.get(actor.ping.remote(), timeout=10) for launch in launches()
            if launch.startswith(run_name_prefix(run_key)) for actor, _ in named_ranks(launch).values()]
    return min(held) if len(held) == 2 else 0


def lease_at_agents(run_key: str, lease: int) -> bool:
    """Whether lease ``lease`` of the run's live launch reached its node agents (sent)."""
    import ray

    from raytrain_sys.control.adoption import agents_of
    from raytrain_sys.control.launches import launches

    agents = [a for launch in launches() if launch.startswith(run_name_prefix(run_key))
              for a in agents_of(launch).values()]
    return any(refs is not None for refs in ray.get([a.refs.remote(lease) for a in agents], timeout=10))


def loss_history(mlflow_uri: str, run_id: str) -> list[tuple[int, float]]:
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=mlflow_uri).get_metric_history(run_id, "loss")
    return sorted((m.step, m.value) for m in history)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_driver_killed_mid_lease_then_its_workers_adopted(ray_nodes, tiny_dataset, tmp_path, mlflow_server,
                                                          reference):
    """SIGKILL the driver in the middle of a lease of 6 steps, then `raytrain-sys resume` at once:
    the new driver adopts the same worker processes where their lease ended, restores nothing,
    commits the steps trained while no driver was up from the workers' record, and ends equal to
    the uninterrupted run, every sample once, with each step's loss logged once in MLflow."""
    # With the lease after it sent ahead (train.run_ahead, the default), rank 1's call of it sent
    # by its node's agent (RAYTRAIN_NODE_AGENTS=on, as from 8 ranks on by default): see below for
    # what becomes of it.
    spec = driver_spec(tmp_path / "job", tiny_dataset, mlflow_server, orphan_s=120.0, steps_per_call=6)
    # Slower steps (timing only: not a training setting), and leases of 6 steps that no checkpoint
    # cuts short before step 20, so that the kill lands in a lease (13..18: the one after step 12's
    # commit, sent ahead).
    spec.elastic.fault_slow_rank, spec.elastic.fault_slow_factor = 0, 20.0
    spec.checkpoint.every_steps = 20
    driver, log_path, env = start_driver(spec, tmp_path, ray_nodes.address, RAYTRAIN_NODE_AGENTS="on")
    try:
        latest = os.path.join(spec.output_dir, "latest")
        assert wait_until(lambda: os.path.exists(os.path.join(latest, "summary.json")), 180), \
            log_path.read_text()[-3000:]
        run_dir = os.path.realpath(latest)
        assert wait_until(lambda: read_summary(run_dir).get("mlflow_run_id"), 180), log_path.read_text()[-3000:]
        run_id, run_key = read_summary(run_dir)["mlflow_run_id"], os.path.basename(run_dir)
        # A moment into the lease after step 12's: both workers hold step 13 (the driver commits
        # the lease's steps at its end, 18), and the lease after it (4: 19..20) was sent ahead
        # (once its first batch was read: Boundary.sends_ahead).
        assert wait_until(lambda: held_step(run_key) > KILL_AFTER_STEP and lease_at_agents(run_key, 4), 180,
                          interval_s=0.05), log_path.read_text()[-3000:]
        workers = run_workers(run_key)
        assert len(workers) == 2, workers
        held_at_kill = held_step(run_key)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
        killed_at = time.time()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=60)
    resume = subprocess.Popen(resume_command(run_id, mlflow_server, spec.output_dir), cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The same processes train on under the new driver.
        assert wait_until(lambda: committed(run_dir) > KILL_AFTER_STEP + 6 or resume.poll() is not None,
                          300, interval_s=0.05)
        during = run_workers(run_key)
        out, err = resume.communicate(timeout=300)
    finally:
        if resume.poll() is None:
            resume.kill()
    assert resume.returncode == 0, err[-5000:]
    assert "finished: 40 steps" in out
    assert during == workers, (during, workers, [t["reason"] for t in read_summary(run_dir)["transitions"]][-14:])

    summary = read_summary(run_dir)
    assert summary["mlflow_run_id"] == run_id
    assert summary["steps_redone"] == 0 and summary["recoveries"] == [] and summary["failures"] == 0
    adopted = [t for t in summary["transitions"] if "adopted the 2 live workers of the lost driver" in t["reason"]]
    assert len(adopted) == 1, summary["transitions"]
    adopted_at = int(re.search(r"at step (\d+)", adopted[0]["reason"]).group(1))
    # The lease after 13..18 (19..20: a checkpoint at 20) was sent ahead before the kill; rank 0's
    # call of it (the driver's own) was dropped with the driver. Rank 1's (its agent's) began
    # when its rows had reached it before Ray learned that their owner, the driver, was dead:
    # then the resume completes that lease for rank 0 (1 run of 3 here); else rank 1's call
    # failed with its rows and neither began it (the others). Either way adopted at 18.
    completed = [t["reason"] for t in summary["transitions"] if "sent ahead by the lost driver" in t["reason"]]
    assert adopted_at == 18 and len(completed) <= 1, (held_at_kill, [t["reason"] for t in summary["transitions"]])
    assert not completed or "lease 4 (steps 19..20)" in completed[0] and "begun by 1 of the workers" in completed[0]
    # The lease after step 12's (sent ahead) ran on with no driver: its steps were committed from
    # the workers' record, and their losses equal the reference's (below).
    assert adopted_at > KILL_AFTER_STEP
    assert not summary["resumed_from"]  # nothing restored
    result = type(reference[1])(summary["status"], run_dir, summary["committed_steps"], summary["losses"],
                                run_id, summary["newest_checkpoint"], os.path.join(run_dir, "summary.json"))
    assert_like_reference(result, [], reference, spec, tiny_dataset, STEPS, redone_ok=True)
    # One value a step in the MLflow run: the lost driver's steps are not logged again.
    history = loss_history(mlflow_server, run_id)
    assert [step for step, _ in history] == list(range(1, STEPS + 1)), history
    torch.testing.assert_close(torch.tensor([v for _, v in history], dtype=torch.float64),
                               torch.tensor(summary["losses"], dtype=torch.float64), rtol=1e-6, atol=0)
    assert_no_leftovers(ray_nodes.address, run_key)
    first = next(t for t in summary["transitions"] if t["time"] > killed_at and t["state"] == "running")
    print(json.dumps({"killed_after_step": KILL_AFTER_STEP, "adopted_at_step": adopted_at, "completed": completed,
                      "kill_to_training_s": round(first["time"] - killed_at, 2)}))


ORPHAN_MAKER = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1])
prefix = sys.argv[2]

@ray.remote(num_cpus=0)
class Orphan:
    def ping(self):
        return 1

pg = placement_group([{"CPU": 1}], name=prefix + "0", lifetime="detached")
ray.get(pg.ready(), timeout=120)
actor = Orphan.options(name=prefix + "0", lifetime="detached").remote()
ray.get(actor.ping.remote(), timeout=120)
print("MADE", flush=True)
"""


@pytest.mark.timeout(300)
def test_leftovers_of_a_dead_driver_are_removed(ray_nodes):
    """What Ray does not clean up by itself (detached lifetimes: a leak, or another tool's) is
    removed by the resume's clean-up once the job that made it is dead."""
    from raytrain_sys.control.launches import clean_up_leftovers, run_name_prefix

    run_key = "orphans-test"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    made = subprocess.run([sys.executable, "-c", ORPHAN_MAKER, ray_nodes.address,
                           run_name_prefix(run_key) + "dead-launch:"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert "MADE" in made.stdout, made.stderr[-3000:]
    left = find_leftovers(run_key)
    assert sorted(x.kind for x in left) == ["actor", "placement_group"]
    removed = clean_up_leftovers(run_key, grace_s=30.0)
    assert sorted(x.kind for x in removed) == ["actor", "placement_group"]
    assert find_leftovers(run_key) == []
    assert_no_leftovers(ray_nodes.address, run_key)
