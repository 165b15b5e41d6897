"""WebDataset tar shards: writing them with a seek index, and reading any row range by seeking.

A WebDataset shard is a plain tar file whose members are grouped into samples by key: the member
``000042.npy`` and ``000042.cls`` are the ``npy`` and ``cls`` fields of sample ``000042``. Samples
are consecutive, so a sample is one contiguous byte range of the tar.

Next to each shard ``shard-00000.tar`` we store ``shard-00000.tar.idx``: ``num_rows + 1``
little-endian int64 byte offsets, the offset of each sample's first tar header and, last, the end
of the last sample. Reading rows ``[a, b)`` of a shard is then one ranged read of bytes
``[idx[a], idx[b])`` (one GET on S3): a resume mid-shard seeks, it never reads the samples before
it. The index is a function of the shard's bytes: the first time a process opens a shard it hashes
the tar against the manifest's sha256 and, in the same pass, derives the index from the tar's
members; the .idx file must be exactly that. A shard whose size differs from the manifest is
reported as truncated before any byte of it is parsed.

Why not ``ray.data.read_webdataset``: it reads whole tar files, in file order, with Ray Data
deciding which block comes out when; a resume mid-shard would read and drop everything before the
cursor, and the order would not be our plan's. The data plane therefore runs this reader inside its
own read tasks over window descriptors, exactly like the Parquet path.

Runs inside the data plane's read tasks (possibly on CPU-only nodes) and in tests; no Ray import.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from raytrain_sys.data import storage
from raytrain_sys.data.manifest import DatasetManifest, ShardInfo
from raytrain_sys.data.order import Segment
from raytrain_sys.data.storage import filesystem

INDEX_SUFFIX = ".idx"
_BLOCK = 512  # tar block size


class TarFormatError(ValueError):
    """Bytes that are not the tar members the index promises."""


# ----------------------------------------------------------------------------- encode / decode

def encode_field(ext: str, value) -> bytes:
    """A field's bytes by WebDataset extension convention."""
    if ext == "npy":
        buf = io.BytesIO()
        np.save(buf, np.asarray(value), allow_pickle=False)
        return buf.getvalue()
    if ext in ("cls", "cls2", "index", "label"):
        return str(int(value)).encode()
    if ext == "txt":
        return str(value).encode()
    if ext == "json":
        return json.dumps(value).encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise ValueError(f"no encoder for field extension {ext!r}")


def _decode_image(data: bytes) -> np.ndarray:
    from PIL import Image  # only for png/jpg shards

    return np.asarray(Image.open(io.BytesIO(data)))


DECODERS: dict[str, Callable[[bytes], object]] = {
    "npy": lambda b: np.load(io.BytesIO(b), allow_pickle=False),
    "cls": lambda b: int(b.strip()),
    "cls2": lambda b: int(b.strip()),
    "index": lambda b: int(b.strip()),
    "label": lambda b: int(b.strip()),
    "txt": lambda b: b.decode("utf-8"),
    "json": lambda b: json.loads(b),
    "png": _decode_image,
    "jpg": _decode_image,
    "jpeg": _decode_image,
}


def _column(values: list, ext: str) -> np.ndarray:
    if ext in ("cls", "cls2", "index", "label"):
        return np.asarray(values, dtype=np.int64)
    if values and isinstance(values[0], np.ndarray):
        return np.stack(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


# ----------------------------------------------------------------------------- write

def _split_key(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the last component."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot:
        raise TarFormatError(f"member {name!r} has no field extension")
    return (f"{head}/{stem}" if head else stem), ext


def write_tar_shard(path: Path, samples: Iterable[tuple[str, dict[str, bytes]]],
                    write: Callable[[Path, bytes], None]) -> ShardInfo:
    """Write (key, {ext: bytes}) samples as one tar shard plus its index; return its manifest entry.

    Deterministic bytes (mtime 0, no owner names), so the same samples give the same sha256.
    """
    buf = io.BytesIO()
    offsets = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for key, fields in samples:
            offsets.append(tf.offset)
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tf.addfile(info, io.BytesIO(data))
        offsets.append(tf.offset)  # end of the last sample = start of the end-of-archive blocks
    blob = buf.getvalue()
    write(path, blob)
    write(path.with_name(path.name + INDEX_SUFFIX), np.asarray(offsets, dtype="<i8").tobytes())
    return ShardInfo(path=path.name, num_rows=len(offsets) - 1, num_bytes=len(blob),
                     sha256=hashlib.sha256(blob).hexdigest())


# ----------------------------------------------------------------------------- read

def _octal(field: bytes) -> int:
    field = field.rstrip(b"\0 ").strip()
    try:
        return int(field, 8) if field else 0
    except ValueError:
        raise TarFormatError(f"not a tar header (numeric field {field[:12]!r})") from None


def parse_members(blob: bytes) -> list[tuple[str, bytes]]:
    """(name, data) of the regular-file members in ``blob``, a run of whole tar members.

    Checks every header's checksum; supports the GNU long-name and pax path records that tar
    tools write for long names. Raises TarFormatError on anything else.
    """
    out = []
    pos, n = 0, len(blob)
    long_name = None
    while pos < n:
        header = blob[pos:pos + _BLOCK]
        if len(header) < _BLOCK:
            raise TarFormatError(f"truncated tar header at byte {pos}")
        if header == b"\0" * _BLOCK:
            raise TarFormatError(f"end-of-archive block inside the indexed range at byte {pos}")
        stored = _octal(header[148:156])
        actual = sum(header[:148]) + 8 * 32 + sum(header[156:])
        if stored != actual:
            raise TarFormatError(f"bad tar header checksum at byte {pos}")
        size = _octal(header[124:136])
        kind = header[156:157]
        name = header[:100].split(b"\0", 1)[0]
        if header[257:262] == b"ustar":
            prefix = header[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix + b"/" + name
        start = pos + _BLOCK
        data = blob[start:start + size]
        if len(data) < size:
            raise TarFormatError(f"member {name.decode(errors='replace')!r} is truncated")
        pos = start + -(-size // _BLOCK) * _BLOCK
        if kind == b"L":  # GNU long name for the next member
            long_name = data.split(b"\0", 1)[0]
            continue
        if kind in (b"x", b"g"):  # pax records: "<len> key=value\n"
            for rec in data.split(b"\n"):
                _, _, kv = rec.partition(b" ")
                if kv.startswith(b"path="):
                    long_name = kv[len(b"path="):]
            continue
        if long_name is not None:
            name, long_name = long_name, None
        if kind in (b"0", b"\0"):
            out.append((name.decode("utf-8"), data))
    return out


def sample_offsets(stream) -> np.ndarray:
    """The seek index a tar's bytes imply (what ``write_tar_shard`` writes beside it): the offset
    of each sample's first header, then of the end-of-archive block. ``stream``: read() only."""
    offsets, last_key = [], None
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tf:
            for member in tf:
                if not member.isreg():
                    continue
                key, _ = _split_key(member.name)
                if key != last_key:
                    offsets.append(member.offset)  # a long name's header, if it has one
                    last_key = key
            offsets.append(tf.offset)  # where the reader met the end-of-archive block
    except tarfile.TarError as exc:
        raise TarFormatError(f"not a tar archive ({exc})") from None
    return np.asarray(offsets, dtype="<i8")


@lru_cache(maxsize=64)
def _shard_index(dataset_uri: str, s3_endpoint_url: str, rel_path: str, num_rows: int,
                 num_bytes: int, sha256: str, verify_sha256: bool = True) -> np.ndarray:
    fs, root = filesystem(dataset_uri, s3_endpoint_url)
    index_sha256 = None
    with fs.open_input_file(f"{root}/{rel_path}") as f:
        if f.size() != num_bytes:
            raise TarFormatError(f"is {f.size()} bytes, the manifest says {num_bytes} (truncated "
                                 f"or replaced)")
        if verify_sha256:
            index_sha256 = storage.verified(dataset_uri, rel_path, sha256)
            if index_sha256 is None:  # first open in this process: hash it, derive its index
                derived = storage.check_sha256(f, num_bytes, sha256, parse=sample_offsets)
                index_sha256 = hashlib.sha256(derived.tobytes()).hexdigest()
                storage.remember(dataset_uri, rel_path, sha256, index_sha256)
    try:
        with fs.open_input_file(f"{root}/{rel_path}{INDEX_SUFFIX}") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TarFormatError(f"its seek index {rel_path}{INDEX_SUFFIX} is missing") from None
    idx = np.frombuffer(raw, dtype="<i8")
    if (len(raw) % 8 or len(idx) != num_rows + 1 or idx[0] != 0 or idx[-1] > num_bytes
            or np.any(np.diff(idx) <= 0)):
        raise TarFormatError(f"its seek index {rel_path}{INDEX_SUFFIX} does not match the manifest "
                             f"({len(idx)} offsets for {num_rows} samples)")
    if index_sha256 is not None and hashlib.sha256(raw).hexdigest() != index_sha256:
        raise TarFormatError(f"its seek index {rel_path}{INDEX_SUFFIX} does not match the shard's "
                             f"samples (altered, or another shard's)")
    return idx


def read_segment(dataset_uri: str, manifest: DatasetManifest, seg: Segment,
                 s3_endpoint_url: str = "", verify_sha256: bool = True) -> dict[str, np.ndarray]:
    """Rows ``[seg.row_start, seg.row_end)`` of a tar shard as columns: one ranged read (after
    the whole shard's sha256, once per process, unless ``verify_sha256`` is False).

    Columns are the manifest's ``extra["fields"]`` (column name -> member extension), decoded by
    extension (npy arrays are stacked, class labels become int64).
    """
    shard = manifest.shards[seg.shard]
    fields: dict[str, str] = manifest.extra["fields"]
    idx = _shard_index(dataset_uri, s3_endpoint_url, shard.path, shard.num_rows, shard.num_bytes,
                       shard.sha256, verify_sha256)
    lo, hi = int(idx[seg.row_start]), int(idx[seg.row_end])
    fs, root = filesystem(dataset_uri, s3_endpoint_url)
    with fs.open_input_file(f"{root}/{shard.path}") as f:
        blob = f.read_at(hi - lo, lo)
    if len(blob) != hi - lo:
        raise TarFormatError(f"short read: {len(blob)} of {hi - lo} bytes at offset {lo}")
    samples: list[dict[str, bytes]] = []
    last_key = None
    for name, data in parse_members(blob):
        key, ext = _split_key(name)
        if key != last_key:
            samples.append({})
            last_key = key
        samples[-1][ext] = data
    want = seg.row_end - seg.row_start
    if len(samples) != want:
        raise TarFormatError(f"bytes {lo}..{hi} hold {len(samples)} samples, the index says {want}")
    columns = {}
    for column, ext in fields.items():
        try:
            values = [DECODERS[ext](s[ext]) for s in samples]
        except KeyError:
            raise TarFormatError(f"a sample lacks its .{ext} member (column {column!r})") from None
        except (ValueError, OSError, EOFError) as exc:
            raise TarFormatError(f"cannot decode a .{ext} member: {exc}") from None
        columns[column] = _column(values, ext)
    return columns


def clear_caches() -> None:
    _shard_index.cache_clear()
