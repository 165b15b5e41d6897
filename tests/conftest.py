"""Shared test fixtures: one local Ray cluster per session, small datasets, real servers."""

from __future__ import annotations

import os
import tempfile

import pytest

pytest_plugins = [
    "tests.fixtures.s3_server",
    "tests.fixtures.mlflow_server",
    "tests.fixtures.ray_head",
]

# Ray Data progress bars and MLflow's emoji banners only clutter test logs.
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One in-process local Ray cluster for the session (4 logical CPUs on 2 cores).

    Its temp dir is short and under /tmp: Ray's unix socket paths must stay under 107 chars.
    It starts after the S3 server so that its workers inherit the S3 credentials, as workers on
    a real cluster get them from their nodes' environment.
    """
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rts-ray-", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=temp_dir,
             log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> str:
    """A small real corpus (a slice of the standard library), rows of 33 tokens."""
    from raytrain_sys.data.prepare import prepare_text_dataset

    out = str(tmp_path_factory.mktemp("data") / "stdlib-tiny")
    prepare_text_dataset(out, row_len=33, rows_per_shard=512, max_bytes=400_000)
    return out
