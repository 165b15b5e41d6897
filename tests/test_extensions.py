"""The extension points' bad input, named before any Ray resource is taken (the run fails in
pre-flight: no cluster is needed), and the task check a user runs before a long run."""

from __future__ import annotations

import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import raytrain_sys as rts
from raytrain_sys.errors import DataError, SpecError
from raytrain_sys.train.check import TaskCheckFailed, check_task
from raytrain_sys.train.tasks import Classify
from tests.helpers import tiny_spec

USER_CODE = '''
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def build(model):
    return nn.Sequential(nn.Linear(model.args["width"], 3))


def raises(model):
    raise RuntimeError("no weights for you")


def not_a_module(model):
    return {"weights": 1}


class BadUnits:
    """units count rows twice, row_units once."""

    def units(self, batch):
        return 2 * len(batch["y"])

    def row_units(self, batch):
        return np.ones(len(batch["y"]), dtype=np.int64)

    def loss_sum(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"].long(), reduction="sum")


def double_x(row):
    return {"x": row["x"] * 2, "y": row["y"]}
'''


pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)


@pytest.fixture()
def user_code(tmp_path, monkeypatch):
    (tmp_path / "usercode.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "usercode"


@pytest.fixture()
def table(tmp_path) -> str:
    """A dataset of the user's own Parquet files: x (4 floats), y (class), s (strings)."""
    rng = np.random.default_rng(0)
    d = tmp_path / "table"
    d.mkdir()
    for i in range(2):
        x = rng.random((64, 4), dtype=np.float32)
        pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                                 "y": (x.sum(1) > 2).astype(np.int64), "s": ["a"] * 64}),
                       d / f"part-{i}.parquet", row_group_size=16)
    rts.index_parquet(str(d))
    return str(d)


def run_spec(tmp_path, table, **sections):
    base = dict(model={"name": "mine", "factory": "usercode:build", "args": {"width": 4}},
                data={"path": table, "columns": ["x", "y"], "shuffle_block_rows": 16},
                train={"task": "raytrain_sys.train.tasks:Classify",
                       "task_args": {"input_key": "x", "label_key": "y"}},
                tracking={"enabled": False})
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return tiny_spec(tmp_path, table, **base)


def fails(spec, error=SpecError, match=""):
    with pytest.raises(error, match=match) as info:
        rts.run(spec)
    return str(info.value)


def test_a_factory_that_does_not_import(tmp_path, table, user_code):
    msg = fails(run_spec(tmp_path, table, model={"factory": "nosuchpkg.models:build"}), match="model.factory")
    assert "cannot import 'nosuchpkg.models'" in msg
    msg = fails(run_spec(tmp_path, table, model={"factory": "usercode:nosuch"}), match="model.factory")
    assert "has no 'nosuch'" in msg
    with pytest.raises(SpecError, match="model.factory.*import path"):
        run_spec(tmp_path, table, model={"factory": "not a path"})


def test_a_factory_that_raises_or_returns_no_module(tmp_path, table, user_code):
    assert "raised RuntimeError: no weights for you" in fails(
        run_spec(tmp_path, table, model={"factory": "usercode:raises"}), match="model.factory")
    assert "returned a dict, not a torch.nn.Module" in fails(
        run_spec(tmp_path, table, model={"factory": "usercode:not_a_module"}), match="model.factory")


def test_a_task_whose_units_disagree_with_the_batch(tmp_path, table, user_code):
    msg = fails(run_spec(tmp_path, table, train={"task": "usercode:BadUnits", "task_args": {}}),
                match="train.task")
    assert "units() gives 8 for 4 rows but its per-row units" in msg


def test_a_missing_column(tmp_path, table, user_code):
    assert "no column 'z'" in fails(run_spec(tmp_path, table, data={"columns": ["x", "z"]}),
                                    match="data.columns")
    # The task reads a column the rows do not have (data.columns left it out).
    msg = fails(run_spec(tmp_path, table, data={"columns": ["x"]}), match="train.task")
    assert "reads column 'y'" in msg
    # Strings cannot become tensors: named, with the way out.
    assert "holds str values" in fails(run_spec(tmp_path, table, data={"columns": []}), match="data.columns")


def test_tensor_parallel_for_a_model_without_a_plan(tmp_path, table, user_code):
    with pytest.raises(SpecError, match="parallel.tp.*has no tensor or pipeline plan"):
        run_spec(tmp_path, table, parallel={"tp": 2}, resources={"num_workers": 2})
    with pytest.raises(SpecError, match="train.task"):
        run_spec(tmp_path, table, train={"task": ""})
    with pytest.raises(SpecError, match="parallel.fsdp_wrap.*NoSuchBlock"):
        rts.run(run_spec(tmp_path, table, parallel={"fsdp_wrap": ["NoSuchBlock"]}))


def test_a_file_whose_schema_changed_is_named(tmp_path, table, user_code):
    from raytrain_sys.data.shards import read_columns, read_manifest
    from raytrain_sys.data.order import Segment

    pq.write_table(pa.table({"x": pa.array([1.0] * 64), "y": np.zeros(64, np.int64), "s": ["a"] * 64}),
                   f"{table}/part-1.parquet")
    manifest = read_manifest(table)
    with pytest.raises(DataError, match=r"file .*part-1.parquet changed schema since its manifest was "
                                        r"written \(x: fixed_size_list<\w+: float>\[4\] -> double\)"):
        read_columns(table, manifest, Segment(1, 0, 4, 64))


def test_transform_and_columns_reach_the_task(tmp_path, table, user_code):
    from raytrain_sys.data.reads import sample_rows
    from raytrain_sys.data.shards import read_manifest

    spec = run_spec(tmp_path, table, data={"transform": "usercode:double_x"})
    rows = sample_rows(spec, read_manifest(table), 4)
    plain = sample_rows(run_spec(tmp_path, table), read_manifest(table), 4)
    assert set(rows) == {"x", "y"} and rows["x"].shape == (4, 4)
    np.testing.assert_array_equal(rows["x"], plain["x"] * 2)


def test_a_callable_from_python_is_recorded_by_name(tmp_path, table, user_code):
    import usercode

    def local_factory(model):  # not importable: travels by value, recorded by its name
        return torch.nn.Linear(4, 3)

    from raytrain_sys.api import as_spec

    s = as_spec(run_spec(tmp_path, table).to_dict(), model_factory=usercode.build)
    assert s.model.factory == "usercode:build"  # importable: its path, so YAML and resume can name it
    s = as_spec(run_spec(tmp_path, table).to_dict(), model_factory=local_factory)
    assert s.model.factory is local_factory
    assert s.plain_dict()["model"]["factory"].startswith("python:tests.test_extensions.")
    assert s.training_hash() == as_spec(s.to_dict()).training_hash()


def test_check_task_finds_a_mean_and_passes_the_built_in_tasks():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    batch = {"image": np.random.default_rng(0).random((10, 4), dtype=np.float32),
             "label": np.arange(10) % 3}
    report = check_task(Classify("image", "label"), model, batch)
    assert set(report) == {"2 workers", "3 workers", "micro-batches of 1 rows"}

    class MeanLoss(Classify):
        def loss_sum(self, model, batch):  # a mean: the rows of a smaller share weigh more
            return super().loss_sum(model, batch) / len(batch["label"])

    with pytest.raises(TaskCheckFailed, match="2 workers: the gradient of"):
        check_task(MeanLoss("image", "label"), model, batch)

    class BatchNormed(Classify):
        def loss_sum(self, model, batch):  # batch statistics couple the rows
            x = batch["image"].to(torch.float64)
            x = (x - x.mean(0)) / (x.std(0) + 1e-6)
            return super().loss_sum(model, {**batch, "image": x})

    with pytest.raises(TaskCheckFailed):
        check_task(BatchNormed("image", "label"), model, batch)


def tiny_mlp(model):
    """A factory the workers can import (tests/ is on their path: the driver's directory)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_parquet_on_s3_indexed_in_place_and_trained(ray_cluster, s3_server, s3_bucket, table, tmp_path):
    client = s3_server.client()
    for name in ("part-0.parquet", "part-1.parquet"):
        client.upload_file(f"{table}/{name}", s3_bucket, f"mine/{name}")
    uri = f"s3://{s3_bucket}/mine"
    manifest = rts.index_parquet(uri, s3_server.endpoint_url)
    assert manifest.num_rows == 128 and manifest.extra["row_groups"] == [[16] * 4] * 2
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == ["mine/manifest.json", "mine/part-0.parquet", "mine/part-1.parquet"]  # nothing rewritten
    spec = tiny_spec(tmp_path, uri, model={"name": "mlp", "factory": "tests.test_extensions:tiny_mlp"},
                     data={"columns": ["x", "y"], "s3_endpoint_url": s3_server.endpoint_url,
                           "shuffle_block_rows": 16},
                     train={"task": "raytrain_sys.train.tasks:Classify", "max_steps": 4,
                            "task_args": {"input_key": "x", "label_key": "y"}},
                     tracking={"enabled": False})
    result = rts.run(spec)
    assert result.status == "finished" and result.committed_steps == 4


def test_a_callable_from_python_trains_and_resumes(ray_cluster, table, tmp_path):
    """A factory defined where the workers cannot import it (a notebook's, a closure) travels to
    them by value; its run is resumed by giving it again, and without it the error says so."""
    width = 8

    def build(model):
        return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))

    spec = tiny_spec(tmp_path, table, model={"name": "closure", "factory": "tests.test_extensions:tiny_mlp"},
                     data={"columns": ["x", "y"], "shuffle_block_rows": 16},
                     train={"task": "raytrain_sys.train.tasks:Classify", "max_steps": 6, "stop_at_step": 3,
                            "task_args": {"input_key": "x", "label_key": "y"}})
    paused = rts.run(spec, model_factory=build)
    assert paused.status == "stopped" and paused.committed_steps == 3
    uri = f"sqlite:///{tmp_path}/runs/mlflow.db"
    with pytest.raises(SpecError, match="model.factory.*was a Python object given from Python"):
        rts.resume(paused.mlflow_run_id, tracking_uri=uri)
    resumed = rts.resume(paused.mlflow_run_id, tracking_uri=uri, model_factory=build)
    assert resumed.status == "finished" and resumed.committed_steps == 6
    model, _, _ = rts.load_model(resumed.newest_checkpoint, model_factory=build)
    assert model[0].out_features == width
