"""Pause, cancel and resize asked of a running job from outside its step loop
(``RunRequests``: what the job service's runner uses), on the session's multi-node cluster.

What a user would notice: a paused run resumes, in the same MLflow run, to the parameters of an
uninterrupted one; a cancelled run ends at a step boundary with its resources free; a shrink
loses no step and the run still equals the uninterrupted one, and it grows back when allowed."""

from __future__ import annotations

import threading
import time

import pytest

from raytrain_sys.control.supervisor import RunRequests, resume_job, run_job
from tests.ft_common import (assert_like_reference, assert_no_leftovers, ft_spec, supervisor_with_events,
                             wait_for_a_ready_newcomer)
from tests.helpers import assert_params_close, final_params, read_summary

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS = 16
SLOW_READ_S = 12.0  # each read task's first row (slow_read_tasks): the next window arrives this late


def spec_for(tmp_path, dataset, **sections):
    return ft_spec(tmp_path, dataset, STEPS, **sections)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dataset, tmp_path_factory):
    result = run_job(spec_for(tmp_path_factory.mktemp("ref"), tiny_dataset))
    return final_params(result.newest_checkpoint), result


def run_with_requests(spec, events: dict):
    """A Supervisor with ``RunRequests``; ``events[N](requests, supervisor)`` runs at step N's
    commit (from the step loop's thread; a runner calls the same methods from its own)."""
    requests = RunRequests()
    sup, seen = supervisor_with_events(spec, {step: (lambda sup, f=f: f(requests, sup))
                                               for step, f in events.items()})
    sup.requests = requests
    return sup.run(), sup, seen


def test_pause_then_resume_equals_an_uninterrupted_run(reference, tiny_dataset, tmp_path, ray_cluster):
    ref_params, ref = reference
    spec = spec_for(tmp_path, tiny_dataset)
    paused, sup, _ = run_with_requests(spec, {6: lambda r, s: r.pause("make room", by="scheduler")})
    assert paused.status == "stopped", paused
    step = paused.committed_steps
    assert 6 <= step < STEPS
    summary = read_summary(paused.run_dir)
    # The pause saved the step it stopped at, durable, and said who asked and why.
    assert summary["checkpoints"][-1]["step"] == step and paused.newest_checkpoint.endswith(f"{step:08d}")
    assert "paused by scheduler: make room" in summary["transitions"][-1]["reason"]
    assert_no_leftovers(ray_cluster, sup.run_key)  # every worker released while paused

    resumed = resume_job(paused.mlflow_run_id, tracking_uri=spec.tracking.uri or sup.tracking_uri)
    assert resumed.status == "finished" and resumed.mlflow_run_id == paused.mlflow_run_id
    assert resumed.committed_steps == STEPS
    assert_params_close(final_params(resumed.newest_checkpoint), ref_params, rtol=1e-6, atol=1e-9)
    assert resumed.losses == pytest.approx(ref.losses, rel=1e-9)


def test_cancel_stops_at_a_boundary_and_adds_no_checkpoint(tiny_dataset, tmp_path, ray_cluster):
    spec = spec_for(tmp_path, tiny_dataset)
    result, sup, _ = run_with_requests(spec, {7: lambda r, s: r.cancel("no longer needed", by="team-a")})
    assert result.status == "cancelled", result
    summary = read_summary(result.run_dir)
    assert 7 <= result.committed_steps < STEPS
    # Checkpoints kept (the periodic one at step 5), none added by the cancel.
    assert [c["step"] for c in summary["checkpoints"]] == [5]
    assert "cancelled by team-a: no longer needed" in summary["transitions"][-1]["reason"]
    assert_no_leftovers(ray_cluster, sup.run_key)


def test_shrink_then_grow_back_loses_no_step(reference, tiny_dataset, tmp_path, ray_cluster):
    """Three workers; the service asks for one at step 4 (the others leave at a boundary, as
    from a draining node), then for three again at step 9."""
    spec = spec_for(tmp_path, tiny_dataset, resources={"num_workers": 3},
                    elastic={"min_workers": 1, "max_workers": 3})
    result, sup, seen = run_with_requests(spec, {
        4: lambda r, s: r.resize(1, "team b is owed its quota", by="scheduler"),
        9: lambda r, s: r.resize(3, "quota free again", by="scheduler"),
        # Newcomers take seconds to start: hold the loop until both are up (as the fault tests
        # do), or the run may end before the second joins.
        10: lambda r, s: wait_for_a_ready_newcomer(s, every=True)})
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset, STEPS)
    worlds = summary["world_sizes"]
    assert worlds[:4] == [3] * 4 and 1 in worlds and worlds[-1] == 3, worlds
    shrink = [t for t in summary["transitions"] if t["reason"].startswith("shrinking to 1")]
    assert len(shrink) == 1 and "team b is owed its quota (by scheduler)" in shrink[0]["reason"]
    assert summary["failures"] == 0 and summary["steps_redone"] == 0
    assert_no_leftovers(ray_cluster, sup.run_key)


_slowed: set[str] = set()


def slow_read_tasks(row):
    """A ``data.transform`` under which every read task waits SLOW_READ_S before its first row,
    as reads wait for their reader processes to start on a busy node; the run's first read, made
    in its driver (``DataPlane.read_first_here``), does not."""
    import ray

    task = ray.get_runtime_context().get_task_id()
    if task is not None and task not in _slowed:
        _slowed.add(task)
        time.sleep(SLOW_READ_S)
    return row


def test_a_pause_while_the_next_batch_is_read_stops_at_once(tiny_dataset, tmp_path, ray_cluster):
    """The run trains through its first window (read in the driver) and then waits for the next
    one's read; a pause asked meanwhile is carried out then, not after the read. Before the step
    loop waited for reads a slice at a time (Boundary.read_unless_due) it sat in the lease's
    dispatch until the read came: a service pause one second into a job took 7-8 s."""
    spec = spec_for(tmp_path, tiny_dataset, data={"transform": f"{__name__}:slow_read_tasks", "shuffle_window": 64},
                    train={"max_steps": 40})
    window_steps = 64 // spec.train.global_batch_size
    asked: list[float] = []

    def pause_while_reading(requests, sup):
        def later():  # the driver is at the end of the first window, its next batch in a read task
            while sup.committed_step < window_steps - 1:
                time.sleep(0.05)
            time.sleep(1.0)
            asked.append(time.time())
            requests.pause("make room", by="scheduler")
        threading.Thread(target=later, daemon=True).start()

    result, sup, _ = run_with_requests(spec, {1: pause_while_reading})
    assert result.status == "stopped", result
    stopped = read_summary(result.run_dir)["transitions"][-1]
    assert "paused by scheduler: make room" in stopped["reason"]
    # Stopped within seconds of the pause, not once the read came, at the end of the window read.
    assert stopped["time"] - asked[0] < SLOW_READ_S / 3, (stopped, asked)
    assert result.committed_steps == window_steps, result
    assert_no_leftovers(ray_cluster, sup.run_key)
