"""Bad data: a missing, truncated or corrupt shard names the shard and the cursor; the skip policy
drops its samples from the stream deterministically and records them, never silently."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from raytrain_sys.control.supervisor import run_job
from raytrain_sys.data import order
from raytrain_sys.data.plane import SKIP_LOG_FILE, DataPlane
from raytrain_sys.data.prepare import prepare_digits_dataset, prepare_text_dataset
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.errors import DataError
from tests.helpers import read_summary, tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

WINDOW, BLOCK, B = 64, 16, 8


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad")
    tokens = str(root / "tokens")
    prepare_text_dataset(tokens, row_len=33, rows_per_shard=48, max_bytes=8_000)  # 5 shards
    digits = str(root / "digits")
    prepare_digits_dataset(digits, samples_per_shard=32, limit=180, val_fraction=0.0)  # 6 shards
    return {"parquet": tokens, "webdataset": digits}


@pytest.fixture(params=["parquet", "webdataset"])
def dataset(request, datasets, tmp_path) -> str:
    """A private copy to damage."""
    copy = str(tmp_path / request.param)
    shutil.copytree(datasets[request.param], copy)
    return copy


def damage(dataset: str, shard: int, how: str) -> str:
    m = read_manifest(dataset)
    path = os.path.join(dataset, m.shards[shard].path)
    if how == "missing":
        os.remove(path)
    elif how == "truncated":
        os.truncate(path, m.shards[shard].num_bytes // 2)
    elif how == "corrupt":  # same size, garbage in the middle: only a read of those bytes sees it
        with open(path, "r+b") as f:
            f.seek(m.shards[shard].num_bytes // 4)
            f.write(np.random.default_rng(0).integers(0, 256, m.shards[shard].num_bytes // 2,
                                                      dtype=np.uint8).tobytes())
    return m.shards[shard].path


def plane(dataset: str, end: int, **kw) -> DataPlane:
    return DataPlane(dataset, read_manifest(dataset), 0, WINDOW, BLOCK, B, end_position=end,
                     prefetch_steps=2, **kw)


def stream(p: DataPlane, start: int, stop: int) -> list[int]:
    return [i for c in range(start, stop, B) for i in p.global_batch(c)[1].tolist()]


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupt"])
def test_bad_shard_error_names_the_shard_and_the_cursor(ray_cluster, dataset, how):
    m = read_manifest(dataset)
    bad = 2
    name = damage(dataset, bad, how)
    rows = tuple(s.num_rows for s in m.shards)
    ids = order.sample_ids(rows, 0, WINDOW, BLOCK, 0, m.num_rows)
    lo = m.row_offsets[bad]
    first_bad = int(np.flatnonzero((ids >= lo) & (ids < lo + rows[bad]))[0])
    p = plane(dataset, m.num_rows)
    with pytest.raises(DataError) as err:
        for cursor in range(0, m.num_rows, B):
            p.global_batch(cursor)
    msg = str(err.value)
    cursor = int(msg.split("data cursor ")[1].split(",")[0])
    assert name in msg and ("missing" if how == "missing" else "corrupt or truncated") in msg
    assert f"step {cursor // B + 1}" in msg and "data.on_bad_shard=skip" in msg
    # A failed read surfaces in stream order, not when a prefetching task hit it: a shard bad as
    # a whole fails exactly the first batch that needs it; a corrupt region, a later one.
    if how == "corrupt":
        assert cursor >= first_bad // B * B
    else:
        assert cursor == first_bad // B * B
    p.close()


# Shard 1 is in the first window the plane reads; in the token fixture shard 4 is first needed by
# the second window of a chunk (windows 1-2), so that chunk stops before it and a new stream
# reads on from there.
@pytest.mark.parametrize("bad", [1, 4])
def test_skip_drops_a_missing_shard_deterministically_and_records_it(ray_cluster, dataset, tmp_path,
                                                                     bad):
    m = read_manifest(dataset)
    rows = tuple(s.num_rows for s in m.shards)
    damage(dataset, bad, "missing")
    lo, hi = m.row_offsets[bad], m.row_offsets[bad] + rows[bad]
    kept = m.num_rows - rows[bad]
    end = 2 * kept // B * B
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    skips = []
    p = plane(dataset, end, on_bad_shard="skip", run_dir=str(run_dir), on_skip=skips.append)
    got = stream(p, 0, end)
    p.close()
    # Missing from the start: the stream is the plan's stream without the shard, in both epochs.
    ref = order.sample_ids(rows, 0, WINDOW, BLOCK, 0, 2 * m.num_rows)
    expected = [i for i in ref.tolist() if not lo <= i < hi][:end]
    assert got == expected
    assert sorted(got[:kept]) == sorted(set(range(m.num_rows)) - set(range(lo, hi)))
    # Recorded, not silent: the run dir's ledger and the callback (the supervisor's summary).
    records = [json.loads(x) for x in open(run_dir / SKIP_LOG_FILE)]
    assert len(records) == 1 and records[0]["shard"] == bad
    assert records[0]["sample_ids"] == list(range(lo, hi)) and records[0]["sample_id_range"] == [lo, hi]
    assert len(skips) == 1 and m.shards[bad].path in skips[0]
    # A restarted plane (same run dir: it reloads the ledger) serves the same stream from any cursor.
    again = plane(dataset, end, on_bad_shard="skip", run_dir=str(run_dir))
    resume_at = (kept // 2) // B * B
    assert stream(again, resume_at, end) == got[resume_at:]
    again.close()


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_skip_of_a_shard_that_breaks_mid_epoch_keeps_exactly_once(ray_cluster, dataset, tmp_path, how):
    """A run read part of the shard, then restarts (same run dir) after the shard broke, mid
    window: rows consumed before keep their positions, the rest of the epoch is every other id
    once, and the ids that never came are exactly the recorded ones."""
    m = read_manifest(dataset)
    rows = tuple(s.num_rows for s in m.shards)
    bad = 3
    lo, hi = m.row_offsets[bad], m.row_offsets[bad] + rows[bad]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    p = plane(dataset, 2 * m.num_rows, on_bad_shard="skip", run_dir=str(run_dir))
    resume_at = WINDOW + 3 * B  # mid window
    first = stream(p, 0, resume_at)
    p.close()
    assert set(first) & set(range(lo, hi))  # the shard was read before it broke
    damage(dataset, bad, how)
    end = (2 * m.num_rows - 2 * rows[bad]) // B * B
    p = plane(dataset, 2 * m.num_rows, on_bad_shard="skip", run_dir=str(run_dir))
    rest = stream(p, resume_at, end)
    p.close()
    records = [json.loads(x) for x in open(run_dir / SKIP_LOG_FILE)]
    # Detected when a reader next opens the shard (a reader that still holds it open may read on).
    assert len(records) == 1 and records[0]["from_position"] >= resume_at
    assert set(records[0]["sample_ids"]) <= set(range(lo, hi))
    assert_exactly_once_with_skips(first + rest, m.num_rows, records)


def assert_exactly_once_with_skips(got: list[int], num_rows: int, records: list[dict]) -> None:
    """Epoch by epoch: every id once, except the ids the ledger says were skipped in it."""
    pos, epoch = 0, 0
    while pos < len(got):
        expected = set(range(num_rows))
        for r in records:
            if epoch == r["epoch"]:
                expected -= set(r["sample_ids"])
            elif epoch > r["epoch"]:
                expected -= set(range(*r["sample_id_range"]))
        part = got[pos:pos + len(expected)]
        assert len(set(part)) == len(part) and set(part) <= expected, f"epoch {epoch}"
        if len(part) == len(expected):
            assert set(part) == expected
        pos += len(part)
        epoch += 1


def test_run_fails_with_shard_and_step(ray_cluster, datasets, tmp_path):
    dataset = str(tmp_path / "tokens")
    shutil.copytree(datasets["parquet"], dataset)
    name = damage(dataset, 0, "missing")
    spec = tiny_spec(tmp_path, dataset, data={"shuffle_window": WINDOW, "shuffle_block_rows": BLOCK},
                     resources={"num_workers": 1})
    with pytest.raises(DataError, match=rf"{name}.*missing.*data cursor \d+, step \d+"):
        run_job(spec)
    run_dir = [d for d in (tmp_path / "runs").iterdir() if d.name.startswith("t-")][0]
    summary = read_summary(str(run_dir))
    assert summary["status"] == "failed" and name in summary["reason"] and "step" in summary["reason"]


def test_run_skips_a_bad_shard_and_says_so(ray_cluster, datasets, tmp_path):
    dataset = str(tmp_path / "digits")
    shutil.copytree(datasets["webdataset"], dataset)
    m = read_manifest(dataset)
    bad = 4
    name = damage(dataset, bad, "corrupt")
    lo, hi = m.row_offsets[bad], m.row_offsets[bad] + m.shards[bad].num_rows
    spec = tiny_spec(tmp_path, dataset,
                     model={"name": "cnn", "vocab_size": 10, "n_layer": 1, "n_embd": 8, "n_head": 1},
                     data={"shuffle_window": WINDOW, "shuffle_block_rows": BLOCK,
                           "on_bad_shard": "skip", "log_sample_ids": True},
                     train={"max_steps": 20}, resources={"num_workers": 2})
    result = run_job(spec)
    assert result.status == "finished" and result.committed_steps == 20
    summary = read_summary(result.run_dir)
    notes = [t["reason"] for t in summary["transitions"] if "on_bad_shard=skip" in t["reason"]]
    assert len(notes) == 1 and name in notes[0]
    record = json.loads(open(os.path.join(result.run_dir, SKIP_LOG_FILE)).readline())
    assert record["path"] == name and set(record["sample_ids"]) <= set(range(lo, hi))
    with open(os.path.join(result.run_dir, "sample_ids.jsonl")) as f:
        seen = [i for line in f for r in json.loads(line)["ranks"] for i in r]
    assert len(seen) == 160 and record["from_position"] == 0  # corrupt from the start
    assert_exactly_once_with_skips(seen, m.num_rows, [record])
