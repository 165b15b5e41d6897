"""Reading rows out of shards by (shard, row range): seek, never read-and-discard.

Parquet token shards are read here; WebDataset tar shards in ``webdataset.py``; ``read_columns``
is the one entry point for both.

Runs inside Ray Data tasks (possibly on CPU-only nodes) and in tests; no Ray import.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_sys.data.manifest import (MANIFEST_NAME, TOKENS_FORMAT, WEBDATASET_FORMAT,
                                        DatasetManifest)
from raytrain_sys.data.order import Segment
from raytrain_sys.errors import DataError


def filesystem(uri: str, s3_endpoint_url: str = "") -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or ``s3://bucket/prefix``.

    pyarrow ignores AWS_ENDPOINT_URL, so the endpoint is passed explicitly.
    """
    if uri.startswith("s3://"):
        endpoint = s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
        kwargs = {}
        if endpoint:
            scheme, _, host = endpoint.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        fs = pafs.S3FileSystem(region=region, connect_timeout=5, request_timeout=30, **kwargs)
        return fs, uri[len("s3://"):].rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def read_manifest(dataset_uri: str, s3_endpoint_url: str = "") -> DatasetManifest:
    fs, root = filesystem(dataset_uri, s3_endpoint_url)
    where = f"{dataset_uri.rstrip('/')}/{MANIFEST_NAME}"
    try:
        with fs.open_input_stream(f"{root}/{MANIFEST_NAME}") as f:
            text = f.read().decode()
    except FileNotFoundError:
        raise DataError(f"no dataset at {dataset_uri} ({MANIFEST_NAME} not found): "
                        f"create it with `raytrain-sys prepare-data --out {dataset_uri}` "
                        f"or set data.path") from None
    except OSError as exc:
        raise DataError(f"cannot read {where}: {exc}") from None
    return DatasetManifest.from_json(text, where)


@lru_cache(maxsize=64)
def _open_shard(dataset_uri: str, s3_endpoint_url: str, rel_path: str, num_bytes: int):
    fs, root = filesystem(dataset_uri, s3_endpoint_url)
    f = fs.open_input_file(f"{root}/{rel_path}")
    # A size check first: a truncated or replaced shard is bad as a whole, before any row is read.
    if f.size() != num_bytes:
        raise ValueError(f"is {f.size()} bytes, the manifest says {num_bytes} (truncated or replaced)")
    pf = pq.ParquetFile(f)
    starts = np.concatenate([[0], np.cumsum([pf.metadata.row_group(i).num_rows
                                             for i in range(pf.metadata.num_row_groups)])])
    return pf, starts


def _tokens_array(column: pa.ChunkedArray, row_len: int) -> np.ndarray:
    arr = column.combine_chunks()
    if arr.null_count:
        raise ValueError("null rows")
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
    return raw[arr.offset * row_len:(arr.offset + len(arr)) * row_len].reshape(len(arr), row_len)


class BadShardError(DataError):
    """A shard that is missing, truncated or corrupt; ``shard`` is its index in the manifest.

    Survives pickling through Ray tasks with its fields, so the data plane can apply
    ``data.on_bad_shard`` to the right shard.
    """

    def __init__(self, message: str, shard: int = -1, path: str = ""):
        super().__init__(message)
        self.shard, self.path = shard, path

    def __reduce__(self):
        return (BadShardError, (str(self), self.shard, self.path))


def _read_token_rows(dataset_uri: str, manifest: DatasetManifest, seg: Segment,
                     s3_endpoint_url: str) -> np.ndarray:
    shard = manifest.shards[seg.shard]
    pf, starts = _open_shard(dataset_uri, s3_endpoint_url, shard.path, shard.num_bytes)
    if int(starts[-1]) != shard.num_rows:
        raise ValueError(f"holds {int(starts[-1])} rows, the manifest says {shard.num_rows}")
    first = int(np.searchsorted(starts, seg.row_start, side="right")) - 1
    last = int(np.searchsorted(starts, seg.row_end, side="left"))
    table = pf.read_row_groups(list(range(first, last)), columns=["tokens"])
    rows = _tokens_array(table.column("tokens"), manifest.row_len)
    lo = seg.row_start - int(starts[first])
    return rows[lo: lo + (seg.row_end - seg.row_start)]


def _bad_shard(dataset_uri: str, manifest: DatasetManifest, seg: Segment, what: str) -> BadShardError:
    _open_shard.cache_clear()
    from raytrain_sys.data import webdataset

    webdataset.clear_caches()
    shard = manifest.shards[seg.shard]
    return BadShardError(f"shard {shard.path} of dataset {dataset_uri} {what} (sample ids "
                         f"{seg.first_id}..): restore it or re-run prepare-data",
                         seg.shard, shard.path)


def read_columns(dataset_uri: str, manifest: DatasetManifest, seg: Segment,
                 s3_endpoint_url: str = "") -> dict[str, np.ndarray]:
    """The rows of one segment as named columns, whatever the dataset's format.

    Seeks: token shards read only the row groups the segment spans; tar shards one byte range.
    Raises BadShardError naming the shard on a missing, truncated or corrupt shard.
    """
    from raytrain_sys.data import webdataset

    try:
        if manifest.format == TOKENS_FORMAT:
            return {"tokens": _read_token_rows(dataset_uri, manifest, seg, s3_endpoint_url)}
        if manifest.format == WEBDATASET_FORMAT:
            return webdataset.read_segment(dataset_uri, manifest, seg, s3_endpoint_url)
    except FileNotFoundError:
        raise _bad_shard(dataset_uri, manifest, seg, "is missing") from None
    except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
        raise _bad_shard(dataset_uri, manifest, seg, f"is corrupt or truncated: {exc}") from None
    raise DataError(f"dataset {dataset_uri} has format {manifest.format!r}; this version reads "
                    f"{TOKENS_FORMAT} and {WEBDATASET_FORMAT}")


def read_segment(dataset_uri: str, manifest: DatasetManifest, seg: Segment,
                 s3_endpoint_url: str = "") -> np.ndarray:
    """Rows of one token-shard segment as a (rows, row_len) uint8 array."""
    return read_columns(dataset_uri, manifest, seg, s3_endpoint_url)["tokens"]
