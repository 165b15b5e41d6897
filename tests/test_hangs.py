"""Hangs (issue 59): a rank that stops progressing while its actor still answers, and every other
rank waits on it in a collective.

The verdict first, pure (``liveness.find_hung`` on the ranks' phase markers): the stuck rank is
named, never the ones waiting on it. Then on the session's real Ray cluster (gloo), a rank stuck
in its loss and a rank that skips one all-reduce: found within the step's deadline plus 2 s, the
right rank named, its stack's top frame in summary.json, the log and the MLflow run, no step
redone, and the run ending like an uninterrupted one (fp64)."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest

from raytrain_sys.control.supervisor import run_job
from raytrain_sys.control.supervisor.liveness import find_hung
from raytrain_sys.control.supervisor.policy import collective_timeout_s
from raytrain_sys.parallel import phases as ph
from tests import hang_tasks
from tests.ft_common import assert_like_reference, ft_spec, run_with_events
from tests.helpers import final_params


def at(rank: int, phase: str, step: int = 19, index: int = -1, since: float = 100.0,
       group: tuple | None = None) -> dict:
    """A rank's phase as ``TrainWorker.phase`` answers it."""
    return {"rank": rank, "phase": phase, "step": step, "index": index, "since_unix_s": since,
            "group": list(group) if group is not None else None}


NOW = 110.0


# ------------------------------------------------------------------ who is hung (pure)
@pytest.mark.parametrize("phases, named", [
    ({0: at(0, ph.ALL_REDUCE, index=0, since=101.0), 1: at(1, ph.FORWARD)}, {1}),
    ({0: at(0, ph.ALL_REDUCE, index=0), 1: at(1, ph.AGREEMENT)}, {1}),
    ({0: at(0, ph.AGREEMENT), 1: at(1, ph.ALL_REDUCE, index=0)}, {0}),
    ({0: at(0, ph.ALL_REDUCE, index=0), 1: at(1, ph.ALL_REDUCE, index=0)}, set()),
    ({0: at(0, ph.FORWARD), 1: at(1, ph.BACKWARD)}, set()),
    ({0: at(0, ph.ALL_REDUCE, index=0), 1: at(1, ph.DATA), 2: at(2, ph.ALL_REDUCE, index=0)}, {1}),
    ({0: at(0, ph.ALL_REDUCE, index=0), 1: at(1, ph.IDLE, step=19)}, {1}),
    ({0: at(0, ph.FORWARD), 1: at(1, ph.OPTIMIZER), 2: at(2, ph.AGREEMENT)}, {0, 1}),
    ({0: at(0, ph.AGREEMENT), 1: at(1, ph.FORWARD), 2: at(2, ph.AGREEMENT),
      3: at(3, ph.ALL_REDUCE, index=0, group=(1, 3))}, {1}),
    ({0: at(0, ph.AGREEMENT), 1: at(1, ph.AGREEMENT), 2: at(2, ph.AGREEMENT),
      3: at(3, ph.ALL_REDUCE, index=0, group=(1, 3))}, {1}),
    ({0: at(0, ph.AGREEMENT, step=20), 1: at(1, ph.ALL_REDUCE, index=0, step=19)}, {0}),
], ids=[
    "a rank stuck in its loss while its peer waits in the all-reduce: the stuck rank, not the waiting one",
    "a rank that skipped the all-reduce waits in the agreement: it is named, not the peer in the all-reduce",
    "the same with the ranks the other way round: rank 0 skipped it",
    "every rank in the same all-reduce: nobody (they wait on something outside the group: the pings' to find)",
    "every rank computing: nobody (a step longer than its deadline, not a hang of one rank)",
    "three ranks, one stuck assembling its rows: only it",
    "a rank whose lease never began while its peer waits in the step's all-reduce: it",
    "two ranks stuck computing while the third waits in the agreement: both",
    "a 2x2 mesh, rank 1 stuck in its loss: rank 3 waits in their replicas' all-reduce, ranks 0 and 2 in the "
    "agreement: only rank 1",
    "a 2x2 mesh, rank 1 skipped its replicas' all-reduce: only it, not the other pair waiting in the agreement",
    "a rank a step ahead in the agreement while its peer waits in the step before's all-reduce: the one ahead",
])
def test_the_hung_rank_is_the_one_not_in_the_collective_its_peers_wait_in(phases, named):
    assert set(find_hung(phases, NOW)) == named


def test_the_verdict_says_where_each_one_is():
    stuck = find_hung({0: at(0, ph.ALL_REDUCE, index=0, since=105.0), 1: at(1, ph.FORWARD, since=101.5)}, NOW)
    assert stuck == {1: "stuck in the forward and loss (task.loss_sum) of step 20 for 8.5 s while its peers "
                        "wait in the gradients' all-reduce (bucket 0) of step 20"}
    skipped = find_hung({0: at(0, ph.ALL_REDUCE, index=2), 1: at(1, ph.AGREEMENT)}, NOW)
    assert skipped == {1: "skipped the gradients' all-reduce (bucket 2) of step 20, which its peers wait in: it "
                          "waits in the step's agreement (all-gather) of step 20"}


# ------------------------------------------------------------------ on a real cluster
STEPS = 24
HANG_AT = 20  # the hung rank's call of its loss that hangs: step 20 (no evaluation here)


def hang_spec(tmp_path, dataset, task: str = "", marker_dir: str = ""):
    """ft_spec's job (fp64, a checkpoint every 5 steps, elastic.hang_floor_s 4) with automatic
    leases: a hang comes in the middle of a lease of many steps, as in a user's job."""
    train = {"steps_per_call": 0}
    if task:
        train.update(task=f"tests.hang_tasks:{task}", task_args={"marker_dir": marker_dir, "rank": 1,
                                                                 "at_call": HANG_AT})
    return ft_spec(tmp_path, dataset, STEPS, train=train)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dataset, tmp_path_factory):
    """The same job with the model's own task, uninterrupted."""
    result = run_job(hang_spec(tmp_path_factory.mktemp("ref"), tiny_dataset))
    return final_params(result.newest_checkpoint), result


@pytest.mark.parametrize("task, phase, top_file, top_function", [
    ("StuckInLoss", ph.FORWARD, "hang_tasks.py", "loss_sum"),
    ("SkipsAllReduce", ph.AGREEMENT, "distributed_c10d.py", "all_gather"),
], ids=["a rank stuck in its loss: named, not the peer waiting in the all-reduce",
        "a rank that skipped an all-reduce, waiting in the step's agreement: named, not the peer in the all-reduce"])
def test_a_hung_rank_is_found_at_the_deadline_named_with_its_stack_and_replaced(
        reference, tiny_dataset, tmp_path, caplog, task, phase, top_file, top_function):
    spec = hang_spec(tmp_path, tiny_dataset, task, str(tmp_path))
    first = {}
    with caplog.at_level(logging.WARNING, logger="raytrain_sys"):
        result, sup, seen = run_with_events(spec, {1: lambda s: first.update(slot=s.group.workers[1].slot)})
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset, STEPS)  # 0 redone, same params
    began = hang_tasks.began_at(str(tmp_path))
    assert began, "the task never hung"
    [recovery] = summary["recoveries"]
    [hung] = recovery["hung"]
    # The right rank: the one that hung, in its phase of step 20; not its peer, which waited.
    assert (hung["slot"], hung["rank"], hung["phase"], hung["step"]) == (first["slot"], 1, phase, HANG_AT), hung
    rebuild = [t for t in summary["transitions"] if t["state"] == "rebuilding"]
    assert len(rebuild) == 1 and f"worker {first['slot']} on node" in rebuild[0]["reason"], rebuild
    assert "hung:" in rebuild[0]["reason"] and "blocked in a collective" not in rebuild[0]["reason"], rebuild
    # Found within the step's deadline (learned: here its floor) plus 2 s of the hang's start.
    assert hung["deadline_s"] == pytest.approx(spec.elastic.hang_floor_s), hung["deadline_s"]
    assert rebuild[0]["detected_at"] - began <= hung["deadline_s"] + 2.0, (rebuild[0]["detected_at"] - began, hung)
    # Its stack: the top frame of its training thread, in summary.json, the log and MLflow.
    top = hung["top_frame"]
    assert os.path.basename(top["file"]) == top_file and top["function"] == top_function, top
    where = f'File "{top["file"]}", line {top["line"]}, in {top_function}'
    assert where in hung["stack"] and where in caplog.text, caplog.text[-3000:]
    artifact = mlflow_text(spec, result.mlflow_run_id, f"hangs/step-{HANG_AT}-worker-{first['slot']}.txt")
    assert where in artifact and hung["reason"] in artifact
    # The peer was released from its collective by the hung rank's end, not by its timeout.
    assert rebuild[0]["time"] - rebuild[0]["detected_at"] < collective_timeout_s(hung["deadline_s"]) - hung["deadline_s"]


def mlflow_text(spec, run_id: str, path: str) -> str:
    """An artifact of the job's MLflow run (the tests' local store), as text."""
    import mlflow

    from raytrain_sys.tracking import mlflow_tracker as mt

    client = mlflow.tracking.MlflowClient(mt.default_tracking_uri(os.path.abspath(spec.output_dir)))
    with open(client.download_artifacts(run_id, path, dst_path=tempfile.mkdtemp())) as f:
        return f.read()


def test_a_read_stuck_in_its_transform_is_found_its_process_ended_and_the_read_made_again(
        ray_cluster, tiny_dataset, tmp_path, caplog, monkeypatch):
    """A data.transform that never returns in a read task (not a rank: no rank is stuck, the
    driver waits for the read): found data.read_timeout_s plus at most 2 s after the driver began
    waiting for it, its stack's top frame (the transform) in summary.json and the log, its process
    ended and the read made again by Ray; no step redone, the run equal to an uninterrupted one."""
    from raytrain_sys.data import reads

    # Chunks of a few global batches and windows of 64 rows, so that the reads after the first
    # (one window, made in the driver) are read tasks' (the tiny corpus would be one chunk).
    # DataPlane reads reads.CHUNK_BYTES when it is made, in this process.
    monkeypatch.setattr(reads, "CHUNK_BYTES", 1)
    data = {"shuffle_window": 64, "shuffle_block_rows": 16}
    undisturbed = run_job(ft_spec(tmp_path / "ref", tiny_dataset, STEPS, train={"steps_per_call": 0}, data=data))
    reference = (final_params(undisturbed.newest_checkpoint), undisturbed)
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, train={"steps_per_call": 0},  # hang_spec's job
                   data={**data, "read_timeout_s": 3.0, "transform": "tests.hang_tasks:stuck_once_in_a_read_task"})
    marker_dir = hang_tasks.arm_read_hang()
    try:
        with caplog.at_level(logging.WARNING, logger="raytrain_sys"):
            result, sup, seen = run_with_events(spec, {})
    finally:
        hang_tasks.disarm_read_hang()
    assert hang_tasks.began_at(marker_dir), "no read task hung"
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset, STEPS)  # 0 redone, same params
    [hang] = summary["read_hangs"]
    assert hang["hang"] == 1 and hang["waited_s"] <= spec.data.read_timeout_s + 2.0, hang
    top = hang["top_frame"]
    assert os.path.basename(top["file"]) == "hang_tasks.py" and top["function"] == "stuck_once_in_a_read_task", top
    where = f'File "{top["file"]}", line {top["line"]}, in stuck_once_in_a_read_task'
    assert where in hang["stack"] and where in caplog.text, caplog.text[-3000:]
    assert any(hang["reason"] in t["reason"] for t in summary["transitions"]), summary["transitions"]
    assert summary["failures"] == 0 and not summary["recoveries"]
