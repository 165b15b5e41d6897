"""Exactly once across failures, resizes and restarts; the same global batches at any world size;
resume seeks. The "supervisor" here is a small model of the real one driving the real DataPlane
(real Ray Data on the session's local cluster): it asks for a step's global batch at the cursor,
deals it to W ranks with ``order.deal``, and moves the cursor only when the step commits."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrain_sys.data import order
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.data.prepare import _ShardWriter, prepare_text_dataset
from raytrain_sys.data.manifest import MANIFEST_NAME, TOKENS_FORMAT, DatasetManifest
from raytrain_sys.data.shards import read_manifest

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

WINDOW, BLOCK, B = 16, 4, 8
MAX_STEPS = 40


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    """~64 rows in 6 shards: 8 steps of 8 per epoch, so schedules cross epochs."""
    out = str(tmp_path_factory.mktemp("eo") / "small")
    prepare_text_dataset(out, row_len=17, rows_per_shard=12, max_bytes=1100)
    return out


def new_plane(path: str) -> DataPlane:
    return DataPlane(path, read_manifest(path), 5, WINDOW, BLOCK, B, end_position=MAX_STEPS * B,
                     prefetch_steps=2)


action = st.one_of(
    st.tuples(st.just("step"), st.integers(1, 4)),  # commit this many steps
    st.tuples(st.just("fail"), st.integers(0, 1)),  # ask for the step's batch, commit nothing
    st.tuples(st.just("resize"), st.integers(1, 5)),  # new world size (3 and 5 do not divide 8)
    st.tuples(st.just("checkpoint"), st.just(0)),
    st.tuples(st.just("restart"), st.just(0)),  # back to the last checkpoint with a new plane
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=st.lists(action, min_size=3, max_size=14))
def test_committed_steps_hold_every_sample_once_per_epoch(ray_cluster, small, schedule):
    m = read_manifest(small)
    n = m.num_rows
    plane = new_plane(small)
    world, cursor, checkpoint = 2, 0, (0, [])
    committed: list[list[list[int]]] = []  # per committed step: the ids each rank trained on
    try:
        for kind, arg in schedule:
            if kind == "step" or kind == "fail":
                for _ in range(arg if kind == "step" else 1):
                    if len(committed) == MAX_STEPS:
                        break
                    batch, ids = plane.global_batch(cursor)
                    assert len(ids) == B and all(len(v) == B for v in batch.values())
                    shares = [ids[sl].tolist() for sl in order.deal(B, world)]
                    assert max(map(len, shares)) - min(map(len, shares)) <= 1
                    if kind == "step":
                        committed.append(shares)
                        cursor += B
            elif kind == "resize":
                world = arg
            elif kind == "checkpoint":
                checkpoint = (cursor, list(committed))
            else:  # restart: the driver lost its plane; the run rolls back to the checkpoint
                plane.close()
                plane = new_plane(small)
                cursor, committed = checkpoint[0], list(checkpoint[1])
        # One more step after the schedule: the plane still serves the right batch.
        if len(committed) < MAX_STEPS:
            committed.append([plane.global_batch(cursor)[1].tolist()])
            cursor += B
    finally:
        plane.close()
    stream = [i for shares in committed for rank in shares for i in rank]
    assert len(stream) == cursor
    for e in range(0, len(stream), n):  # every whole epoch: each id once; a partial one: no repeat
        part = stream[e:e + n]
        assert len(set(part)) == len(part)
        if len(part) == n:
            assert sorted(part) == list(range(n))
    # ...and exactly the plan's stream: nothing from an uncommitted step, nothing reordered.
    rows = tuple(s.num_rows for s in m.shards)
    assert stream == order.sample_ids(rows, 5, WINDOW, BLOCK, 0, cursor).tolist()


def _stream_hash(path: str, worlds: list[int], steps: int) -> str:
    """Hash of the global batches as the ranks received them (rank shares in rank order)."""
    plane = new_plane(path)
    h = hashlib.sha256()
    try:
        for step in range(steps):
            batch, ids = plane.global_batch(step * B)
            shares = order.deal(B, worlds[step])
            for sl in shares:
                h.update(ids[sl].tobytes())
            for sl in shares:
                h.update(batch["tokens"][sl].tobytes())
    finally:
        plane.close()
    return h.hexdigest()


def test_global_batches_are_the_same_at_any_world_size(ray_cluster, small):
    steps = 20  # 2.5 epochs
    hashes = {w: _stream_hash(small, [w] * steps, steps) for w in (1, 2, 3, 4)}
    resized = _stream_hash(small, [2] * 5 + [3] * 6 + [1] * 3 + [4] * 6, steps)  # mid-epoch resizes
    assert len(set(hashes.values())) == 1 and resized == hashes[1]


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> str:
    """200k random rows of 33 tokens (6.6 MB, 25 shards): an epoch is 25 windows of 8192."""
    out = tmp_path_factory.mktemp("eo") / "large"
    out.mkdir()
    rng = np.random.default_rng(0)
    writer = _ShardWriter(out, 33, 8192)
    rows = 200_000
    writer.add(rng.integers(0, 256, rows * 33, dtype=np.uint8).tobytes())
    shards = writer.close()
    (out / MANIFEST_NAME).write_text(
        DatasetManifest(format=TOKENS_FORMAT, row_len=33, shards=tuple(shards)).to_json())
    return str(out)


def test_resume_seeks_instead_of_reading_up_to_the_cursor(ray_cluster, large):
    """Time to the first batch at 90% of an epoch is that at 0% (within 10% or 1 s)."""
    m = read_manifest(large)
    late = int(0.9 * m.num_rows) + 3  # mid-window, mid-row-group

    def first_batch_s(cursor: int) -> float:
        plane = DataPlane(large, m, 0, 8192, 256, 32, end_position=2 * m.num_rows)
        try:
            t0 = time.perf_counter()
            _, ids = plane.global_batch(cursor)
            elapsed = time.perf_counter() - t0
            rows = tuple(s.num_rows for s in m.shards)
            assert ids.tolist() == order.sample_ids(rows, 0, 8192, 256, cursor, cursor + 32).tolist()
            return elapsed
        finally:
            plane.close()

    first_batch_s(0)  # warm the Ray Data worker processes
    at_start = min(first_batch_s(0) for _ in range(3))
    at_90 = min(first_batch_s(late) for _ in range(3))
    assert at_90 <= max(1.1 * at_start, at_start + 1.0), (at_start, at_90)
