"""Turn text files into a byte-level token dataset: Parquet shards plus a manifest.

The corpus is one byte stream: each source file's raw bytes followed by FILE_SEPARATOR, files in
sorted path order. The stream is cut into rows of ``row_len`` tokens (the tail shorter than a row
is dropped); row ``i`` is stream bytes ``[i * row_len, (i + 1) * row_len)``, and rows fill shards
of ``rows_per_shard`` in order. Same sources and parameters, same pyarrow: same bytes, same
manifest content hash.

Commit order, so that a reader never sees half a dataset: shards first (each written under a
temporary name and renamed), the manifest last. With ``val_fraction`` the last rows of the stream
form a second dataset in ``<out_dir>/val`` with its own manifest, written before the main one.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_sys.data.manifest import MANIFEST_NAME, TOKENS_FORMAT, DatasetManifest, ShardInfo
from raytrain_sys.errors import DataError

FILE_SEPARATOR = 0x1C  # ASCII "file separator": never in Python source, marks document ends
DEFAULT_MAX_BYTES = 24_000_000  # the stdlib's first ~24 MB: minutes of CPU training, ~5 s to prepare
ROW_GROUP_ROWS = 256  # = data.shuffle_block_rows: a permuted block is one row group read
VAL_DIR = "val"
SHARD_PATTERN = re.compile(r"shard-\d{5}\.parquet")
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")  # files taken from a source directory

# Directories under the stdlib that are not the library's own source, or not code a person wrote:
# the test suite (half the bytes, much of it generated fixtures), codec tables (encodings/cp*.py
# are rows of '\x00' literals) and pydoc's topic dump. Without them the model learns Python.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "test", "tests",
                     "idle_test", "encodings", "pydoc_data"}
# Test fixtures (tokenizedata, test_lib2to3/data, ziptestdata, ...): odd encodings, generated code.
_TEST_DATA_DIR = re.compile(r".*data\d*")


# ----------------------------------------------------------------------------- sources

def stdlib_source_files() -> list[Path]:
    """The Python standard library's *.py files, sorted by their path inside the stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        in_tests = any(part in ("test", "tests") for part in rel.parts)
        dirnames[:] = [
            d for d in dirnames
            if d not in _STDLIB_SKIP_DIRS and not (in_tests and _TEST_DATA_DIR.fullmatch(d))
            and not d.startswith("config-")
        ]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _files_of(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            # hidden directories (.git, .venv) and bytecode caches are not the user's text
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            files += [Path(dirpath) / f for f in filenames
                      if f.endswith(TEXT_SUFFIXES) and not f.startswith(".")]
        return sorted(files, key=lambda p: p.relative_to(path).as_posix())
    raise DataError(f"data source {source!r} is neither a file nor a directory")


def _byte_stream(files: list[Path], max_bytes: int) -> Iterator[bytes]:
    """Each file's bytes then FILE_SEPARATOR, stopping after max_bytes (0 = no cap)."""
    left = max_bytes or float("inf")
    sep = bytes([FILE_SEPARATOR])
    for f in files:
        try:
            chunk = f.read_bytes() + sep
        except OSError as exc:
            raise DataError(f"cannot read data source file {f}: {exc}") from None
        if len(chunk) >= left:
            yield chunk[: int(left)]
            return
        left -= len(chunk)
        yield chunk


# ----------------------------------------------------------------------------- shards

class _ShardWriter:
    """Fills shard-NNNNN.parquet files in one directory with rows, rows_per_shard at a time."""

    def __init__(self, out_dir: Path, row_len: int, rows_per_shard: int):
        self.out_dir, self.row_len, self.rows_per_shard = out_dir, row_len, rows_per_shard
        self.pending = bytearray()
        self.shards: list[ShardInfo] = []

    def add(self, rows: bytes) -> None:
        self.pending += rows
        shard_bytes = self.row_len * self.rows_per_shard
        while len(self.pending) >= shard_bytes:
            self._write(bytes(self.pending[:shard_bytes]))
            del self.pending[:shard_bytes]

    def close(self) -> list[ShardInfo]:
        if self.pending:
            self._write(bytes(self.pending))
            self.pending.clear()
        return self.shards

    def _write(self, data: bytes) -> None:
        num_rows = len(data) // self.row_len
        tokens = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(self.row_len), num_rows, [None, pa.py_buffer(data)]
        )
        sink = pa.BufferOutputStream()
        pq.write_table(
            pa.table({"tokens": tokens}), sink,
            row_group_size=ROW_GROUP_ROWS,
            compression="zstd",  # source code compresses ~4x; every reader of pyarrow has zstd
            use_dictionary=False,  # rows are all distinct
            write_statistics=False,  # min/max of byte rows would help no query
            write_page_checksum=True,  # readers verify every page they decode (shards.py)
        )
        blob = sink.getvalue().to_pybytes()
        name = f"shard-{len(self.shards):05d}.parquet"
        _write_atomic(self.out_dir / name, blob)
        self.shards.append(ShardInfo(path=name, num_rows=num_rows, num_bytes=len(blob),
                                     sha256=hashlib.sha256(blob).hexdigest()))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write {path}: {exc}") from None


def _remove_stale_shards(directory: Path, keep: set[str]) -> None:
    if directory.is_dir():
        for p in directory.iterdir():
            if SHARD_PATTERN.fullmatch(p.name) and p.name not in keep:
                p.unlink()


# ----------------------------------------------------------------------------- prepare

def _check_cap_and_split(max_bytes: int, val_fraction: float) -> None:
    if max_bytes < 0:
        raise DataError(f"max_bytes must be 0 (no cap) or positive, got {max_bytes}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")


def _unpublish(out: Path, val_out: Path, overwrite: bool) -> None:
    """Refuse to clobber a dataset unless asked; then unpublish it first: while shards are
    rewritten, no reader may take the directory for a dataset."""
    if (out / MANIFEST_NAME).exists() and not overwrite:
        raise DataError(f"{out} already holds a dataset ({MANIFEST_NAME}); choose another "
                        f"directory or pass overwrite=True (--overwrite)")
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    (val_out / MANIFEST_NAME).unlink(missing_ok=True)


def _source_files(sources) -> tuple[list[Path], str]:
    """The text files to read, and a description of where they came from, for the manifest."""
    if sources is None:
        files = stdlib_source_files()
        source = f"python {sys.version.split()[0]} stdlib ({sysconfig.get_paths()['stdlib']})"
    else:
        files = [f for s in sources for f in _files_of(s)]
        source = ", ".join(str(s) for s in sources)
    if not files:
        raise DataError(f"no source files found in {source or 'the given sources'}")
    return files, source


def prepare_text_dataset(
    out_dir: str,
    sources: list[str] | None = None,
    row_len: int = 129,  # block_size 128 + 1: inputs are row[:-1], targets row[1:]
    rows_per_shard: int = 8192,  # ~1 MB of tokens per shard
    max_bytes: int = 0,
    val_fraction: float = 0.0,
    overwrite: bool = False,
) -> DatasetManifest:
    """Write a token dataset to out_dir and return its manifest.

    sources: files (any suffix) and directories (their *.py, *.txt, *.md, *.rst files, recursively);
    None = the Python standard library's source. max_bytes caps the byte stream (0 = all of it).
    val_fraction: the stream's last rows go to ``<out_dir>/val``, a dataset of their own.
    """
    if row_len < 2:
        raise DataError(f"row_len must be at least 2 (inputs and a target), got {row_len}")
    if rows_per_shard < 1:
        raise DataError(f"rows_per_shard must be positive, got {rows_per_shard}")
    _check_cap_and_split(max_bytes, val_fraction)

    out = Path(out_dir).expanduser()
    val_out = out / VAL_DIR
    _unpublish(out, val_out, overwrite)
    files, source = _source_files(sources)

    # The stream's length decides the train/val boundary before any byte is read: size every
    # file now and check each one against it as it is read.
    sizes = [f.stat().st_size + 1 for f in files]
    stream_len = min(sum(sizes), max_bytes) if max_bytes else sum(sizes)
    num_rows = stream_len // row_len
    val_rows = int(num_rows * val_fraction) if val_fraction else 0
    if val_fraction and val_rows == 0:
        val_rows = 1
    train_rows = num_rows - val_rows
    if train_rows < 1:
        raise DataError(f"{source}: {stream_len} bytes make {num_rows} rows of {row_len} tokens, "
                        f"too few for a dataset; add sources or lower row_len")

    out.mkdir(parents=True, exist_ok=True)
    train = _ShardWriter(out, row_len, rows_per_shard)
    val = None
    if val_rows:
        val_out.mkdir(exist_ok=True)
        val = _ShardWriter(val_out, row_len, rows_per_shard)

    train_bytes, total_bytes = train_rows * row_len, num_rows * row_len
    seen = 0  # stream bytes cut into rows so far
    streamed = 0  # stream bytes read so far
    pending = bytearray()  # bytes not yet a whole row
    for chunk in _byte_stream(files, max_bytes):
        streamed += len(chunk)
        pending += chunk
        whole = (len(pending) // row_len) * row_len
        # split at the train/val boundary; the stream is cut at total_bytes (tail dropped)
        start = seen
        end = min(seen + whole, total_bytes)
        if end > start:
            cut_train = max(0, min(end, train_bytes) - start)
            if cut_train:
                train.add(bytes(pending[:cut_train]))
            if end - start > cut_train:
                val.add(bytes(pending[cut_train:end - start]))
        del pending[:whole]
        seen += whole
    if streamed != stream_len:
        raise DataError(f"{source}: files changed while being read ({streamed} bytes read, "
                        f"{stream_len} expected); run prepare-data again")

    extra = {
        "separator_byte": FILE_SEPARATOR,
        "num_files": len(files),
        "stream_bytes": stream_len,
        "max_bytes": max_bytes,
        "rows_per_shard": rows_per_shard,
    }
    if val is not None:
        val_shards = val.close()
        val_manifest = DatasetManifest(format=TOKENS_FORMAT, row_len=row_len,
                                       shards=tuple(val_shards), source=f"{source} [val split]",
                                       extra={**extra, "split": "val", "first_stream_row": train_rows})
        _write_atomic(val_out / MANIFEST_NAME, val_manifest.to_json().encode())
        _remove_stale_shards(val_out, {s.path for s in val_shards})
        extra["val_path"] = VAL_DIR
        extra["val_num_rows"] = val_rows
    else:
        _remove_stale_shards(val_out, set())
        if val_out.is_dir() and not any(val_out.iterdir()):
            val_out.rmdir()
    train_shards = train.close()
    manifest = DatasetManifest(format=TOKENS_FORMAT, row_len=row_len, shards=tuple(train_shards),
                               source=source, extra={**extra, "split": "train"})
    _write_atomic(out / MANIFEST_NAME, manifest.to_json().encode())
    _remove_stale_shards(out, {s.path for s in train_shards})
    return manifest


# ----------------------------------------------------------------------------- documents

DOC_GROUP_ROWS = 16  # documents per row group = data.shuffle_block_rows for a documents dataset
DOCUMENT_LENGTHS_NAME = "document_lengths.u32"


class _DocumentShardWriter:
    """Fills shard-NNNNN.parquet files with one document per row, docs_per_shard at a time."""

    def __init__(self, out_dir: Path, docs_per_shard: int):
        self.out_dir, self.docs_per_shard = out_dir, docs_per_shard
        self.pending: list[bytes] = []
        self.shards: list[ShardInfo] = []
        self.lengths: list[int] = []

    def add(self, document: bytes) -> None:
        self.pending.append(document)
        self.lengths.append(len(document))
        if len(self.pending) == self.docs_per_shard:
            self._write()

    def close(self) -> list[ShardInfo]:
        if self.pending:
            self._write()
        return self.shards

    def _write(self) -> None:
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"tokens": pa.array(self.pending, type=pa.binary())}), sink,
                       row_group_size=DOC_GROUP_ROWS,  # a permuted block of documents = one read
                       compression="zstd", use_dictionary=False, write_statistics=False,
                       write_page_checksum=True)
        blob = sink.getvalue().to_pybytes()
        name = f"shard-{len(self.shards):05d}.parquet"
        _write_atomic(self.out_dir / name, blob)
        self.shards.append(ShardInfo(path=name, num_rows=len(self.pending), num_bytes=len(blob),
                                     sha256=hashlib.sha256(blob).hexdigest()))
        self.pending = []

    def write_lengths(self) -> dict:
        """The length index, little-endian uint32 per document in sample id order."""
        import numpy as np

        if self.lengths and max(self.lengths) >= 2**32:
            raise DataError("a document of 4 GiB or more does not fit the uint32 length index")
        blob = np.asarray(self.lengths, dtype="<u4").tobytes()
        _write_atomic(self.out_dir / DOCUMENT_LENGTHS_NAME, blob)
        return {"path": DOCUMENT_LENGTHS_NAME, "num_bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest()}


def prepare_documents_dataset(
    out_dir: str,
    sources: list[str] | None = None,
    docs_per_shard: int = 256,  # stdlib files average ~14 KB: ~3.5 MB of tokens per shard
    max_bytes: int = 0,
    val_fraction: float = 0.0,
    overwrite: bool = False,
) -> DatasetManifest:
    """Write a documents dataset to out_dir and return its manifest.

    One document per source file: its raw bytes then FILE_SEPARATOR (the end-of-document token),
    files in the same sorted order and under the same max_bytes cap (the last document cut there)
    as ``prepare_text_dataset``. Documents keep their own lengths: packing or length bucketing
    makes rows of them at training time (``data.sequences``), for any block_size. Shards first,
    then the length index, the manifest last. val_fraction: the last documents go to
    ``<out_dir>/val``, a documents dataset of their own.
    """
    from raytrain_sys.data.manifest import DOCUMENTS_FORMAT

    if docs_per_shard < 1:
        raise DataError(f"docs_per_shard must be positive, got {docs_per_shard}")
    _check_cap_and_split(max_bytes, val_fraction)
    out = Path(out_dir).expanduser()
    val_out = out / VAL_DIR
    _unpublish(out, val_out, overwrite)
    files, source = _source_files(sources)
    # How many documents the cap keeps decides the train/val boundary before any byte is read.
    num_docs, total = 0, 0
    for f in files:
        num_docs += 1
        total += f.stat().st_size + 1
        if max_bytes and total >= max_bytes:
            break
    val_docs = max(1, int(num_docs * val_fraction)) if val_fraction else 0
    train_docs = num_docs - val_docs
    if train_docs < 1:
        raise DataError(f"{source}: {num_docs} documents leave none for training; add sources")

    out.mkdir(parents=True, exist_ok=True)
    train = _DocumentShardWriter(out, docs_per_shard)
    val = None
    if val_docs:
        val_out.mkdir(exist_ok=True)
        val = _DocumentShardWriter(val_out, docs_per_shard)
    seen = 0
    for document in _byte_stream(files, max_bytes):
        (train if seen < train_docs else val).add(document)
        seen += 1
    if seen != num_docs:
        raise DataError(f"{source}: files changed while being read ({seen} documents read, "
                        f"{num_docs} expected); run prepare-data again")

    extra = {"separator_byte": FILE_SEPARATOR, "num_files": num_docs, "max_bytes": max_bytes,
             "docs_per_shard": docs_per_shard}
    if val is not None:
        val_shards = val.close()
        val_manifest = DatasetManifest(
            format=DOCUMENTS_FORMAT, row_len=0, shards=tuple(val_shards),
            source=f"{source} [val split]",
            extra={**extra, "split": "val", "num_tokens": sum(val.lengths),
                   "document_lengths": val.write_lengths()})
        _write_atomic(val_out / MANIFEST_NAME, val_manifest.to_json().encode())
        _remove_stale_shards(val_out, {s.path for s in val_shards})
        extra["val_path"], extra["val_num_rows"] = VAL_DIR, val_docs
    else:
        _remove_stale_shards(val_out, set())
        (val_out / DOCUMENT_LENGTHS_NAME).unlink(missing_ok=True)
        if val_out.is_dir() and not any(val_out.iterdir()):
            val_out.rmdir()
    train_shards = train.close()
    manifest = DatasetManifest(format=DOCUMENTS_FORMAT, row_len=0, shards=tuple(train_shards),
                               source=source,
                               extra={**extra, "split": "train", "num_tokens": sum(train.lengths),
                                      "document_lengths": train.write_lengths()})
    _write_atomic(out / MANIFEST_NAME, manifest.to_json().encode())
    _remove_stale_shards(out, {s.path for s in train_shards})
    return manifest


# ----------------------------------------------------------------------------- read

def verify_shards(root: str | Path, manifest: DatasetManifest) -> None:
    """Raise DataError naming the first shard that is missing, truncated or altered."""
    from raytrain_sys.data.storage import ShardChecksumError, check_sha256

    for s in manifest.shards:
        path = Path(root) / s.path
        try:
            with open(path, "rb") as f:  # streamed through sha256: a shard is never held whole
                check_sha256(f, s.num_bytes, s.sha256)
        except OSError as exc:
            raise DataError(f"shard {path} listed in the manifest cannot be read ({exc}); "
                            f"re-create the dataset with `raytrain-sys prepare-data`") from None
        except ShardChecksumError:
            raise DataError(f"shard {path} does not match its manifest entry (size or sha256); "
                            f"re-create the dataset with `raytrain-sys prepare-data`") from None


# ----------------------------------------------------------------------------- webdataset

TAR_PATTERN = re.compile(r"shard-\d{5}\.tar(\.idx)?")


def _remove_stale_tars(directory: Path, keep: set[str]) -> None:
    if directory.is_dir():
        for p in directory.iterdir():
            if TAR_PATTERN.fullmatch(p.name) and p.name.removesuffix(".idx") not in keep:
                p.unlink()


def prepare_digits_dataset(
    out_dir: str,
    samples_per_shard: int = 256,  # ~7 shards for the 1797 digits: several shards to permute
    val_fraction: float = 0.1,
    limit: int = 0,
    overwrite: bool = False,
) -> DatasetManifest:
    """scikit-learn's bundled 8x8 digits (offline) as WebDataset tar shards plus a manifest.

    Each sample is ``<key>.npy`` (float32 image of shape (1, 8, 8), pixel values scaled from
    0..16 to 0..1) and ``<key>.cls`` (the digit). Samples are in a fixed seeded shuffle of the
    bundled order (that order is sorted by writer, not by class, but a shuffle makes the val split
    representative); the last ``val_fraction`` go to ``<out_dir>/val``. ``limit`` keeps only the
    first samples of that shuffle (tests). Shards first, manifest last, as for token datasets.
    """
    from raytrain_sys.data.manifest import WEBDATASET_FORMAT
    from raytrain_sys.data.webdataset import encode_field, write_tar_shard

    if samples_per_shard < 1:
        raise DataError(f"samples_per_shard must be positive, got {samples_per_shard}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the digits dataset comes from scikit-learn: pip install scikit-learn") from None
    import numpy as np

    out = Path(out_dir).expanduser()
    val_out = out / VAL_DIR
    if (out / MANIFEST_NAME).exists() and not overwrite:
        raise DataError(f"{out} already holds a dataset ({MANIFEST_NAME}); choose another "
                        f"directory or pass overwrite=True (--overwrite)")
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    (val_out / MANIFEST_NAME).unlink(missing_ok=True)

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    if limit:
        order = order[:limit]
    images = (digits.images[order] / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    labels = digits.target[order].astype(np.int64)
    n_val = int(round(len(order) * val_fraction))
    n_train = len(order) - n_val
    if n_train < 1:
        raise DataError(f"limit={limit} leaves no training samples")
    fields = {"image": "npy", "label": "cls"}
    extra = {"fields": fields, "num_classes": 10, "image_shape": [1, 8, 8],
             "index_suffix": ".idx", "samples_per_shard": samples_per_shard}

    def write(directory: Path, lo: int, hi: int, split: str) -> DatasetManifest:
        directory.mkdir(parents=True, exist_ok=True)
        shards = []
        for s, start in enumerate(range(lo, hi, samples_per_shard)):
            stop = min(start + samples_per_shard, hi)
            # The key is the sample's index in the bundled set: ids stay traceable to the source.
            samples = ((f"{int(order[i]):06d}", {"npy": encode_field("npy", images[i]),
                                                 "cls": encode_field("cls", labels[i])})
                       for i in range(start, stop))
            shards.append(write_tar_shard(directory / f"shard-{s:05d}.tar", samples, _write_atomic))
        manifest = DatasetManifest(format=WEBDATASET_FORMAT, row_len=0, shards=tuple(shards),
                                   source=f"sklearn.datasets.load_digits [{split} split]",
                                   extra={**extra, "split": split})
        _write_atomic(directory / MANIFEST_NAME, manifest.to_json().encode())
        _remove_stale_tars(directory, {sh.path for sh in shards})
        return manifest

    if n_val:
        write(val_out, n_train, len(order), "val")
        extra["val_path"], extra["val_num_rows"] = VAL_DIR, n_val
    return write(out, 0, n_train, "train")
