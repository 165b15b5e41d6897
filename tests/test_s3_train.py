"""Checkpoints on a real S3-compatible server (SeaweedFS on 127.0.0.1): save, list, resume."""

from __future__ import annotations

import time

import pytest

from raytrain_sys.checkpoint.checkpointer import Checkpointer
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.supervisor import run_job
from raytrain_sys.errors import StorageError
from tests.helpers import assert_params_equal, final_params, read_summary, tiny_spec


def test_checkpoints_on_s3_resume_like_an_uninterrupted_run(ray_cluster, tiny_dataset, tmp_path,
                                                            s3_server, s3_bucket):
    uri = f"s3://{s3_bucket}/runs/t"
    ckpt = {"uri": uri, "s3_endpoint_url": s3_server.endpoint_url, "every_steps": 4, "keep_last": 2}
    paused = run_job(tiny_spec(tmp_path / "a", tiny_dataset, train={"max_steps": 12, "stop_at_step": 8},
                               checkpoint=ckpt))
    assert paused.status == "stopped" and paused.newest_checkpoint == f"{uri}/step_00000008"
    store = open_store(uri, s3_server.endpoint_url)
    assert [c.step for c in Checkpointer(store, keep_last=2).list_complete()] == [4, 8]

    resumed = run_job(tiny_spec(tmp_path / "a", tiny_dataset, train={"max_steps": 12},
                                checkpoint={**ckpt, "resume_from": "latest"}))
    straight = run_job(tiny_spec(tmp_path / "b", tiny_dataset, train={"max_steps": 12}))
    assert resumed.losses[8:] == straight.losses[8:]
    assert_params_equal(final_params(resumed.newest_checkpoint, s3_server.endpoint_url),
                        final_params(straight.newest_checkpoint))
    assert [c.step for c in Checkpointer(store, keep_last=2).list_complete()] == [8, 12]


@pytest.mark.parametrize("problem", ["unreachable", "bad credentials"])
def test_bad_s3_fails_before_training_with_a_clear_error(ray_cluster, tiny_dataset, tmp_path,
                                                        s3_server, s3_bucket, monkeypatch, problem):
    endpoint = s3_server.endpoint_url
    if problem == "unreachable":
        endpoint = "http://127.0.0.1:9"  # discard port: nothing listens
    else:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    spec = tiny_spec(tmp_path, tiny_dataset,
                     checkpoint={"uri": f"s3://{s3_bucket}/x", "s3_endpoint_url": endpoint})
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        run_job(spec)
    assert time.monotonic() - t0 < 20
    message = str(err.value)
    assert "\n" not in message and f"s3://{s3_bucket}/x" in message or endpoint in message
    summary = read_summary(read_run_dir(tmp_path))
    assert summary["status"] == "failed" and summary["committed_steps"] == 0


def read_run_dir(tmp_path) -> str:
    import os
    runs = [d for d in os.listdir(tmp_path / "runs") if d.startswith("t-")]
    return str(tmp_path / "runs" / runs[0])
