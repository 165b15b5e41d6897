"""Where shard bytes come from, and the check that they are the bytes the manifest recorded.

Owns ``filesystem`` (the one way to reach a dataset, local or ``s3://``) and this process's
record of the shards whose sha256 it has verified. ``shards.py`` (Parquet) and ``webdataset.py``
(tar) both read through it and it imports neither, so their imports run one way:
shards -> webdataset -> storage.

Why a sha256 on top of Parquet's page checksums: a page checksum covers a page's bytes only, not
the footer's metadata (row counts, offsets, the schema), and a shard written before prepare-data
wrote checksums has none; tar shards have no data checksum at all (a tar header's covers the
header). The manifest's sha256 covers every byte. Reading a whole shard to hash it is paid once
per shard per reader process: ``verify_once`` remembers a success, keyed by (dataset, shard,
sha256), never a failure. A shard changed in place after its process hashed it is seen only by
Parquet's page checksums (or the tar's own header checks), until a read of it fails.

The cost, measured on a loaded 2-core machine: sha256 runs at 0.8-1.7 GB/s, so local shards cost
~1 ms per MB once (the stdlib's 10 shards, 3.1 MB: 2 ms per process, lost in the noise of time
to first batch). On S3 hashing is bound by the read, not the hash: a 64 MiB object took 0.71 s
to verify and 0.72 s to read without hashing (local SeaweedFS, one stream, ~93 MB/s). So the
price there is one whole extra read of each shard per reader process, paid when the process
first touches it: the first window touching K shards of S bytes waits K x S / bandwidth more
(16 shards of 100 MB at 90 MB/s: ~18 s), and each reader process that touches a shard reads
it once more (plane.py runs READERS of them per stream). Kept on S3 too, deliberately: a flipped byte there trains on garbage as silently as on
disk, and the cost is once per process, not per epoch or per seek. If it must go for large S3
shards, ``verify_sha256=False`` in ``read_columns`` is the page-checksum-only path to extend.

Runs inside the data plane's read tasks (possibly on CPU-only nodes) and in tests; no Ray import.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, TypeVar

import pyarrow.fs as pafs

# One ranged GET per 8 MiB on S3 (a 100 MB shard in 13 requests); locally, large enough that the
# per-read overhead vanishes next to hashing (~0.5 ms of sha256 per MiB).
HASH_CHUNK_BYTES = 8 * 2**20

T = TypeVar("T")


class ShardChecksumError(ValueError):
    """A shard's bytes are not the ones the manifest recorded (a ValueError, as every other
    "this shard is bad" finding of the readers, so they report it as a bad shard)."""


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


class HashingReader:
    """A file read front to back through sha256, in chunks of ``HASH_CHUNK_BYTES``.

    ``read(n)`` serves small reads (tarfile's 10 KiB records) from the current chunk, so a parser
    can walk the bytes as they are hashed without a request per read; ``drain`` hashes the rest.
    """

    def __init__(self, f, chunk_bytes: int = HASH_CHUNK_BYTES):
        self._f, self._chunk_bytes = f, chunk_bytes
        self._sha = hashlib.sha256()
        self._buf, self._pos = b"", 0
        self.num_bytes = 0  # bytes hashed so far
        self._eof = False

    def _fill(self) -> bytes:
        chunk = self._f.read(self._chunk_bytes)
        if not chunk:
            self._eof = True
        self._sha.update(chunk)
        self.num_bytes += len(chunk)
        return chunk

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self._buf) - self._pos < n) and not self._eof:
            self._buf, self._pos = self._buf[self._pos:] + self._fill(), 0
        end = len(self._buf) if n < 0 else self._pos + n
        out, self._pos = self._buf[self._pos:end], min(end, len(self._buf))
        return out

    def drain(self) -> None:
        self._buf, self._pos = b"", 0
        while not self._eof:
            self._fill()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def check_sha256(f, num_bytes: int, sha256: str,
                 parse: Callable[[HashingReader], T] | None = None) -> T | None:
    """Read all of the open file ``f`` and raise ShardChecksumError unless it is ``num_bytes``
    bytes with that sha256. ``parse``, if given, walks the bytes in the same pass (a tar's member
    offsets); its result is returned, its error raised only if the bytes are the right ones.
    """
    f.seek(0)
    reader = HashingReader(f)
    result, parse_error = None, None
    if parse is not None:
        try:
            result = parse(reader)
        except Exception as exc:  # reported below, unless the checksum has a better reason
            parse_error = exc
    reader.drain()
    actual = reader.hexdigest()
    if reader.num_bytes != num_bytes or actual != sha256:
        raise ShardChecksumError(f"its {reader.num_bytes} bytes have sha256 {actual[:12]}..., the "
                                 f"manifest says {num_bytes} bytes with sha256 {sha256[:12]}... "
                                 f"(changed after prepare-data wrote it)")
    if parse_error is not None:
        raise parse_error
    return result


# (dataset uri, shard path, sha256) -> what the check learnt beside it ("" or, for a tar shard,
# the sha256 of the seek index its bytes imply). Successes only: a bad shard is hashed again.
_verified: dict[tuple[str, str, str], str] = {}


def verified(dataset_uri: str, rel_path: str, sha256: str) -> str | None:
    """What was recorded when this process verified the shard, or None if it has not."""
    return _verified.get((dataset_uri, rel_path, sha256))


def remember(dataset_uri: str, rel_path: str, sha256: str, note: str = "") -> None:
    _verified[(dataset_uri, rel_path, sha256)] = note


def forget(dataset_uri: str, rel_path: str) -> None:
    """Hash the shard again at its next open: a read of it failed after it was verified."""
    for key in [k for k in _verified if k[:2] == (dataset_uri, rel_path)]:
        del _verified[key]


def verify_once(fs: pafs.FileSystem, root: str, dataset_uri: str, rel_path: str, num_bytes: int,
                sha256: str, opened=None) -> bool:
    """Check the shard's bytes against the manifest's sha256 unless this process already did.

    Returns whether it hashed. ``opened``: the shard, already open (saves an S3 HEAD request).
    Raises ShardChecksumError on a mismatch, FileNotFoundError if the shard is missing.
    """
    if verified(dataset_uri, rel_path, sha256) is not None:
        return False
    if opened is not None:
        check_sha256(opened, num_bytes, sha256)
    else:
        with fs.open_input_file(f"{root}/{rel_path}") as f:
            check_sha256(f, num_bytes, sha256)
    remember(dataset_uri, rel_path, sha256)
    return True
