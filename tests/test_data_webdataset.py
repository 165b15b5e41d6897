"""WebDataset shards: prepared from scikit-learn's digits, read by seeking, trained end to end."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch

from raytrain_sys.control.supervisor import run_job
from raytrain_sys.data import order
from raytrain_sys.train.compat import check_spec_against_manifest
from raytrain_sys.data.manifest import WEBDATASET_FORMAT
from raytrain_sys.data.order import Segment
from raytrain_sys.data.prepare import prepare_digits_dataset
from raytrain_sys.data.shards import BadShardError, read_columns, read_manifest
from raytrain_sys.data.webdataset import INDEX_SUFFIX, clear_caches
from raytrain_sys.errors import SpecError
from raytrain_sys.spec import load_spec
from tests.helpers import assert_params_close, final_params, read_summary, tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("wds") / "digits")
    prepare_digits_dataset(out)
    return out


@pytest.fixture(scope="module")
def digits_small(tmp_path_factory) -> str:
    """120 digits: 108 to train on (4 shards of 32, the last short), 12 held out."""
    out = str(tmp_path_factory.mktemp("wds") / "digits-small")
    prepare_digits_dataset(out, samples_per_shard=32, limit=120)
    return out


def cnn_spec(tmp_path, dataset: str, **sections):
    base = {"model": {"name": "cnn", "vocab_size": 10, "n_layer": 2, "n_embd": 8, "n_head": 1},
            "data": {"path": dataset, "shuffle_window": 64, "shuffle_block_rows": 16}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return tiny_spec(tmp_path, dataset, **base)


def test_prepare_writes_tar_shards_with_a_seek_index(digits):
    from sklearn.datasets import load_digits

    m = read_manifest(digits)
    val = read_manifest(os.path.join(digits, "val"))
    assert m.format == WEBDATASET_FORMAT and m.extra["fields"] == {"image": "npy", "label": "cls"}
    assert m.num_rows + val.num_rows == 1797 and len(m.shards) == 7
    ref = load_digits()
    seen_keys = []
    for shard in m.shards:
        path = os.path.join(digits, shard.path)
        blob = open(path, "rb").read()
        assert len(blob) == shard.num_bytes and hashlib.sha256(blob).hexdigest() == shard.sha256
        # A plain tar any tool reads: two members per sample, grouped by key.
        with tarfile.open(path) as tf:
            members = tf.getmembers()
            assert len(members) == 2 * shard.num_rows
            first = members[0]
            assert first.name.endswith(".npy") and members[1].name == first.name[:-3] + "cls"
            key = int(first.name.split(".")[0])
            image = np.load(io.BytesIO(tf.extractfile(first).read()))
            np.testing.assert_allclose(image[0] * 16, ref.images[key])
            assert int(tf.extractfile(members[1]).read()) == ref.target[key]
            seen_keys += [int(mb.name.split(".")[0]) for mb in members[::2]]
            header_offsets = [mb.offset for mb in members[::2]]
        idx = np.fromfile(path + INDEX_SUFFIX, dtype="<i8")
        assert idx[:-1].tolist() == header_offsets and len(idx) == shard.num_rows + 1
    assert len(set(seen_keys)) == m.num_rows  # every digit once, none of the val split
    # Deterministic: the same inputs give the same bytes.
    again = prepare_digits_dataset(digits, overwrite=True)
    assert again.content_hash == m.content_hash


def test_a_segment_read_seeks_to_its_bytes(digits, tmp_path):
    """Reading samples 200..230 of a shard never touches the bytes before them: zeroing the
    first samples of a copy (same size) leaves that read intact, and breaks a read from 0.
    That is the read itself, without the once-per-process sha256 of the whole shard, which sees
    the zeroed bytes whatever rows are asked for."""
    m = read_manifest(digits)
    whole = read_columns(digits, m, Segment(0, 0, 256, 0))
    assert whole["image"].shape == (256, 1, 8, 8) and whole["image"].dtype == np.float32
    assert whole["label"].dtype == np.int64 and set(whole["label"].tolist()) == set(range(10))
    copy = tmp_path / "copy"
    shutil.copytree(digits, copy)
    idx = np.fromfile(copy / (m.shards[0].path + INDEX_SUFFIX), dtype="<i8")
    with open(copy / m.shards[0].path, "r+b") as f:
        f.write(b"\0" * int(idx[100]))
    clear_caches()
    with pytest.raises(BadShardError, match="shard-00000.tar .* corrupt or truncated: .*sha256"):
        read_columns(str(copy), m, Segment(0, 200, 230, 200))
    tail = read_columns(str(copy), m, Segment(0, 200, 230, 200), verify_sha256=False)
    np.testing.assert_array_equal(tail["image"], whole["image"][200:230])
    np.testing.assert_array_equal(tail["label"], whole["label"][200:230])
    with pytest.raises(BadShardError, match="shard-00000.tar .* corrupt or truncated"):
        read_columns(str(copy), m, Segment(0, 0, 10, 0), verify_sha256=False)


def test_spec_must_fit_the_dataset(digits, tiny_dataset, tmp_path):
    wds = read_manifest(digits)
    check_spec_against_manifest(cnn_spec(tmp_path, digits), wds)
    with pytest.raises(SpecError, match="model.name.*labelled samples"):
        check_spec_against_manifest(tiny_spec(tmp_path, digits), wds)
    with pytest.raises(SpecError, match="model.vocab_size.*10 classes"):
        check_spec_against_manifest(cnn_spec(tmp_path, digits, model={"vocab_size": 5}), wds)
    with pytest.raises(SpecError, match="model.name.*token rows"):
        check_spec_against_manifest(cnn_spec(tmp_path, tiny_dataset), read_manifest(tiny_dataset))
    with pytest.raises(SpecError, match="model.block_size"):
        check_spec_against_manifest(tiny_spec(tmp_path, tiny_dataset, model={"block_size": 16}),
                                    read_manifest(tiny_dataset))


def _audit(run_dir: str) -> list[list[list[int]]]:
    with open(os.path.join(run_dir, "sample_ids.jsonl")) as f:
        return [json.loads(line)["ranks"] for line in f]


def test_cnn_trains_on_webdataset_world_1_equals_world_3(ray_cluster, digits_small, tmp_path):
    """Two epochs of 108 samples at global batch 8 (27 steps): 3 workers (shares 3/3/2) end with
    the parameters of 1 worker, and the audit log holds every sample once per epoch."""
    m = read_manifest(digits_small)
    sections = dict(train={"max_steps": 27, "precision": "fp64"},
                    data={"log_sample_ids": True}, optim={"warmup_steps": 2})
    one = run_job(cnn_spec(tmp_path / "one", digits_small, resources={"num_workers": 1}, **sections))
    three = run_job(cnn_spec(tmp_path / "three", digits_small, resources={"num_workers": 3}, **sections))
    assert one.status == three.status == "finished"
    assert_params_close(final_params(three.newest_checkpoint), final_params(one.newest_checkpoint),
                        rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(three.losses, one.losses, rtol=1e-5)
    assert three.losses[-1] < three.losses[0]

    steps = _audit(three.run_dir)
    assert [len(r) for r in steps[0]] == [3, 3, 2]
    stream = [i for ranks in steps for rank in ranks for i in rank]
    n = m.num_rows
    assert len(stream) == 2 * n
    assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n:]) == list(range(n))
    assert stream[:n] != stream[n:]  # a new shuffle each epoch
    rows = tuple(s.num_rows for s in m.shards)
    assert stream == order.sample_ids(rows, 0, 64, 16, 0, 2 * n).tolist()
    assert [i for ranks in _audit(one.run_dir) for r in ranks for i in r] == stream


def _accuracy(checkpoint: str, dataset: str) -> float:
    from raytrain_sys.checkpoint.export import load_model

    model, _, _ = load_model(checkpoint)
    m = read_manifest(dataset)
    cols = [read_columns(dataset, m, Segment(i, 0, s.num_rows, 0)) for i, s in enumerate(m.shards)]
    images = torch.tensor(np.concatenate([c["image"] for c in cols]))
    labels = np.concatenate([c["label"] for c in cols])
    with torch.no_grad():
        pred = model(images.to(next(model.parameters()).dtype)).argmax(1).numpy()
    return float((pred == labels).mean())


def test_digits_job_reaches_good_accuracy(ray_cluster, digits, tmp_path):
    """The shipped jobs/digits_cnn.yaml, shortened, classifies held-out digits well."""
    spec = load_spec(os.path.join(REPO, "jobs", "digits_cnn.yaml"), [
        f"output_dir={tmp_path / 'runs'}", f"data.path={digits}", "train.max_steps=150",
        "optim.warmup_steps=10", "checkpoint.every_steps=0", "tracking.experiment=tests",
        "resources.start_timeout_s=60"])
    result = run_job(spec)
    assert result.status == "finished"
    summary = read_summary(result.run_dir)
    assert "data_wait_fraction" in summary["throughput"]
    accuracy = _accuracy(result.newest_checkpoint, os.path.join(digits, "val"))
    assert accuracy >= 0.9, f"held-out accuracy {accuracy:.3f}"
