"""Atomic checkpoints on both backends: visible only when complete, verified on load, pruned."""

from __future__ import annotations

import logging
import re
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain_sys.checkpoint.checkpointer import (
    CheckpointInfo,
    Checkpointer,
    load_checkpoint_dir,
    open_checkpoint,
)
from raytrain_sys.checkpoint.store import Store, open_store
from raytrain_sys.errors import CheckpointError
from tests.fixtures.s3_server import S3Server

META = {"data_cursor": 1280, "world_size": 2, "spec_hash": "abc", "git_commit": "deadbeef"}


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "run" / "checkpoints"))
    server: S3Server = request.getfixturevalue("s3_server")
    bucket: str = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/run/checkpoints", s3_endpoint_url=server.endpoint_url)


def fresh(store: Store, keep_last: int | None = 3) -> Checkpointer:
    """A Checkpointer in a new "process": reopened from the URI, sharing no state."""
    endpoint = getattr(store, "endpoint_url", "")
    return Checkpointer(open_store(store.uri, endpoint), keep_last=keep_last)


def model_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g),
            "b16": torch.randn(4, generator=g).to(torch.bfloat16),
            "counts": torch.arange(5, dtype=torch.int64),
            "mask": torch.tensor([True, False]),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(16, 8, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "params": [0]}],
        },
        "rng": torch.get_rng_state(),
        "note": "plain python survives",
    }


def save(ckpt: Checkpointer, step: int, seed: int = 0) -> CheckpointInfo:
    record = ckpt.write_state(step, "model.pt", model_state(seed))
    return ckpt.commit(step, [record], {**META, "data_cursor": step * 128})


def assert_bitwise_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        # Compare raw bytes: torch.equal would pass -0.0 == 0.0 and fail NaN == NaN.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def test_round_trip_is_bitwise_and_carries_meta(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    model = ckpt.write_state(10, "model.pt", model_state(1))
    optim = ckpt.write_state(10, "extra/rank0.pt", {"x": torch.ones(3)})
    info = ckpt.commit(10, [model, optim], META)
    assert info.uri == f"{store.uri}/step_00000010"
    assert model["bytes"] > 0 and len(model["sha256"]) == 64

    reader = fresh(store)
    latest = reader.latest()
    assert latest is not None and latest.step == 10 and latest.uri == info.uri
    assert latest.manifest["files"] == [model, optim]
    assert {k: latest.manifest[k] for k in META} == META
    assert latest.manifest["created_at"]
    assert_bitwise_equal(reader.load_state(latest, "model.pt"), model_state(1))
    assert torch.equal(reader.load_state(latest, "extra/rank0.pt")["x"], torch.ones(3))

    # The same checkpoint found by URI, the way `resume <uri>` and workers open it.
    endpoint = getattr(store, "endpoint_url", "")
    opened_ckpt, opened = open_checkpoint(info.uri, endpoint)
    assert opened.step == 10 and opened_ckpt.keep_last is None
    assert load_checkpoint_dir(info.uri, endpoint).manifest == latest.manifest
    assert reader.resolve(info.uri).step == reader.resolve("step_00000010").step == 10


def test_crash_between_data_and_manifest_leaves_previous_latest(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    save(ckpt, 10)
    # Step 20: the data files land, then the run dies before commit.
    ckpt.write_state(20, "model.pt", model_state(2))
    assert store.exists("step_00000020/model.pt")

    reader = fresh(store)
    assert [i.step for i in reader.list_complete()] == [10]
    latest = reader.latest()
    assert latest is not None and latest.step == 10
    with pytest.raises(CheckpointError, match="no manifest: incomplete checkpoint"):
        reader.resolve(f"{store.uri}/step_00000020")


def test_commit_of_missing_file_raises_before_manifest(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    save(ckpt, 10)
    written = ckpt.write_state(20, "model.pt", model_state(2))
    lost = {"name": "rank1.pt", "bytes": 100, "sha256": "0" * 64}  # its worker died
    with pytest.raises(CheckpointError, match="rank1.pt was never uploaded"):
        ckpt.commit(20, [written, lost], META)
    wrong_size = {**written, "bytes": written["bytes"] + 1}
    with pytest.raises(CheckpointError, match="model.pt has .* bytes"):
        ckpt.commit(20, [wrong_size], META)

    assert not store.exists("step_00000020/manifest.json")
    latest = fresh(store).latest()
    assert latest is not None and latest.step == 10

    # The next good commit makes the stale partial directory garbage and removes it.
    save(ckpt, 30)
    assert [i.step for i in fresh(store).list_complete()] == [10, 30]
    assert store.list("step_00000020") == []


def test_retention_keeps_exactly_k_and_never_the_newest(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=2)
    for step in (10, 20, 30, 40, 50):
        save(ckpt, step)
        assert fresh(store).latest().step == step  # type: ignore[union-attr]
    assert [i.step for i in fresh(store).list_complete()] == [40, 50]
    assert {key.split("/")[0] for key in store.list()} == {"step_00000040", "step_00000050"}

    # A partial checkpoint newer than the newest complete one may still be being written.
    ckpt.write_state(60, "model.pt", model_state(6))
    assert ckpt.apply_retention() == []
    assert store.exists("step_00000060/model.pt")

    only_newest = Checkpointer(store, keep_last=1)
    assert only_newest.apply_retention() == [40]
    assert [i.step for i in only_newest.list_complete()] == [50]
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(store, keep_last=0)


def test_half_deleted_checkpoint_is_invisible_and_cleaned(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=5)
    save(ckpt, 10)
    save(ckpt, 20)
    # Retention deletes the manifest first; simulate dying right after that.
    store.delete("step_00000010/manifest.json")
    assert [i.step for i in fresh(store).list_complete()] == [20]
    assert ckpt.apply_retention() == [10]
    assert store.list("step_00000010") == []


def test_corrupt_file_is_refused_naming_it(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    info = save(ckpt, 10)
    data = bytearray(store.get_bytes("step_00000010/model.pt"))
    data[len(data) // 2] ^= 0x01
    store.put_bytes("step_00000010/model.pt", bytes(data))
    with pytest.raises(
        CheckpointError, match=r"corrupt checkpoint file .*step_00000010/model\.pt: sha256 mismatch"
    ):
        fresh(store).load_state(info, "model.pt")


def test_corrupt_manifest_is_skipped_with_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    save(ckpt, 10)
    ckpt.write_state(20, "model.pt", model_state(2))
    store.put_bytes("step_00000020/manifest.json", b'{"step": 20, "files": [')
    with caplog.at_level(logging.WARNING):
        latest = fresh(store).latest()
    assert latest is not None and latest.step == 10
    assert "step_00000020" in caplog.text and "corrupt manifest.json" in caplog.text
    with pytest.raises(CheckpointError, match=r"corrupt manifest.json: the newest intact older checkpoint is "
                                              r".*step_00000010 \(step 10\): resume from it \(checkpoint.resume_from="):
        fresh(store).resolve("step_00000020")


def test_resolve_latest_with_nothing_committed(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        ckpt.resolve("latest")
    ckpt.write_state(10, "model.pt", model_state(0))  # partial only
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        fresh(store).resolve("latest")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        ckpt.resolve("s3://elsewhere/step_x")


class RunsCodeWhenUnpickled:
    """An object whose unpickling would create a marker file (i.e. run arbitrary code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_load_never_unpickles_arbitrary_objects(store: Store, tmp_path: Path) -> None:
    import hashlib
    import io

    marker = tmp_path / "code-was-run"
    ckpt = Checkpointer(store, keep_last=3)

    # The writer refuses it up front, before anything is uploaded...
    with pytest.raises(TypeError, match="weights_only"):
        ckpt.write_state(10, "model.pt", {"evil": RunsCodeWhenUnpickled(marker)})
    assert not store.exists("step_00000010/model.pt")

    # ...and a file planted directly in the store, with a matching manifest, is refused on load.
    buffer = io.BytesIO()
    torch.save({"evil": RunsCodeWhenUnpickled(marker)}, buffer)
    data = buffer.getvalue()
    store.put_bytes("step_00000010/model.pt", data)
    record = {"name": "model.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    info = ckpt.commit(10, [record], META)
    with pytest.raises(CheckpointError, match="refusing to load .*model.pt"):
        fresh(store).load_state(info, "model.pt")
    assert not marker.exists()


def test_committed_step_is_not_overwritten(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    save(ckpt, 10)
    with pytest.raises(CheckpointError, match="already committed"):
        ckpt.write_state(10, "model.pt", model_state(9))
    assert_bitwise_equal(ckpt.load_state(ckpt.resolve("latest"), "model.pt"), model_state(0))


def test_checkpointer_pickles_for_ray_workers(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=3)
    save(ckpt, 10)  # the S3 client now exists and must not travel
    worker_side: Checkpointer = pickle.loads(pickle.dumps(ckpt))
    record = worker_side.write_state(20, "model.pt", model_state(2))
    ckpt.commit(20, [record], META)
    assert [i.step for i in fresh(store).list_complete()] == [10, 20]


def test_problems_are_found_from_sizes_without_reading(store: Store) -> None:
    ckpt = Checkpointer(store, keep_last=5)
    save(ckpt, 10)
    save(ckpt, 20)
    save(ckpt, 30)
    store.put_bytes("step_00000030/model.pt", b"overwritten")  # another size
    store.delete("step_00000020/model.pt")
    infos = {i.step: i for i in fresh(store).list_complete()}
    assert fresh(store).problems(infos[10]) == []
    assert fresh(store).problems(infos[20]) == ["model.pt is missing"]
    [resized] = fresh(store).problems(infos[30])
    assert resized.startswith("model.pt has 11 bytes, its manifest says")
    assert fresh(store).newest_intact().step == 10
    assert fresh(store).newest_intact(before_step=10) is None


def test_the_refusal_of_non_tensor_objects_is_one_clean_line(store: Store, tmp_path: Path) -> None:
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save({"evil": RunsCodeWhenUnpickled(tmp_path / "marker")}, buffer)
    data = buffer.getvalue()
    store.put_bytes("step_00000010/model.pt", data)
    ckpt = Checkpointer(store, keep_last=3)
    info = ckpt.commit(10, [{"name": "model.pt", "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest()}], META)
    with pytest.raises(CheckpointError) as caught:
        ckpt.load_state(info, "model.pt")
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message, repr(message)
    assert "weights_only=False" not in message and "trust" not in message  # no advice to load it unsafely
    assert re.search(r"which could run code \(it names [\w.]+\)$", message), message
    assert not (tmp_path / "marker").exists()
