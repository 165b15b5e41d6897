"""Asynchronous checkpoints (checkpoint.async_save): training goes on while the files are written,
the checkpoints hold the same bytes of state as synchronous ones, and a worker lost while its
file is still being written leaves no checkpoint that looks complete.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from raytrain_sys.checkpoint.checkpointer import Checkpointer
from raytrain_sys.checkpoint.state import read_full_state
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.supervisor import RunRequests, run_job
from raytrain_sys.tracking import mlflow_tracker as mt
from tests.ft_common import (assert_like_reference, ft_spec, pid_alive, run_with_events,
                             supervisor_with_events, wait_until, worker_pid)
from tests.helpers import assert_params_equal, final_params, read_summary, tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS = 16
HOLD_S = 3.0  # how long the S3 server stays paused after the pause is asked


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_background_checkpoints_hold_the_same_state_as_synchronous_ones(ray_cluster, tiny_dataset,
                                                                        tmp_path, strategy):
    runs = {}
    for how, extra in [("sync", {}), ("async", {"async_save": True, "stage_dir": str(tmp_path / "stage")})]:
        spec = tiny_spec(tmp_path / how, tiny_dataset, train={"max_steps": 12},
                         parallel={"strategy": strategy},
                         checkpoint={"every_steps": 4, "keep_last": 3, **extra})
        result = run_job(spec)
        assert result.status == "finished" and result.committed_steps == 12
        runs[how] = result
    summaries = {how: read_summary(r.run_dir) for how, r in runs.items()}
    assert [c["step"] for c in summaries["async"]["checkpoints"]] == [4, 8, 12]
    background = summaries["async"]["checkpoints"][:2]
    # Measured and reported: the boundary's wait, and the snapshot each rank held meanwhile.
    assert all(c["snapshot_bytes_per_rank"] > 0 and c["stall_s"] >= 0 and
               c["durable_after_s"] >= c["write_s"] for c in background), background
    assert any("written in the background" in t["reason"] for t in summaries["async"]["transitions"])
    assert os.listdir(tmp_path / "stage") == []  # staged files are removed once uploaded
    # The same figures in MLflow's checkpoint records.
    record = mt.Tracker.lookup(mt.default_tracking_uri(str(tmp_path / "async" / "runs")),
                               runs["async"].mlflow_run_id)
    assert [c["step"] for c in record.checkpoint_records] == [4, 8, 12]
    assert all(c["snapshot_bytes_per_rank"] > 0 for c in record.checkpoint_records[:2])
    stores = {how: Checkpointer(open_store(os.path.join(r.run_dir, "checkpoints")), keep_last=None)
              for how, r in runs.items()}
    for step in (4, 8):
        states = {how: read_full_state(ckpt, next(i for i in ckpt.list_complete() if i.step == step))
                  for how, ckpt in stores.items()}
        assert states["sync"].keys() == states["async"].keys()
        for key, tensor in states["sync"].items():
            assert torch.equal(tensor, states["async"][key]), (step, key)
    assert_params_equal(final_params(runs["async"].newest_checkpoint),
                        final_params(runs["sync"].newest_checkpoint))


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dataset, tmp_path_factory):
    """The same job with synchronous checkpoints and no failure."""
    result = run_job(ft_spec(tmp_path_factory.mktemp("ref"), tiny_dataset, STEPS))
    return final_params(result.newest_checkpoint), result


def test_worker_killed_while_its_background_write_is_held(reference, tiny_dataset, tmp_path,
                                                          s3_server, s3_bucket, monkeypatch):
    """The S3 server is paused from the commit of step 5 on, so the checkpoint of step 5 cannot
    be written; training goes on meanwhile, and the writer (rank 0 of DDP) is killed at step 7
    before the server resumes. The save is abandoned: no manifest for step 5, ever; the run
    recovers in memory and ends with the reference's parameters."""
    uri = f"s3://{s3_bucket}/async"
    spec = ft_spec(tmp_path, tiny_dataset, STEPS,
                   checkpoint={"async_save": True, "uri": uri, "s3_endpoint_url": s3_server.endpoint_url})
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)  # for reading it back here
    store = open_store(uri)
    visible = []

    def hold_uploads(sup):
        os.killpg(s3_server.pid, signal.SIGSTOP)

    def kill_writer_then_resume(sup):
        pid = worker_pid(sup, 0)
        try:
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: not pid_alive(pid), 30.0)
        finally:
            os.killpg(s3_server.pid, signal.SIGCONT)
        visible.append([c.step for c in Checkpointer(store, keep_last=None).list_complete()])

    try:
        result, sup, seen = run_with_events(spec, {5: hold_uploads, 7: kill_writer_then_resume})
    finally:
        os.killpg(s3_server.pid, signal.SIGCONT)
    # Steps 6 and 7 were committed while the write of step 5 could not progress.
    assert visible == [[]]
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset, STEPS)
    assert [c["step"] for c in summary["checkpoints"]] == [10, 15, 16]
    abandoned = [t for t in summary["transitions"] if "step 5 abandoned" in t["reason"]]
    assert len(abandoned) == 1 and "newest checkpoint stays none" in abandoned[0]["reason"], abandoned
    ckpt = Checkpointer(store, keep_last=None)
    assert [c.step for c in ckpt.list_complete()] == [15, 16]
    assert all(not ckpt.problems(info) for info in ckpt.list_complete())
    assert not store.exists("step_00000005/manifest.json")


def test_a_pause_waits_until_the_background_save_is_durable(ray_cluster, tiny_dataset, tmp_path,
                                                             s3_server, s3_bucket, monkeypatch):
    """The job service's pause releases the workers only after a durable checkpoint: with the
    background write of step 5 held (the S3 server paused) when the pause is asked at step 6,
    the run ends only after the server resumes, with step 5 and the pause's step committed."""
    uri = f"s3://{s3_bucket}/pause"
    spec = ft_spec(tmp_path, tiny_dataset, STEPS,
                   checkpoint={"async_save": True, "uri": uri, "s3_endpoint_url": s3_server.endpoint_url})
    requests = RunRequests()
    resumed_at = []

    def resume_server():
        resumed_at.append(time.time())
        os.killpg(s3_server.pid, signal.SIGCONT)

    def pause_while_held(sup):
        requests.pause("make room", by="scheduler")
        threading.Timer(HOLD_S, resume_server).start()

    sup, _ = supervisor_with_events(spec, {5: lambda sup: os.killpg(s3_server.pid, signal.SIGSTOP),
                                           6: pause_while_held})
    sup.requests = requests
    try:
        result = sup.run()
    finally:
        os.killpg(s3_server.pid, signal.SIGCONT)
    assert result.status == "stopped", result
    step = result.committed_steps
    summary = read_summary(result.run_dir)
    assert [c["step"] for c in summary["checkpoints"]] == [5, step]
    assert summary["transitions"][-1]["state"] == "stopped"
    assert summary["transitions"][-1]["time"] >= resumed_at[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    assert [c.step for c in Checkpointer(open_store(uri), keep_last=None).list_complete()] == [5, step]


def test_a_failed_background_write_leaves_no_checkpoint_and_training_goes_on(ray_cluster, tiny_dataset,
                                                                             tmp_path):
    """Every write fails (checkpoint.stage_dir is a file, not a directory): each background save
    is abandoned with the one-line reason, the run still finishes, and nothing looks complete."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 8},
                     checkpoint={"every_steps": 3, "async_save": True, "save_on_exit": False,
                                 "stage_dir": str(blocker)})
    result = run_job(spec)
    assert result.status == "finished" and result.committed_steps == 8
    summary = read_summary(result.run_dir)
    assert summary["checkpoints"] == [] and result.newest_checkpoint == ""
    abandoned = [t["reason"] for t in summary["transitions"] if "abandoned" in t["reason"]]
    assert len(abandoned) == 2, abandoned
    assert all(f"checkpoint.stage_dir {blocker}" in r and "\n" not in r for r in abandoned), abandoned
    root = os.path.join(result.run_dir, "checkpoints")
    assert Checkpointer(open_store(root), keep_last=None).list_complete() == []
