"""Evaluation during training, on the session's multi-node cluster: the metrics are the same at
any world size and after a kill and a resize, they reach MLflow at the configured steps, and
they pick the kept checkpoint (checkpoint.keep_best) and end the run (train.early_stop)."""

from __future__ import annotations

import math
import os

import mlflow
import pytest

from raytrain_sys.checkpoint.checkpointer import Checkpointer
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.supervisor import run_job
from raytrain_sys.errors import SpecError
from tests.ft_common import ft_spec, kill_soon, run_with_events, worker_pid
from tests.helpers import read_summary, tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS, EVERY = 9, 3


@pytest.fixture(scope="module")
def dataset_with_val(tmp_path_factory) -> str:
    from raytrain_sys.data.prepare import prepare_text_dataset

    out = str(tmp_path_factory.mktemp("data") / "stdlib-val")
    prepare_text_dataset(out, row_len=33, rows_per_shard=512, max_bytes=400_000, val_fraction=0.05)
    return out


def eval_spec(tmp_path, dataset, workers: int, **sections):
    base = dict(eval={"every_steps": EVERY, "max_rows": 44, "batch_rows": 8},
                resources={"num_workers": workers},
                elastic={"min_workers": 1, "max_workers": 3})
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return ft_spec(tmp_path, dataset, STEPS, **base)


@pytest.fixture(scope="module")
def reference(ray_cluster, dataset_with_val, tmp_path_factory):
    """One worker, uninterrupted: the evaluations every other run must match."""
    tmp = tmp_path_factory.mktemp("ref")
    result = run_job(eval_spec(tmp, dataset_with_val, 1))
    assert result.status == "finished"
    return read_summary(result.run_dir)["evals"]


def assert_same_evals(got: list[dict], want: list[dict]) -> None:
    assert [e["step"] for e in got] == [e["step"] for e in want] == [3, 6, 9]
    for a, b in zip(got, want):
        for metric in ("loss", "perplexity"):
            assert math.isclose(a[metric], b[metric], rel_tol=1e-9), (a, b)


@pytest.mark.parametrize("workers", [2, 3])
def test_eval_metrics_identical_at_any_world_size(ray_cluster, dataset_with_val, reference, tmp_path, workers):
    result = run_job(eval_spec(tmp_path, dataset_with_val, workers))
    assert result.status == "finished"
    assert_same_evals(read_summary(result.run_dir)["evals"], reference)
    # Every evaluation is in MLflow, at the step it ran.
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/runs/mlflow.db")
    history = mlflow.MlflowClient().get_metric_history(result.mlflow_run_id, "eval_loss")
    assert [(m.step, m.value) for m in history] == [(e["step"], e["loss"]) for e in reference] or \
        all(math.isclose(m.value, e["loss"], rel_tol=1e-9) and m.step == e["step"]
            for m, e in zip(history, reference))
    assert len(history) == 3


def test_eval_after_a_kill_and_a_resize_equals_the_uninterrupted_run(ray_cluster, dataset_with_val,
                                                                     reference, tmp_path):
    spec = eval_spec(tmp_path, dataset_with_val, 2)
    # A kill in the step after the first evaluation's boundary, then a shrink to one worker
    # and a growth back to three: every evaluation sees another world than the reference's.
    result, sup, _ = run_with_events(spec, {
        3: lambda s: kill_soon(worker_pid(s, 1)),
        5: lambda s: s.requests.resize(1, "test shrink"),
        7: lambda s: s.requests.resize(3, "test grow"),
    })
    summary = read_summary(result.run_dir)
    assert result.status == "finished" and summary["failures"] >= 1
    assert len(set(w for w in summary["world_sizes"] if w)) >= 2
    assert_same_evals(summary["evals"], reference)


def test_eval_continues_after_a_pause_and_rts_resume(ray_cluster, dataset_with_val, reference, tmp_path):
    import raytrain_sys as rts

    paused = rts.run(eval_spec(tmp_path, dataset_with_val, 2, train={"stop_at_step": 5}))
    assert paused.status == "stopped" and [e["step"] for e in read_summary(paused.run_dir)["evals"]] == [3]
    resumed = rts.resume(paused.mlflow_run_id, tracking_uri=f"sqlite:///{tmp_path}/runs/mlflow.db")
    assert resumed.status == "finished" and resumed.mlflow_run_id == paused.mlflow_run_id
    assert_same_evals(read_summary(resumed.run_dir)["evals"], reference)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/runs/mlflow.db")
    history = mlflow.MlflowClient().get_metric_history(resumed.mlflow_run_id, "eval_loss")
    assert sorted(m.step for m in history) == [3, 6, 9]


def test_keep_best_and_early_stop(ray_cluster, dataset_with_val, tmp_path):
    # A learning rate this high makes the evaluation loss rise after its first dip: the best
    # checkpoint is an early one, retention (keep_last 1) must not delete it, and the run stops
    # once `patience` evaluations did not beat it.
    spec = tiny_spec(tmp_path, dataset_with_val,
                     train={"max_steps": 40, "precision": "fp64"},
                     optim={"lr": 0.3, "warmup_steps": 1, "grad_clip": 0.0},
                     eval={"every_steps": 2, "max_rows": 24, "batch_rows": 8},
                     checkpoint={"keep_best": True, "keep_last": 1, "every_steps": 0},
                     resources={"num_workers": 2})
    spec.train.early_stop.patience = 2
    result = run_job(spec)
    summary = read_summary(result.run_dir)
    losses = [e["loss"] for e in summary["evals"]]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert result.status == "finished" and "early stop" in result.reason
    assert result.committed_steps < 40, losses
    # Stopped exactly `patience` evaluations after the best one.
    assert len(losses) == best + 1 + 2, losses
    assert summary["best_checkpoint"]["step"] == summary["evals"][best]["step"]
    kept = [c.step for c in Checkpointer(open_store(os.path.join(result.run_dir, "checkpoints")), 1).list_complete()]
    assert summary["best_checkpoint"]["step"] in kept and result.committed_steps in kept


def test_eval_needs_a_dataset_and_fields_that_fit(tmp_path, tiny_dataset):
    with pytest.raises(SpecError, match="checkpoint.keep_best"):
        tiny_spec(tmp_path, tiny_dataset, checkpoint={"keep_best": True})
    with pytest.raises(SpecError, match="train.early_stop.patience"):
        tiny_spec(tmp_path, tiny_dataset, train={"early_stop": {"patience": 2}})
    # The prepared val split is missing: named before any resource is taken.
    with pytest.raises(SpecError, match="eval.dataset"):
        run_job(tiny_spec(tmp_path, tiny_dataset, eval={"every_steps": 2}, tracking={"enabled": False}))
