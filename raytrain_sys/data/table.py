"""Your own Parquet files as a dataset: a manifest written beside them, the files never rewritten.

``index_parquet(dir_or_s3)`` (``raytrain-sys prepare-data --index``) lists the ``*.parquet``
files directly in a directory (sorted by path: the order sample ids follow), and records each file's
row count, row groups, size and sha256, and the dataset's schema, in ``manifest.json``
(``TABLE_FORMAT``). Every file must have the same schema.

Reading (``read_segment``, through ``shards.read_columns``) seeks by row group like token shards,
reads only the columns the job asks for (``data.columns``, recorded in the manifest the plane
hands its read tasks: ``select_columns``), and gives each column as a numpy array: numbers as
they are, fixed-length lists of numbers as 2-D arrays. A file whose schema is not the manifest's
stops the run with an error naming the file, before its rows are used; other changes to a file
(size, bytes) make it a bad shard (``data.on_bad_shard``).

``apply_transform`` runs ``data.transform`` on every row, inside the read tasks.

Runs in read tasks and on the driver; no Ray import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_sys.data import storage
from raytrain_sys.data.manifest import MANIFEST_NAME, TABLE_FORMAT, DatasetManifest, ShardInfo
from raytrain_sys.data.order import Segment
from raytrain_sys.data.storage import filesystem
from raytrain_sys.errors import DataError, SpecError

READ_COLUMNS_KEY = "read_columns"  # manifest.extra: the columns the job's reads deliver


def _schema_of(schema: pa.Schema) -> dict[str, str]:
    return {f.name: str(f.type) for f in schema}


def index_parquet(dataset_uri: str, s3_endpoint_url: str = "", overwrite: bool = False) -> DatasetManifest:
    """Write ``manifest.json`` for the Parquet files under ``dataset_uri`` (local or s3://)."""
    fs, root = filesystem(dataset_uri, s3_endpoint_url)
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=False))  # val/ etc. are datasets of their own
    except FileNotFoundError:
        raise DataError(f"{dataset_uri} does not exist") from None
    except OSError as exc:
        raise DataError(f"cannot list {dataset_uri}: {exc}") from None
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
    if not files:
        raise DataError(f"no *.parquet files under {dataset_uri}")
    if any(i.path == f"{root}/{MANIFEST_NAME}" for i in infos) and not overwrite:
        raise DataError(f"{dataset_uri} already has a {MANIFEST_NAME}; pass --overwrite to index it again")
    shards, schema, groups = [], None, []
    for path in files:
        rel = path[len(root) + 1:]
        with fs.open_input_file(path) as f:
            meta = pq.ParquetFile(f).metadata
            this = _schema_of(meta.schema.to_arrow_schema())
            if schema is None:
                schema, first = this, rel
            elif this != schema:
                raise DataError(f"{dataset_uri}/{rel} has schema {this}, {first} has {schema}: every "
                                f"file of a dataset must have the same columns and types")
            groups.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
            f.seek(0)
            sha = hashlib.sha256()
            size = 0
            while chunk := f.read(storage.HASH_CHUNK_BYTES):
                sha.update(chunk)
                size += len(chunk)
        shards.append(ShardInfo(rel, meta.num_rows, size, sha.hexdigest()))
    manifest = DatasetManifest(TABLE_FORMAT, 0, tuple(shards), source=dataset_uri,
                               extra={"schema": schema, "row_groups": groups})
    with fs.open_output_stream(f"{root}/{MANIFEST_NAME}") as out:
        out.write(manifest.to_json().encode())
    return manifest


def select_columns(manifest: DatasetManifest, columns: list[str], dataset_uri: str) -> DatasetManifest:
    """The manifest a job's reads use: ``data.columns`` checked against the schema and recorded."""
    if not columns:
        return manifest
    if manifest.format != TABLE_FORMAT:
        raise SpecError("data.columns", f"selects columns of a table dataset (prepare-data --index); "
                                        f"{dataset_uri} has format {manifest.format}")
    schema = manifest.extra.get("schema", {})
    missing = [c for c in columns if c not in schema]
    if missing:
        raise SpecError("data.columns", f"dataset {dataset_uri} has no column {', '.join(map(repr, missing))}"
                                        f" (it has {', '.join(schema)})")
    return dataclasses.replace(manifest, extra={**manifest.extra, READ_COLUMNS_KEY: list(columns)})


@lru_cache(maxsize=64)
def _open(dataset_uri: str, s3_endpoint_url: str, rel_path: str, num_bytes: int, sha256: str,
          schema_json: str, verify_sha256: bool):
    fs, root = filesystem(dataset_uri, s3_endpoint_url)
    f = fs.open_input_file(f"{root}/{rel_path}")
    pf = pq.ParquetFile(f)
    # The schema first: a file rewritten with other columns is an error of its own, not a
    # "corrupt shard" to be skipped.
    found, expected = _schema_of(pf.schema_arrow), json.loads(schema_json)
    if found != expected:
        changed = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
        detail = "; ".join(f"{k}: {expected.get(k, 'absent')} -> {found.get(k, 'absent')}" for k in changed)
        raise DataError(f"file {dataset_uri.rstrip('/')}/{rel_path} changed schema since its manifest "
                        f"was written ({detail}): re-run `raytrain-sys prepare-data --index "
                        f"{dataset_uri} --overwrite`")
    if f.size() != num_bytes:
        raise ValueError(f"is {f.size()} bytes, the manifest says {num_bytes} (truncated or replaced)")
    if verify_sha256:
        storage.verify_once(fs, root, dataset_uri, rel_path, num_bytes, sha256, opened=f)
    starts = np.concatenate([[0], np.cumsum([pf.metadata.row_group(i).num_rows
                                             for i in range(pf.metadata.num_row_groups)])])
    return pf, starts


def clear_caches() -> None:
    _open.cache_clear()


def to_numpy(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """Numbers as a 1-D array, fixed-length lists of numbers as a 2-D one; anything else (strings,
    ragged lists) as an object array, for ``data.transform`` to turn into numbers."""
    arr = column.combine_chunks()
    if arr.null_count:
        raise ValueError(f"column {name!r} has nulls")
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        lengths = np.asarray(arr.value_lengths()) if not pa.types.is_fixed_size_list(t) else None
        values = arr.flatten()
        if (lengths is None or len(set(lengths.tolist())) <= 1) and \
                (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
            width = t.list_size if lengths is None else (int(lengths[0]) if len(lengths) else 0)
            return values.to_numpy(zero_copy_only=False).reshape(len(arr), width)
        return np.asarray(arr.to_pylist(), dtype=object)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return arr.to_numpy(zero_copy_only=False)
    return np.asarray(arr.to_pylist(), dtype=object)


def read_segment(dataset_uri: str, manifest: DatasetManifest, seg: Segment, s3_endpoint_url: str = "",
                 verify_sha256: bool = True) -> dict[str, np.ndarray]:
    shard = manifest.shards[seg.shard]
    schema = manifest.extra.get("schema", {})
    pf, starts = _open(dataset_uri, s3_endpoint_url, shard.path, shard.num_bytes, shard.sha256,
                       json.dumps(schema, sort_keys=True), verify_sha256)
    if int(starts[-1]) != shard.num_rows:
        raise ValueError(f"holds {int(starts[-1])} rows, the manifest says {shard.num_rows}")
    columns = manifest.extra.get(READ_COLUMNS_KEY) or list(schema)
    first = int(np.searchsorted(starts, seg.row_start, side="right")) - 1
    last = int(np.searchsorted(starts, seg.row_end, side="left"))
    table = pf.read_row_groups(list(range(first, last)), columns=columns, use_threads=False)
    lo = seg.row_start - int(starts[first])
    table = table.slice(lo, seg.row_end - seg.row_start)
    return {c: to_numpy(table.column(c), c) for c in columns}


def apply_transform(fn, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``data.transform`` on every row: ``fn({column: value})`` -> a dict of the row's new
    columns; their values are stacked into the batch's columns."""
    n = len(next(iter(columns.values()))) if columns else 0
    rows = [fn({k: v[i] for k, v in columns.items()}) for i in range(n)]
    if not rows:
        return columns
    if not isinstance(rows[0], dict):
        raise DataError(f"data.transform returned a {type(rows[0]).__name__}; it must return a dict "
                        f"of column name -> value for the row")
    keys = list(rows[0])
    try:
        return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in keys}
    except (KeyError, ValueError) as exc:
        raise DataError(f"data.transform returned rows that do not stack into columns ({exc}): "
                        f"every row must give the same keys, with values of one shape") from None
