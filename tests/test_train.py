"""End to end on a real local Ray cluster: what a user would notice about a training run."""

from __future__ import annotations

import json
import os

import mlflow
import numpy as np
import pytest

from raytrain_sys.checkpoint.checkpointer import Checkpointer
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.supervisor import FAULT_BEFORE_MANIFEST_ENV, resume_job, run_job
from raytrain_sys.data import order
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.tracking import mlflow_tracker as mt
from tests.helpers import (assert_params_close, assert_params_equal, final_params, read_summary,
                           tiny_spec)

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)


@pytest.fixture(scope="module")
def straight_run(ray_cluster, tiny_dataset, tmp_path_factory):
    """20 uninterrupted steps, checkpoint every 10: the reference for resume tests."""
    tmp = tmp_path_factory.mktemp("straight")
    spec = tiny_spec(tmp, tiny_dataset, train={"max_steps": 20, "log_every_steps": 5},
                     checkpoint={"every_steps": 10}, data={"log_sample_ids": True})
    result = run_job(spec)
    return spec, result


@pytest.fixture(scope="module")
def one_process(ray_cluster, tiny_dataset, tmp_path_factory):
    """The single-worker reference of each precision, run once for the module."""
    runs = {}

    def get(precision: str):
        if precision not in runs:
            runs[precision] = run_job(tiny_spec(tmp_path_factory.mktemp(f"one-{precision}"), tiny_dataset,
                                                train={"precision": precision},
                                                resources={"num_workers": 1}))
        return runs[precision]
    return get


@pytest.mark.parametrize("workers,precision", [(2, "fp64"), (3, "fp64"), (2, "fp32")])
def test_ddp_equals_one_process(one_process, tiny_dataset, tmp_path, workers, precision):
    """N workers (3 does not divide the global batch of 8) end where one process ends.

    In fp64 the only difference is the order of the gradient sums, so the parameters agree far
    inside rtol 1e-5. In fp32 that reordering noise (~1e-7 relative) is amplified by Adam, which
    divides by sqrt(v): parameters whose gradients nearly cancel move by up to ~1e-5 absolute
    after 8 steps at lr 1e-2 (measured: 5e-6 at 2 workers). A wrong share weighting or a lost
    micro-batch moves them by ~lr = 1e-2, which both tolerances catch.
    """
    train = {"precision": precision}
    one = one_process(precision)
    many = run_job(tiny_spec(tmp_path / "many", tiny_dataset, train=train,
                             resources={"num_workers": workers}))
    assert one.status == many.status == "finished"
    p1, pn = final_params(one.newest_checkpoint), final_params(many.newest_checkpoint)
    if precision == "fp64":
        assert_params_close(pn, p1, rtol=1e-5, atol=1e-9)
    else:
        assert_params_close(pn, p1, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(many.losses, one.losses, rtol=1e-5)
    assert read_summary(many.run_dir)["world_sizes"] == [workers] * 8
    # The test can fail: training moved the parameters away from their initial values.
    init = tiny_spec(tmp_path / "x", tiny_dataset)
    from raytrain_sys.extensions import build_model
    import torch
    torch.manual_seed(init.train.seed)
    p0 = build_model(init.model).state_dict()
    assert any(not torch.allclose(p0[k].double(), p1[k].double()) for k in p0)


def test_straight_run_records(straight_run, tiny_dataset):
    spec, result = straight_run
    s = read_summary(result.run_dir)
    assert s["status"] == "finished" and s["committed_steps"] == 20
    assert len(s["losses"]) == 20 and s["losses"][-1] < s["losses"][0]
    assert s["samples_consumed"] == 20 * 8 and s["world_sizes"] == [2] * 20
    assert s["newest_checkpoint"].endswith("step_00000020") and s["mlflow_run_id"]
    # The audit log: every rank's rows, in the plan's order, each sample once.
    import json
    with open(os.path.join(result.run_dir, "sample_ids.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    seen = [i for line in lines for rank in line["ranks"] for i in rank]
    m = read_manifest(tiny_dataset)
    expected = order.sample_ids(tuple(sh.num_rows for sh in m.shards), spec.data.seed,
                                spec.data.shuffle_window, spec.data.shuffle_block_rows, 0, 160)
    assert seen == expected.tolist() and len(set(seen)) == 160


@pytest.mark.parametrize("steps_per_call,run_ahead_steps", [(1, 18), (4, 12)],
                         ids=["one step a call: all sent ahead but step 1 and step 11",
                              "leases of 4, cut at the checkpoint: all but the leases at steps 1 and 11"])
def test_run_ahead_changes_nothing_but_time(straight_run, tiny_dataset, tmp_path, steps_per_call,
                                            run_ahead_steps):
    """Step k+1 sent while step k runs (train.run_ahead, the default), or several steps sent in
    one call (train.steps_per_call; the default sizes leases by step time, as the straight run's),
    gives bitwise the run of one step at a time; the boundary before a checkpoint is never
    crossed by a lease and never sent ahead."""
    _, auto = straight_run
    sized = {"max_steps": 20, "log_every_steps": 5, "steps_per_call": steps_per_call}
    ahead = run_job(tiny_spec(tmp_path / "ahead", tiny_dataset, train=sized, checkpoint={"every_steps": 10}))
    one_by_one = run_job(tiny_spec(tmp_path / "one", tiny_dataset, train={**sized, "steps_per_call": 1,
                                                                           "run_ahead": False},
                                   checkpoint={"every_steps": 10}))
    assert read_summary(ahead.run_dir)["steps_run_ahead"] == run_ahead_steps
    assert read_summary(one_by_one.run_dir)["steps_run_ahead"] == 0
    assert read_summary(ahead.run_dir)["leases"] == {1: 20, 4: 6}[steps_per_call]
    assert read_summary(auto.run_dir)["leases"] < 20  # short steps: the default shares calls
    for run in (ahead, auto):
        assert one_by_one.losses == run.losses
        assert_params_equal(final_params(one_by_one.newest_checkpoint), final_params(run.newest_checkpoint))


def test_resume_equals_uninterrupted(straight_run, tiny_dataset, tmp_path):
    spec, straight = straight_run
    paused_spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 20, "stop_at_step": 10,
                                                           "log_every_steps": 5},
                            checkpoint={"every_steps": 10},
                            resources={"peak_tflops_per_worker": 0.05})  # for the MFU metric
    paused = run_job(paused_spec)
    assert paused.status == "stopped" and paused.committed_steps == 10
    resumed = resume_job(paused.mlflow_run_id, tracking_uri=mt.default_tracking_uri(paused_spec.output_dir))
    assert resumed.status == "finished" and resumed.committed_steps == 20
    assert resumed.mlflow_run_id == paused.mlflow_run_id and resumed.run_dir == paused.run_dir
    # Same losses at steps 11..20 and bitwise the same parameters: the order, the optimizer state
    # and the schedule are all restored exactly, and gloo's all-reduce is deterministic.
    assert resumed.losses[10:] == straight.losses[10:]
    assert read_summary(resumed.run_dir)["losses"] == straight.losses
    assert_params_equal(final_params(resumed.newest_checkpoint), final_params(straight.newest_checkpoint))

    # MLflow: one run, continued; params, metrics, git tag and checkpoint records are there.
    mlflow.set_tracking_uri(mt.default_tracking_uri(paused_spec.output_dir))
    runs = mlflow.search_runs(experiment_names=["tests"])
    assert list(runs["run_id"]) == [paused.mlflow_run_id]
    row = runs.iloc[0]
    assert row["params.train.global_batch_size"] == "8"
    assert row["tags.raytrain.git_commit"]
    assert row["status"] == "FINISHED"
    history = mlflow.MlflowClient().get_metric_history(paused.mlflow_run_id, "loss")
    assert sorted({m.step for m in history}) == list(range(1, 21))
    # MFU = tokens/s x FLOPs per token / (world x peak), step by step.
    client = mlflow.MlflowClient()
    tokens = {m.step: m.value for m in client.get_metric_history(paused.mlflow_run_id, "tokens_per_s")}
    mfu = {m.step: m.value for m in client.get_metric_history(paused.mlflow_run_id, "mfu")}
    from raytrain_sys.models import model_flops_per_token
    per_token = model_flops_per_token(paused_spec.model)
    assert sorted(mfu) == list(range(1, 21))
    assert all(abs(mfu[k] - tokens[k] * per_token / (2 * 0.05e12)) < 1e-9 for k in mfu)
    record = mt.Tracker.lookup(mt.default_tracking_uri(paused_spec.output_dir), paused.mlflow_run_id)
    assert [c["step"] for c in record.checkpoint_records] == [10, 20]


def test_half_written_checkpoint_stays_invisible(ray_cluster, tiny_dataset, tmp_path, monkeypatch):
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 20},
                     checkpoint={"every_steps": 10, "save_on_exit": True})
    monkeypatch.setenv(FAULT_BEFORE_MANIFEST_ENV, "20")
    with pytest.raises(RuntimeError, match="injected fault"):
        run_job(spec)
    root = os.path.join(read_summary_dir(tmp_path), "checkpoints")
    assert os.path.exists(os.path.join(root, "step_00000020", "pieces_rank00000.pt"))
    assert not os.path.exists(os.path.join(root, "step_00000020", "manifest.json"))
    latest = Checkpointer(open_store(root), keep_last=3).latest()
    assert latest.step == 10
    # Resuming from "latest" picks step 10 and finishes the run.
    monkeypatch.delenv(FAULT_BEFORE_MANIFEST_ENV)
    resumed = run_job(tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 20},
                                checkpoint={"every_steps": 10, "uri": root, "resume_from": "latest"}))
    assert resumed.committed_steps == 20 and read_summary(resumed.run_dir)["resumed_from"][0].endswith("step_00000010")


def read_summary_dir(tmp_path) -> str:
    runs = [d for d in os.listdir(tmp_path / "runs") if d not in ("latest", "mlflow.db", "mlartifacts")]
    assert len(runs) == 1
    return str(tmp_path / "runs" / runs[0])


def test_retention_keeps_exactly_k(ray_cluster, tiny_dataset, tmp_path):
    result = run_job(tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 12},
                               checkpoint={"every_steps": 2, "keep_last": 2}))
    ckpt = Checkpointer(open_store(os.path.join(result.run_dir, "checkpoints")), keep_last=2)
    assert [c.step for c in ckpt.list_complete()] == [10, 12]
    assert sorted(os.listdir(os.path.join(result.run_dir, "checkpoints"))) == ["step_00000010", "step_00000012"]


def test_a_damaged_newest_checkpoint_is_found_before_start(ray_cluster, tiny_dataset, tmp_path):
    """Its weights file overwritten (a new user's accident): resume refuses before any worker
    starts, naming the newest intact older checkpoint; with checkpoint.on_corrupt=previous it
    resumes from that one, says so in summary.json and MLflow, and finishes."""
    from raytrain_sys.errors import CheckpointError

    root = str(tmp_path / "ckpts")
    first = run_job(tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 10},
                              checkpoint={"every_steps": 5, "uri": root}))
    assert first.committed_steps == 10
    newest = Checkpointer(open_store(root), keep_last=3).latest()
    assert newest.step == 10
    weights = os.path.join(root, "step_00000010", newest.manifest["files"][0]["name"])
    with open(weights, "wb") as f:
        f.write(b"not a checkpoint")

    resume = {"every_steps": 5, "uri": root, "resume_from": "latest"}
    with pytest.raises(CheckpointError) as refused:
        run_job(tiny_spec(tmp_path / "again", tiny_dataset, train={"max_steps": 15}, checkpoint=resume))
    message = str(refused.value)
    assert "step_00000010 is damaged" in message and "has 16 bytes" in message, message
    assert f"the newest intact older checkpoint is {os.path.join(root, 'step_00000005')} (step 5)" in message
    assert "checkpoint.on_corrupt=previous" in message
    refused_run = read_summary(str(tmp_path / "again" / "runs" / "latest"))
    assert refused_run["committed_steps"] == 0 and refused_run["world_sizes"] == []  # no worker ever started

    resumed = run_job(tiny_spec(tmp_path / "fallback", tiny_dataset, train={"max_steps": 15},
                                checkpoint=resume | {"on_corrupt": "previous"}))
    assert resumed.committed_steps == 15
    summary = read_summary(resumed.run_dir)
    assert summary["resumed_from"][0].endswith("step_00000005")
    [note] = [t["reason"] for t in summary["transitions"] if " is damaged (" in t["reason"]]
    assert note.endswith(f"resuming from the newest intact older one, {os.path.join(root, 'step_00000005')} "
                         f"(checkpoint.on_corrupt=previous); set aside: step_00000010")
    # The damaged one was set aside (kept, invisible), and step 10 written again by the resumed run.
    steps = [c.step for c in Checkpointer(open_store(root), keep_last=None).list_complete()]
    assert steps[-1] == 15 and 10 in steps
    client = mlflow.MlflowClient(summary["tracking_uri"])
    logged = client.download_artifacts(summary["mlflow_run_id"], mt.EVENTS_ARTIFACT, str(tmp_path / "dl"))
    with open(logged) as f:
        assert note in [e["reason"] for e in json.load(f)]  # the choice, as an MLflow event


def test_a_newest_checkpoint_corrupt_inside_is_refused_naming_the_older_one_and_the_field(
        ray_cluster, tiny_dataset, tmp_path):
    """One byte of its weights flipped (the size unchanged, so only loading finds it): resume
    refuses naming the newest intact older checkpoint (path and step) and the exact field to
    resume from it, checkpoint.on_corrupt: previous; with that set, it resumes from step 5,
    sets the corrupt one aside, says so, and finishes."""
    from raytrain_sys.errors import CheckpointError

    root = str(tmp_path / "ckpts")
    first = run_job(tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 10},
                              checkpoint={"every_steps": 5, "uri": root}))
    assert first.committed_steps == 10
    newest = Checkpointer(open_store(root), keep_last=3).latest()
    weights = os.path.join(root, "step_00000010", newest.manifest["files"][0]["name"])
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    resume = {"every_steps": 5, "uri": root, "resume_from": "latest"}
    with pytest.raises(CheckpointError) as refused:
        run_job(tiny_spec(tmp_path / "again", tiny_dataset, train={"max_steps": 15}, checkpoint=resume))
    message = str(refused.value)
    assert "\n" not in message and "sha256 mismatch" in message and "step_00000010" in message, message
    assert f"the newest intact older checkpoint is {os.path.join(root, 'step_00000005')} (step 5)" in message
    assert "checkpoint.on_corrupt: previous" in message and "--set checkpoint.on_corrupt=previous" in message

    resumed = run_job(tiny_spec(tmp_path / "fallback", tiny_dataset, train={"max_steps": 15},
                                checkpoint=resume | {"on_corrupt": "previous"}))
    assert resumed.committed_steps == 15
    summary = read_summary(resumed.run_dir)
    assert summary["resumed_from"][-1].endswith("step_00000005"), summary["resumed_from"]
    [note] = [t["reason"] for t in summary["transitions"] if "sha256 mismatch" in t["reason"]]
    assert note.endswith(f"resuming from the newest intact older one, {os.path.join(root, 'step_00000005')} "
                         f"(checkpoint.on_corrupt=previous); set aside: step_00000010")
    steps = [c.step for c in Checkpointer(open_store(root), keep_last=None).list_complete()]
    assert steps[-1] == 15 and 10 in steps  # step 10 written again by the resumed run
