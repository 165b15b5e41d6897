"""prepare-data: text files to Parquet token shards plus a manifest written last."""

import hashlib
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_sys.data.manifest import MANIFEST_NAME, TOKENS_FORMAT
from raytrain_sys.data.prepare import (
    FILE_SEPARATOR,
    ROW_GROUP_ROWS,
    prepare_text_dataset,
    verify_shards,
    stdlib_source_files,
)
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.errors import DataError


@pytest.fixture
def corpus(tmp_path):
    """A few text files whose concatenation (with separators) is known byte for byte."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    texts = {}
    for i, name in enumerate(["b.txt", "a.py", "sub/c.txt", "sub/d.md"]):
        words = rng.choice(["alpha", "beta", "gamma", "def", "return", "(x)", "\n"], size=400 + 97 * i)
        texts[name] = " ".join(words).encode()
        (root / name).write_bytes(texts[name])
    (root / "ignored.bin").write_bytes(b"\x00" * 1000)  # not a text suffix
    (root / ".git").mkdir()
    (root / ".git" / "notes.txt").write_bytes(b"hidden directories are skipped")
    stream = b"".join(texts[n] + bytes([FILE_SEPARATOR]) for n in sorted(texts))
    return root, stream


def read_rows(directory, manifest) -> bytes:
    out = []
    for s in manifest.shards:
        table = pq.read_table(Path(directory) / s.path)
        assert table.schema == pa.schema([("tokens", pa.binary(manifest.row_len))])
        assert table.num_rows == s.num_rows
        out += [r.as_py() for r in table.column("tokens")]
    return b"".join(out)


def test_rows_are_the_corpus_stream_cut_in_order(corpus, tmp_path):
    root, stream = corpus
    out = tmp_path / "ds"
    m = prepare_text_dataset(str(out), [str(root)], row_len=33, rows_per_shard=20)
    assert m.format == TOKENS_FORMAT and m.row_len == 33
    assert m.num_rows == len(stream) // 33
    assert len(m.shards) == -(-m.num_rows // 20)
    assert [s.path for s in m.shards] == [f"shard-{i:05d}.parquet" for i in range(len(m.shards))]
    assert all(s.num_rows == 20 for s in m.shards[:-1])
    assert read_rows(out, m) == stream[: m.num_rows * 33]
    for s in m.shards:
        blob = (out / s.path).read_bytes()
        assert (len(blob), hashlib.sha256(blob).hexdigest()) == (s.num_bytes, s.sha256)
    assert read_manifest(str(out)) == m
    verify_shards(out, m)


def test_row_groups_let_readers_seek(tmp_path, corpus):
    root, stream = corpus
    m = prepare_text_dataset(str(tmp_path / "ds"), [str(root)], row_len=8, rows_per_shard=5000)
    meta = pq.ParquetFile(tmp_path / "ds" / m.shards[0].path).metadata
    assert meta.num_row_groups == -(-m.shards[0].num_rows // ROW_GROUP_ROWS)
    assert meta.row_group(0).num_rows == ROW_GROUP_ROWS


def test_max_bytes_caps_the_stream_and_files_are_sources_too(corpus, tmp_path):
    root, stream = corpus
    m = prepare_text_dataset(str(tmp_path / "ds"), [str(root / "a.py"), str(root / "sub")],
                             row_len=16, max_bytes=3000)
    assert m.num_rows == 3000 // 16
    a = (root / "a.py").read_bytes()
    expected = a + bytes([FILE_SEPARATOR]) + (root / "sub/c.txt").read_bytes()
    assert read_rows(tmp_path / "ds", m) == expected[: m.num_rows * 16]


def test_val_split_is_the_stream_tail_in_its_own_dataset(corpus, tmp_path):
    root, stream = corpus
    out = tmp_path / "ds"
    m = prepare_text_dataset(str(out), [str(root)], row_len=10, rows_per_shard=50, val_fraction=0.1)
    val = read_manifest(str(out / m.extra["val_path"]))
    verify_shards(out / m.extra["val_path"], val)
    total = len(stream) // 10
    assert val.num_rows == int(total * 0.1) and m.num_rows + val.num_rows == total
    assert read_rows(out, m) + read_rows(out / "val", val) == stream[: total * 10]


def test_same_input_same_content_hash(corpus, tmp_path):
    root, _ = corpus
    a = prepare_text_dataset(str(tmp_path / "a"), [str(root)], row_len=33)
    b = prepare_text_dataset(str(tmp_path / "b"), [str(root)], row_len=33)
    c = prepare_text_dataset(str(tmp_path / "c"), [str(root)], row_len=32)
    assert a.content_hash == b.content_hash != c.content_hash


def test_refuses_to_overwrite_unless_asked(corpus, tmp_path):
    root, stream = corpus
    out = tmp_path / "ds"
    prepare_text_dataset(str(out), [str(root)], row_len=16, rows_per_shard=10)
    before = (out / MANIFEST_NAME).read_text()
    with pytest.raises(DataError, match="already holds a dataset"):
        prepare_text_dataset(str(out), [str(root)], row_len=16)
    assert (out / MANIFEST_NAME).read_text() == before  # untouched
    m = prepare_text_dataset(str(out), [str(root)], row_len=64, rows_per_shard=1000, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME] + [s.path for s in m.shards])
    assert read_rows(out, m) == stream[: m.num_rows * 64]


def test_missing_dataset_and_bad_sources_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"no dataset at .*raytrain-sys prepare-data --out"):
        read_manifest(str(tmp_path / "nothing"))
    with pytest.raises(DataError, match="neither a file nor a directory"):
        prepare_text_dataset(str(tmp_path / "ds"), [str(tmp_path / "missing")])
    (tmp_path / "small.txt").write_bytes(b"tiny")
    with pytest.raises(DataError, match="too few"):
        prepare_text_dataset(str(tmp_path / "ds"), [str(tmp_path / "small.txt")])
    assert not (tmp_path / "ds" / MANIFEST_NAME).exists()


def test_corrupt_shard_is_caught_by_verify(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "ds"
    m = prepare_text_dataset(str(out), [str(root)], row_len=16, rows_per_shard=10)
    shard = out / m.shards[1].path
    blob = bytearray(shard.read_bytes())
    blob[100] ^= 0xFF
    shard.write_bytes(bytes(blob))
    read_manifest(str(out))  # cheap read does not hash
    with pytest.raises(DataError, match="shard-00001.parquet does not match"):
        verify_shards(out, read_manifest(str(out)))


def test_stdlib_default_sources(tmp_path):
    files = stdlib_source_files()
    assert len(files) > 500
    assert not any("site-packages" in f.parts or "__pycache__" in f.parts for f in files)
    start = time.perf_counter()
    m = prepare_text_dataset(str(tmp_path / "stdlib"), max_bytes=2_000_000)
    assert time.perf_counter() - start < 5
    assert m.num_rows == 2_000_000 // 129 and m.row_len == 129
    assert "stdlib" in m.source
    head = b"".join(f.read_bytes() + bytes([FILE_SEPARATOR]) for f in files[:20])[: 10 * 129]
    rows = pq.read_table(tmp_path / "stdlib" / m.shards[0].path).column("tokens")[:10]
    assert b"".join(r.as_py() for r in rows) == head
