"""Silent corruption: one flipped byte in a shard, same size, never becomes training data.

A shard is checked against the manifest's sha256 the first time a reader process opens it, and
Parquet pages carry checksums that every read verifies. A corrupt shard then behaves exactly as a
missing one: ``fail`` stops at the first batch that needs it, naming the shard and the step;
``skip`` drops its rows and records them. Every row the plane did deliver is compared with the
uncorrupted dataset, so a byte that decoded into other tokens would be seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain_sys.data import order
from raytrain_sys.data.order import Segment
from raytrain_sys.data.plane import SKIP_LOG_FILE, DataPlane
from raytrain_sys.data.prepare import prepare_digits_dataset, prepare_text_dataset
from raytrain_sys.data.shards import BadShardError, read_columns, read_manifest, read_token_pool
from raytrain_sys.errors import DataError

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

WINDOW, BLOCK, B = 64, 16, 8
BAD = 2  # a shard in the middle of the dataset


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("corrupt")
    tokens = str(root / "tokens")
    prepare_text_dataset(tokens, row_len=33, rows_per_shard=48, max_bytes=8_000)  # 5 shards
    digits = str(root / "digits")
    prepare_digits_dataset(digits, samples_per_shard=32, limit=180, val_fraction=0.0)  # 6 shards
    return {"parquet": tokens, "webdataset": digits}


def copy_of(datasets: dict[str, str], kind: str, tmp_path) -> str:
    out = str(tmp_path / kind)
    shutil.copytree(datasets[kind], out)
    return out


def parquet_offset(path: str, where: str) -> int:
    """A byte of a token Parquet shard: its first, one in the middle of a data page, the last
    byte of the data before the footer, one inside the footer's metadata, its last."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(size - 8)
        footer_len = int.from_bytes(f.read(4), "little")
    footer_start = size - 8 - footer_len
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    return {"start": 0,
            "data page": column.data_page_offset + column.total_compressed_size // 2,
            "end of data": footer_start - 1,
            "footer": footer_start + footer_len // 2,
            "last byte": size - 1}[where]


def flip(path: str, offset: int) -> None:
    """Invert one byte in place: same size, same name, other bytes."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def original_rows(dataset: str) -> dict[str, np.ndarray]:
    """Every sample's columns (sample id order) read from the intact dataset."""
    m = read_manifest(dataset)
    parts = [read_columns(dataset, m, Segment(k, 0, s.num_rows, m.row_offsets[k]))
             for k, s in enumerate(m.shards)]
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


def plane(dataset: str, end: int, **kw) -> DataPlane:
    return DataPlane(dataset, read_manifest(dataset), 0, WINDOW, BLOCK, B, end_position=end,
                     prefetch_steps=2, **kw)


def drain(p: DataPlane, stop: int, truth: dict[str, np.ndarray]) -> list[int]:
    """Sample ids of the batches up to ``stop``; asserts each delivered row is the intact one."""
    got = []
    for cursor in range(0, stop, B):
        batch, ids = p.global_batch(cursor)
        for column, values in batch.items():
            assert np.array_equal(values, truth[column][ids]), \
                f"corrupted samples delivered at data cursor {cursor}"
        got += ids.tolist()
    return got


@pytest.mark.parametrize("where", ["start", "data page", "end of data", "footer", "last byte"])
def test_a_flipped_byte_stops_the_run_naming_the_shard(ray_cluster, datasets, tmp_path, where):
    truth = original_rows(datasets["parquet"])
    dataset = copy_of(datasets, "parquet", tmp_path)
    m = read_manifest(dataset)
    path = os.path.join(dataset, m.shards[BAD].path)
    flip(path, parquet_offset(path, where))
    rows = tuple(s.num_rows for s in m.shards)
    ids = order.sample_ids(rows, 0, WINDOW, BLOCK, 0, m.num_rows)
    lo = m.row_offsets[BAD]
    first_bad = int(np.flatnonzero((ids >= lo) & (ids < lo + rows[BAD]))[0])
    p = plane(dataset, m.num_rows)
    try:
        with pytest.raises(DataError) as err:
            drain(p, m.num_rows // B * B, truth)
    finally:
        p.close()
    msg = str(err.value)
    assert "\n" not in msg and m.shards[BAD].path in msg and "corrupt" in msg
    assert "prepare-data" in msg and "data.on_bad_shard=skip" in msg
    # Caught when the shard is first opened: the first batch that needs it, as for a missing shard.
    assert f"data cursor {first_bad // B * B}, step {first_bad // B + 1}" in msg


@pytest.mark.parametrize("where", ["data page", "footer"])
def test_skip_drops_a_corrupt_shard_and_records_it(ray_cluster, datasets, tmp_path, where):
    truth = original_rows(datasets["parquet"])
    dataset = copy_of(datasets, "parquet", tmp_path)
    m = read_manifest(dataset)
    path = os.path.join(dataset, m.shards[BAD].path)
    flip(path, parquet_offset(path, where))
    rows = tuple(s.num_rows for s in m.shards)
    lo, hi = m.row_offsets[BAD], m.row_offsets[BAD] + rows[BAD]
    end = (m.num_rows - rows[BAD]) // B * B
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    p = plane(dataset, end, on_bad_shard="skip", run_dir=str(run_dir))
    try:
        got = drain(p, end, truth)
    finally:
        p.close()
    ref = order.sample_ids(rows, 0, WINDOW, BLOCK, 0, m.num_rows)
    assert got == [i for i in ref.tolist() if not lo <= i < hi][:end]
    records = [json.loads(x) for x in open(run_dir / SKIP_LOG_FILE)]
    assert len(records) == 1 and records[0]["shard"] == BAD and records[0]["path"] == m.shards[BAD].path
    assert records[0]["sample_ids"] == list(range(lo, hi)) and "corrupt" in records[0]["error"]


def test_a_flipped_byte_in_a_webdataset_sample_stops_the_run(ray_cluster, datasets, tmp_path):
    truth = original_rows(datasets["webdataset"])
    dataset = copy_of(datasets, "webdataset", tmp_path)
    m = read_manifest(dataset)
    path = os.path.join(dataset, m.shards[BAD].path)
    # Inside the pixel data of the shard's fourth sample (an .npy member): the tar headers and the
    # npy header stay valid, so only a checksum can tell.
    idx = np.fromfile(path + ".idx", dtype="<i8")
    flip(path, int(idx[3]) + 512 + 200)
    p = plane(dataset, m.num_rows)
    try:
        with pytest.raises(DataError, match=rf"{m.shards[BAD].path} .*corrupt.*step \d+"):
            drain(p, m.num_rows // B * B, truth)
    finally:
        p.close()


def test_verification_reads_a_shard_once_per_process_and_names_it(tmp_path):
    """The check itself, no Ray: right bytes pass, one flipped byte fails with a one-line message,
    and a shard verified once is not hashed again by the same process until it is forgotten."""
    from raytrain_sys.data import storage

    blob = bytes(range(256)) * 1000
    path = tmp_path / "shard-00000.bin"
    path.write_bytes(blob)
    sha = hashlib.sha256(blob).hexdigest()
    fs, root = storage.filesystem(str(tmp_path))
    dataset = str(tmp_path)
    assert storage.verify_once(fs, root, dataset, path.name, len(blob), sha) is True
    assert storage.verify_once(fs, root, dataset, path.name, len(blob), sha) is False  # cached
    flip(str(path), 1000)
    # The per-process cache is keyed by (dataset, shard, sha256): bytes changed after they were
    # verified are not hashed again (Parquet's page checksums still see them on read).
    assert storage.verify_once(fs, root, dataset, path.name, len(blob), sha) is False
    storage.forget(dataset, path.name)
    with pytest.raises(storage.ShardChecksumError) as err:
        storage.verify_once(fs, root, dataset, path.name, len(blob), sha)
    assert "\n" not in str(err.value) and "sha256" in str(err.value) and sha[:12] in str(err.value)
    with pytest.raises(storage.ShardChecksumError):  # a failure is not cached as a success
        storage.verify_once(fs, root, dataset, path.name, len(blob), sha)


def test_read_functions_raise_bad_shard_error_on_a_flip_without_ray(datasets, tmp_path):
    """The readers the data plane calls, in this process: a BadShardError with the shard's index,
    for a data page flip in a token shard, a pixel flip in a tar shard and a flip in its .idx."""
    dataset = copy_of(datasets, "parquet", tmp_path)
    m = read_manifest(dataset)
    path = os.path.join(dataset, m.shards[BAD].path)
    flip(path, parquet_offset(path, "data page"))
    seg = Segment(BAD, 0, m.shards[BAD].num_rows, m.row_offsets[BAD])
    with pytest.raises(BadShardError) as err:
        read_token_pool(dataset, m, [seg])
    assert err.value.shard == BAD and m.shards[BAD].path in str(err.value)
    assert "re-run prepare-data" in str(err.value) and "\n" not in str(err.value)

    for target in ("sample", "index"):
        dataset = copy_of(datasets, "webdataset", tmp_path / target)
        m = read_manifest(dataset)
        path = os.path.join(dataset, m.shards[BAD].path)
        idx = np.fromfile(path + ".idx", dtype="<i8")
        if target == "sample":
            flip(path, int(idx[3]) + 512 + 200)
        else:
            # Sample 3 then starts 1024 bytes off, at another member's header: a valid tar header,
            # in bounds and increasing, so only the index's agreement with the tar can tell.
            with open(path + ".idx", "r+b") as f:
                f.seek(3 * 8 + 1)
                b = f.read(1)[0]
                f.seek(3 * 8 + 1)
                f.write(bytes([b ^ 0x04]))
        seg = Segment(BAD, 0, m.shards[BAD].num_rows, m.row_offsets[BAD])
        with pytest.raises(BadShardError) as err:
            read_columns(dataset, m, seg)
        assert err.value.shard == BAD and m.shards[BAD].path in str(err.value), target
