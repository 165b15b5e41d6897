"""Sequences: documents packed into fixed-length rows (optionally masked at document boundaries)
and length bucketing, on the global stream, with the order's guarantees intact: every document's
tokens exactly once per epoch among committed steps, across failures, resizes and restarts; the
same global batches at any world size; a masked packed batch trains as its documents alone.

Datasets are real files prepared by ``prepare_documents_dataset``; plane tests run real Ray Data on
the session's local cluster."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrain_sys.data import order
from raytrain_sys.train.compat import check_spec_against_manifest
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.data.reads import read_document_window
from raytrain_sys.data.prepare import FILE_SEPARATOR, prepare_documents_dataset
from raytrain_sys.data.shards import read_document_index, read_manifest
from raytrain_sys.errors import DataError, SpecError
from raytrain_sys.models.gpt import GPT, GPTConfig
from raytrain_sys.train.tasks import NextToken
from tests.helpers import tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

ROW_LEN, WINDOW, BLOCK, B = 17, 8, 4, 8
MAX_STEPS = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[bytes]]:
    """47 real text files of 0 to 120 bytes (some longer than a row, one empty) as a documents
    dataset of 6 shards: ~100 packed rows of 17 tokens, 12-13 steps of 8 per epoch."""
    root = tmp_path_factory.mktemp("seq")
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    words = ["def", "return", "x", "(", ")", ":", "\n", "    ", "class", "self", "=", "1"]
    for i in range(47):
        n = 0 if i == 5 else int(rng.integers(1, 121))
        text = "".join(rng.choice(words, size=n))[:n]
        (src / f"doc{i:02d}.py").write_text(text)
    out = str(root / "docs")
    prepare_documents_dataset(out, [str(src)], docs_per_shard=8)
    # The documents as training must see them, read straight from the source files.
    docs = [p.read_bytes() + bytes([FILE_SEPARATOR]) for p in sorted(src.iterdir())]
    return out, docs


def new_plane(path: str, sequences: str, end: int = MAX_STEPS * B) -> DataPlane:
    return DataPlane(path, read_manifest(path), 5, WINDOW, BLOCK, B, end_position=end,
                     prefetch_steps=2, sequences=sequences, row_len=ROW_LEN)


# ----------------------------------------------------------------------------- the pure plan

lengths_st = st.lists(st.integers(0, 60), min_size=1, max_size=40).filter(lambda x: sum(x) > 0)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**31), window=st.integers(1, 12),
       block=st.integers(1, 6), row_len=st.integers(2, 20), layout=st.sampled_from(order.LAYOUTS),
       batch=st.integers(1, 9), epoch=st.integers(0, 3), cut=st.integers(1, 5))
def test_rows_hold_every_document_token_once_per_epoch(lengths, seed, window, block, row_len,
                                                       layout, batch, epoch, cut):
    shards = tuple(len(lengths[i::cut]) for i in range(min(cut, len(lengths))))
    index = order.DocumentIndex(lengths, shards)
    stream = order.DocumentStream(index, seed, window, block, row_len, layout, batch)
    first = stream.epoch_start(epoch)
    num_rows = stream.epoch(epoch).num_rows
    covered = np.zeros(int(index.token_offsets[-1]), dtype=np.int64)
    pos = first
    while pos < first + num_rows:
        g, offset = stream.locate(pos)
        assert offset == 0 and stream.window_start(g) == pos
        rows = stream.window_layout(g)
        assert len(rows.row_starts) == stream.window_rows(g)
        assert ((rows.row_tokens >= 1) & (rows.row_tokens <= row_len)).all()
        corpus = np.concatenate([np.arange(index.token_offsets[d], index.token_offsets[d + 1])
                                 for d in rows.doc_ids])  # the window's concatenation, as corpus ids
        for start, n in zip(rows.row_starts, rows.row_tokens):
            covered[corpus[start:start + n]] += 1
        assert np.array_equal(rows.row_ids, corpus[rows.row_starts])  # sample id = first token
        if layout == order.BUCKET:  # a bucket row never spans two documents
            doc_of = np.searchsorted(index.token_offsets, corpus, side="right") - 1
            assert all(doc_of[s] == doc_of[s + n - 1] for s, n in zip(rows.row_starts, rows.row_tokens))
        pos += max(1, len(rows.row_starts))
    assert (covered == 1).all()
    # ids of the epoch: one per row, distinct, and the reference function agrees.
    ids = stream.ids(first, first + num_rows)
    assert len(ids) == num_rows == len(set(ids.tolist()))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 1000), window=st.integers(1, 12),
       row_len=st.integers(2, 20), batch=st.integers(1, 9))
def test_bucketing_is_deterministic_and_loses_no_row(lengths, seed, window, row_len, batch):
    index = order.DocumentIndex(lengths, (len(lengths),))
    ids = order.DocumentStream(index, seed, window, 3, row_len, order.BUCKET, batch).ids(0, 200)
    order.document_epoch.cache_clear()
    order.epoch_plan.cache_clear()
    fresh = order.DocumentStream(index, seed, window, 3, row_len, order.BUCKET, batch)
    assert np.array_equal(ids, fresh.ids(0, 200))
    # Every piece of every document (each document cut every row_len tokens) is a row, once.
    pieces = sorted(int(index.token_offsets[d]) + k for d, n in enumerate(lengths)
                    for k in range(0, n, row_len))
    per_epoch = fresh.epoch(0).num_rows
    assert per_epoch == len(pieces)
    for e in range(3):
        assert sorted(fresh.ids(e * per_epoch, (e + 1) * per_epoch).tolist()) == pieces


def test_bucketing_pads_less_than_random_batches():
    """Batches of similar lengths: far less padding than the same rows in training order."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=2000)
    index = order.DocumentIndex(lengths, (1000, 1000))

    def padding(layout_rows: list[np.ndarray]) -> float:
        tokens = np.concatenate(layout_rows)
        batches = [tokens[i:i + 16] for i in range(0, len(tokens) - 15, 16)]
        return sum(b.max() * len(b) - b.sum() for b in batches) / sum(b.sum() for b in batches)

    def pieces(n: int) -> list[int]:
        return [129] * (n // 129) + ([n % 129] if n % 129 else [])

    bucket = order.DocumentStream(index, 0, 256, 16, 129, order.BUCKET, 16)
    rows = [bucket.window_layout(g).row_tokens for g in range(bucket.windows_per_epoch)]
    docs = [bucket.epoch(0).docs.window_sample_ids(w) for w in range(bucket.windows_per_epoch)]
    in_training_order = [np.asarray([k for d in ds for k in pieces(int(lengths[d]))]) for ds in docs]
    assert padding(rows) < 0.2 * padding(in_training_order), (padding(rows), padding(in_training_order))


# ----------------------------------------------------------------------------- reading and the loss

def test_masked_packed_batch_trains_as_its_documents_alone(corpus):
    """Loss of packed rows with positions reset and a block-diagonal mask = the sum of the losses
    of every document piece run through the model on its own (fp64, so only rounding differs)."""
    path, docs = corpus
    m = read_manifest(path)
    stream = order.DocumentStream(read_document_index(path, m), 5, WINDOW, BLOCK, ROW_LEN,
                                  order.PACK, B)
    columns, _ = read_document_window(path, m, stream, 0, masked=True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=ROW_LEN - 1, n_layer=2, n_head=2, n_embd=16)).double()
    task = NextToken()
    packed = task.loss_sum(model, {k: torch.tensor(v) for k, v in columns.items()}).item()
    alone, targets = 0.0, 0
    for tokens, doc_ids, n in zip(columns["tokens"], columns["doc_ids"], columns["num_tokens"]):
        cuts = np.flatnonzero(np.diff(doc_ids[:n])) + 1
        for piece in np.split(tokens[:n], cuts):
            if len(piece) > 1:
                alone += task.loss_sum(model, {"tokens": torch.tensor(piece[None])}).item()
                targets += len(piece) - 1
    assert len(columns["tokens"]) > 5 and (np.diff(columns["doc_ids"], axis=1) != 0).any()
    assert task.units(columns) == targets
    assert packed == pytest.approx(alone, rel=1e-12)
    # Without the mask the same rows give another loss: the test can fail.
    unmasked = {k: torch.tensor(v) for k, v in columns.items() if k != "doc_ids"}
    assert task.loss_sum(model, unmasked).item() != pytest.approx(alone, rel=1e-6)


def test_a_resume_reads_only_documents_from_the_cursor_on(corpus):
    path, _ = corpus
    m = read_manifest(path)
    stream = order.DocumentStream(read_document_index(path, m), 5, WINDOW, BLOCK, ROW_LEN,
                                  order.PACK, B)
    whole, ids = read_document_window(path, m, stream, 1, masked=True)
    for start in range(len(ids)):
        part, part_ids = read_document_window(path, m, stream, 1, start, masked=True)
        assert np.array_equal(part_ids, ids[start:])
        for k in whole:
            assert np.array_equal(part[k], whole[k][start:]), (start, k)
    rows = stream.window_layout(1)
    assert rows.docs_of_rows(len(ids) - 1).sum() < len(rows.doc_ids)  # the last row: few documents


# ----------------------------------------------------------------------------- the plane (Ray Data)

from tests.test_data_exactly_once import action  # noqa: E402  (the same schedules of faults)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=st.lists(action, min_size=3, max_size=14))
def test_packed_documents_exactly_once_across_resizes_and_restarts(ray_cluster, corpus, schedule):
    path, docs = corpus
    plane = new_plane(path, "pack_masked")
    world, cursor, checkpoint = 2, 0, (0, [])
    committed: list[list[dict]] = []  # per committed step: the columns each rank trained on
    try:
        for kind, arg in schedule:
            if kind in ("step", "fail"):
                for _ in range(arg if kind == "step" else 1):
                    if len(committed) == MAX_STEPS:
                        break
                    batch, ids = plane.global_batch(cursor)
                    assert len(ids) == B and all(len(v) == B for v in batch.values())
                    shares = [{**{k: v[sl] for k, v in batch.items()}, "ids": ids[sl]}
                              for sl in order.deal(B, world)]
                    if kind == "step":
                        committed.append(shares)
                        cursor += B
            elif kind == "resize":
                world = arg
            elif kind == "checkpoint":
                checkpoint = (cursor, list(committed))
            else:  # restart: the driver lost its plane; the run rolls back to the checkpoint
                plane.close()
                plane = new_plane(path, "pack_masked")
                cursor, committed = checkpoint[0], list(checkpoint[1])
        if len(committed) < MAX_STEPS:  # one more step: the plane still serves the right batch
            batch, ids = plane.global_batch(cursor)
            committed.append([{**batch, "ids": ids}])
            cursor += B
        stream = plane.stream
    finally:
        plane.close()
    shares = [s for step in committed for s in step]
    ids = np.concatenate([s["ids"] for s in shares])
    # Exactly the plan's rows: nothing from an uncommitted step, nothing reordered.
    assert ids.tolist() == stream.ids(0, cursor).tolist()
    tokens = np.concatenate([s["tokens"] for s in shares])
    doc_ids = np.concatenate([s["doc_ids"] for s in shares])
    num_tokens = np.concatenate([s["num_tokens"] for s in shares])
    e = 0
    while stream.epoch_start(e + 1) <= cursor:  # every whole epoch: each document's bytes, once
        lo, hi = stream.epoch_start(e), stream.epoch_start(e + 1)
        real = np.arange(ROW_LEN)[None, :] < num_tokens[lo:hi, None]
        assert (doc_ids[lo:hi][~real] == -1).all() and (tokens[lo:hi][~real] == 0).all()
        flat_docs, flat_tokens = doc_ids[lo:hi][real], tokens[lo:hi][real]
        for d, text in enumerate(docs):
            assert flat_tokens[flat_docs == d].tobytes() == text, (e, d)
        e += 1
    assert e >= 1 or cursor < stream.epoch_start(1)


def _stream_hash(path: str, sequences: str, worlds: list[int], steps: int) -> str:
    """Hash of the global batches as the ranks received them (rank shares in rank order)."""
    plane = new_plane(path, sequences)
    h = hashlib.sha256()
    try:
        for step in range(steps):
            batch, ids = plane.global_batch(step * B)
            shares = order.deal(B, worlds[step])
            for column in [ids] + [batch[k] for k in sorted(batch)]:
                for sl in shares:
                    h.update(column[sl].tobytes())
    finally:
        plane.close()
    return h.hexdigest()


@pytest.mark.parametrize("sequences", ["pack_masked", "bucket"])
def test_global_batches_are_the_same_at_any_world_size(ray_cluster, corpus, sequences):
    path, _ = corpus
    steps = 20  # more than an epoch
    hashes = {w: _stream_hash(path, sequences, [w] * steps, steps) for w in (1, 2, 3, 4)}
    resized = _stream_hash(path, sequences, [2] * 5 + [3] * 6 + [1] * 3 + [4] * 6, steps)
    assert len(set(hashes.values())) == 1 and resized == hashes[1]


def test_bucketed_batches_are_padded_to_their_longest_row(ray_cluster, corpus):
    """One epoch through the plane: each row is its document piece, each batch as wide as its
    longest row, and every piece of every document is there once."""
    path, docs = corpus
    plane = new_plane(path, "bucket")
    index = plane.stream.index
    per_epoch = plane.stream.epoch(0).num_rows
    seen = []
    try:
        for cursor in range(0, per_epoch - B + 1, B):
            batch, ids = plane.global_batch(cursor)
            n = batch["num_tokens"]
            assert batch["tokens"].shape == (B, max(2, int(n.max())))
            for row, k, i in zip(batch["tokens"], n, ids):
                d = int(np.searchsorted(index.token_offsets, i, side="right")) - 1
                at = int(i - index.token_offsets[d])
                assert row[:k].tobytes() == docs[d][at:at + k] and not row[k:].any()
            seen += ids.tolist()
    finally:
        plane.close()
    pieces = [int(index.token_offsets[d]) + k for d, text in enumerate(docs)
              for k in range(0, len(text), ROW_LEN)]
    assert len(seen) == len(set(seen)) and set(seen) <= set(pieces)
    assert len(pieces) - len(seen) < B  # all but the epoch's last partial batch


# ----------------------------------------------------------------------------- the spec

def test_sequences_field_is_validated_by_name(tmp_path, corpus, tiny_dataset):
    path, _ = corpus
    with pytest.raises(SpecError, match="data.sequences.*allowed: rows, pack, pack_masked, bucket"):
        tiny_spec(tmp_path, path, data={"sequences": "packed"})
    with pytest.raises(SpecError, match="data.sequences.*pipeline"):
        tiny_spec(tmp_path, path, data={"sequences": "pack"}, parallel={"pp": 2})
    with pytest.raises(SpecError, match="data.on_bad_shard"):
        tiny_spec(tmp_path, path, data={"sequences": "bucket", "on_bad_shard": "skip"})
    m = read_manifest(path)
    with pytest.raises(SpecError, match="data.sequences.*documents of varying length"):
        check_spec_against_manifest(tiny_spec(tmp_path, path), m)
    check_spec_against_manifest(tiny_spec(tmp_path, path, data={"sequences": "pack_masked"}), m)
    with pytest.raises(SpecError, match="data.sequences.*fixed rows of 33 tokens"):
        check_spec_against_manifest(tiny_spec(tmp_path, tiny_dataset, data={"sequences": "pack"}),
                                    read_manifest(tiny_dataset))
    # The training hash follows sequences, and an old spec's hash is unchanged by the new field.
    rows, pack = tiny_spec(tmp_path, path), tiny_spec(tmp_path, path, data={"sequences": "pack"})
    assert rows.training_hash() != pack.training_hash()


def test_a_damaged_length_index_is_named(tmp_path, corpus):
    import shutil

    path = str(tmp_path / "copy")
    shutil.copytree(corpus[0], path)
    m = read_manifest(path)
    lengths = Path(path) / m.extra["document_lengths"]["path"]
    lengths.write_bytes(lengths.read_bytes()[:-4] + b"\x00\x00\x00\x01")
    with pytest.raises(DataError, match="document length index .* is corrupt"):
        new_plane(path, "pack")


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("sequences", ["pack_masked", "bucket"])
def test_a_job_on_documents_equals_one_process(ray_cluster, corpus, tmp_path, sequences):
    """3 workers (uneven shares of 8 rows) end where one process ends, in fp64: the task's target
    count over the global batch weights padded and masked rows right."""
    from raytrain_sys.control.supervisor import run_job
    from tests.helpers import assert_params_close, final_params

    path, _ = corpus
    runs = {}
    for workers in (1, 3):
        spec = tiny_spec(tmp_path / str(workers), path, train={"precision": "fp64"},
                         data={"sequences": sequences, "shuffle_window": WINDOW,
                               "shuffle_block_rows": BLOCK},
                         resources={"num_workers": workers})
        runs[workers] = run_job(spec)
        assert runs[workers].status == "finished" and runs[workers].committed_steps == 8
    assert_params_close(final_params(runs[3].newest_checkpoint),
                        final_params(runs[1].newest_checkpoint), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(runs[3].losses, runs[1].losses, rtol=1e-5)
    assert all(np.isfinite(runs[1].losses))
