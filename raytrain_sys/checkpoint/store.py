"""One storage abstraction for checkpoints and run artifacts: a local directory or an S3 prefix.

A ``Store`` is rooted at a URI and addresses files by keys relative to that root ("rel"), with
"/" as the separator on both backends. Keys behave like file paths: ``list("a")`` lists files
under the directory ``a/``, never ``ab/...``, so the two backends answer the same way.

Stores are shipped to Ray worker processes, so they hold only plain configuration; the boto3
client is created lazily in the process that uses it. Every failure of the environment (an
unreachable endpoint, refused credentials, a missing bucket, a full disk) surfaces as a
``StorageError`` that names the URI and says what to do.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import os
import shutil
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from raytrain_sys.errors import StorageError

log = logging.getLogger(__name__)

# Local writes go to a hidden sibling first and are renamed into place; list() skips these so a
# writer that died mid-file never shows up as a key.
_LOCAL_TMP_PREFIX = ".raytrain-tmp-"
_PROBE_PREFIX = ".raytrain-probe-"

# Connection errors are retried a few times (standard mode backs off up to 2**attempt s), so a
# refused or black-holed endpoint fails in about 3 * connect timeout + 3 s, well under 15 s.
S3_MAX_ATTEMPTS = 3
S3_CONNECT_TIMEOUT_S = 2.0
# Long enough for a loaded server to answer a part upload or a listing page; short enough that
# a hung server fails a call in about a minute rather than hanging the run.
S3_READ_TIMEOUT_S = 20.0
# Below 16 MiB a single PUT is cheaper; above it parallel parts win. 16 MiB parts keep a rank's
# few-hundred-MB file in enough parts to fill S3_MAX_CONCURRENCY connections (64 MiB parts left
# a 300 MB file at 5 parts), and 16 MiB x the 10,000-part S3 limit still allows 160 GB objects
# (s3transfer enlarges parts beyond that).
S3_MULTIPART_THRESHOLD_BYTES = 16 * 1024 * 1024
S3_MULTIPART_CHUNKSIZE_BYTES = 16 * 1024 * 1024
# Connections per transfer, per rank: every rank uploads its own file, so a node's total is
# this times its ranks; 10 is s3transfer's default and saturates ~10 Gbit/s to S3 per rank.
S3_MAX_CONCURRENCY = 10
# A part (or a ranged GET) is retried this many times with botocore's exponential backoff
# (standard mode: up to 2**attempt s, jittered): a throttled or reset part costs a retry, not
# the whole checkpoint. Single calls keep S3_MAX_ATTEMPTS, so a dead endpoint still fails fast.
S3_TRANSFER_MAX_ATTEMPTS = 6
# Large enough that copying a multi-GB checkpoint is not dominated by syscalls.
_COPY_BUFFER_BYTES = 16 * 1024 * 1024
# S3 rejects DeleteObjects requests with more keys than this.
_S3_DELETE_BATCH = 1000


class ObjectNotFoundError(StorageError):
    """The key does not exist in the store (a readable store, just not that file)."""


def _clean_rel(rel: str) -> str:
    """Normalize a relative key and refuse keys that would escape the store root."""
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ValueError(f"store key {rel!r} must not contain '..'")
    return "/".join(parts)


def _join(root: str, rel: str) -> str:
    rel = _clean_rel(rel)
    if not rel:
        return root
    return f"{root.rstrip('/')}/{rel}"


class Store(ABC):
    """Files under a root URI; every method takes keys relative to that root."""

    uri: str

    @abstractmethod
    def child(self, rel: str) -> Store:
        """A store of the same kind rooted at ``uri_of(rel)``."""

    def uri_of(self, rel: str) -> str:
        return _join(self.uri, rel)

    @abstractmethod
    def put_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole file; readers see either the old content or the new, never a part."""

    @abstractmethod
    def put_file(self, rel: str, local_path: str) -> None:
        """Upload a local file; large files go in parallel parts on S3."""

    @abstractmethod
    def get_bytes(self, rel: str, size_bytes: int | None = None) -> bytes:
        """Read a whole file; ``ObjectNotFoundError`` when it does not exist. ``size_bytes``:
        its size when the caller knows it (a manifest records it), so that a large file is read
        in parallel ranges without asking for its size first."""

    @abstractmethod
    def get_file(self, rel: str, local_path: str) -> None:
        """Download to ``local_path``, which appears only once complete."""

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def size(self, rel: str) -> int:
        """Size in bytes; ``ObjectNotFoundError`` when it does not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Keys (relative to the root) of all files under directory ``prefix``, sorted."""

    @abstractmethod
    def delete(self, rel: str) -> None:
        """Delete one file; a missing file is not an error."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every file under directory ``prefix``; an empty prefix clears the store."""

    def check_access(self) -> None:
        """Exercise every permission a run needs (write, read, list, delete) on a small probe,
        so a bad store fails before any resources are taken rather than at the first save."""
        probe = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        payload = b"raytrain-sys storage probe"
        self.put_bytes(probe, payload)
        try:
            if self.get_bytes(probe) != payload:
                raise StorageError(
                    f"storage at {self.uri} returned different bytes than were written to "
                    f"{probe}; check the storage backend for corruption or a caching proxy"
                )
            # Listing the (empty) directory named like the probe is cheap on any store size.
            self.list(probe)
        finally:
            self.delete(probe)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class LocalStore(Store):
    """A directory on a local or shared filesystem (NFS, FSx), addressed by absolute path."""

    def __init__(self, root: str):
        self.uri = os.path.abspath(root.removeprefix("file://"))

    def child(self, rel: str) -> LocalStore:
        return LocalStore(self.uri_of(rel))

    def _path(self, rel: str) -> str:
        rel = _clean_rel(rel)
        return os.path.join(self.uri, *rel.split("/")) if rel else self.uri

    @contextmanager
    def _os_errors(self, action: str, path: str) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError as e:
            raise ObjectNotFoundError(f"{action}: no such file {path}") from e
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(
                    f"disk full at {path} while trying to {action}: free space there or point "
                    f"the checkpoint storage at a larger volume"
                ) from e
            if e.errno in (errno.EACCES, errno.EPERM):
                raise StorageError(
                    f"permission denied at {path} while trying to {action}: make the directory "
                    f"writable for this user or choose another storage path"
                ) from e
            if e.errno == errno.EROFS:
                raise StorageError(
                    f"read-only filesystem at {path} while trying to {action}: choose a "
                    f"writable storage path"
                ) from e
            raise StorageError(f"cannot {action} at {path}: {e.strerror or e}") from e

    def _atomic_write(self, path: str, write: Any) -> None:
        """Write through a sibling temp file + fsync + rename, so a crash leaves no torn file."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp_name = f"{_LOCAL_TMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}"
        tmp = os.path.join(directory, tmp_name)
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with _ignore_missing():
                os.remove(tmp)
            raise
        # The rename is durable only once the directory entry is on disk.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def put_bytes(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        with self._os_errors("write", path):
            self._atomic_write(path, lambda f: f.write(data))

    def put_file(self, rel: str, local_path: str) -> None:
        path = self._path(rel)
        # Opened outside the error translation: a missing source is the caller's bug, not a
        # missing key in the store.
        with open(local_path, "rb") as src, self._os_errors("write", path):
            self._atomic_write(path, lambda f: shutil.copyfileobj(src, f, _COPY_BUFFER_BYTES))

    def get_bytes(self, rel: str, size_bytes: int | None = None) -> bytes:
        path = self._path(rel)
        with self._os_errors("read", path), open(path, "rb") as f:
            return f.read()

    def get_file(self, rel: str, local_path: str) -> None:
        path = self._path(rel)
        with self._os_errors("read", path), open(path, "rb") as src:
            # The destination is a local scratch path, but it gets the same no-torn-file rule.
            dest = os.path.abspath(local_path)
            with self._os_errors("write", dest):
                self._atomic_write(dest, lambda f: shutil.copyfileobj(src, f, _COPY_BUFFER_BYTES))

    def exists(self, rel: str) -> bool:
        return os.path.isfile(self._path(rel))

    def size(self, rel: str) -> int:
        path = self._path(rel)
        with self._os_errors("stat", path):
            return os.stat(path).st_size

    def list(self, prefix: str = "") -> builtins.list[str]:
        base = self._path(prefix)
        keys: list[str] = []
        # os.walk swallows errors by default, so a missing prefix lists as empty, like on S3.
        for dirpath, _dirnames, filenames in os.walk(base):
            for name in filenames:
                if name.startswith(_LOCAL_TMP_PREFIX):
                    continue
                full = os.path.join(dirpath, name)
                keys.append(os.path.relpath(full, self.uri).replace(os.sep, "/"))
        return sorted(keys)

    def delete(self, rel: str) -> None:
        path = self._path(rel)
        with self._os_errors("delete", path), _ignore_missing():
            os.remove(path)

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        with self._os_errors("delete", path), _ignore_missing():
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)

    def check_access(self) -> None:
        path = self.uri
        with self._os_errors("create the storage directory", path):
            os.makedirs(path, exist_ok=True)
        super().check_access()


@contextmanager
def _ignore_missing() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        pass


def _botocore_root(error: Exception) -> Exception:
    """The botocore error behind boto3's transfer wrappers, which drop the error code:
    S3UploadFailedError keeps it as the implicit context, RetriesExceededError as
    ``last_exception``."""
    from botocore.exceptions import BotoCoreError, ClientError

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, (ClientError, BotoCoreError)):
            return current
        seen.add(id(current))
        current = (
            getattr(current, "last_exception", None) or current.__cause__ or current.__context__
        )
    return error


_shared_loader: Any = None
_shared_loader_lock = threading.Lock()


def _new_boto3_session() -> Any:
    """A private boto3 session (sessions are not thread-safe, and each resolves credentials
    afresh) that reuses one process-wide loader of the read-only service model JSON, which
    otherwise costs ~150 ms per client."""
    import boto3
    import botocore.session

    global _shared_loader
    core = botocore.session.get_session()
    with _shared_loader_lock:
        if _shared_loader is None:
            _shared_loader = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _shared_loader)
    return boto3.session.Session(botocore_session=core)


class S3Store(Store):
    """Objects under ``s3://bucket/prefix`` on AWS or any S3-compatible endpoint.

    Credentials come from the standard AWS chain (env vars, profile, instance role) in the
    process that uses the store; only the endpoint travels with the object.
    """

    def __init__(
        self,
        uri: str,
        endpoint_url: str = "",
        multipart_threshold_bytes: int = S3_MULTIPART_THRESHOLD_BYTES,
        multipart_chunksize_bytes: int = S3_MULTIPART_CHUNKSIZE_BYTES,
    ):
        if not uri.startswith("s3://"):
            raise ValueError(f"S3Store needs an s3:// URI, got {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise StorageError(f"S3 URI {uri!r} names no bucket: use s3://<bucket>/<prefix>")
        self.bucket = bucket
        self.prefix = _clean_rel(prefix)
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.multipart_chunksize_bytes = multipart_chunksize_bytes
        self._client: Any = None
        self._transfer_client: Any = None
        self._client_lock = threading.Lock()

    # boto3 clients hold sockets and locks: drop them when shipped and rebuild on first use.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = state["_transfer_client"] = None
        del state["_client_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client_lock = threading.Lock()

    def child(self, rel: str) -> S3Store:
        return S3Store(
            self.uri_of(rel),
            self.endpoint_url,
            self.multipart_threshold_bytes,
            self.multipart_chunksize_bytes,
        )

    @property
    def _endpoint_name(self) -> str:
        return self.endpoint_url or "the default AWS S3 endpoint"

    def _key(self, rel: str) -> str:
        return _join(self.prefix, rel) if self.prefix else _clean_rel(rel)

    def _dir_key(self, prefix: str) -> str:
        """The listing prefix for directory ``prefix``: ends in '/' so 'a' never matches 'ab'."""
        key = self._key(prefix)
        return f"{key}/" if key else ""

    def client(self) -> Any:
        """The client of single calls (listings, HEADs, small objects)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._new_client(S3_MAX_ATTEMPTS)
        return self._client

    def transfer_client(self) -> Any:
        """The client of multipart transfers: more attempts per part (S3_TRANSFER_MAX_ATTEMPTS)
        and a connection pool as large as the transfer's concurrency."""
        if self._transfer_client is None:
            with self._client_lock:
                if self._transfer_client is None:
                    self._transfer_client = self._new_client(S3_TRANSFER_MAX_ATTEMPTS)
        return self._transfer_client

    def _new_client(self, max_attempts: int) -> Any:
        from botocore.config import Config

        config = Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=S3_CONNECT_TIMEOUT_S,
            read_timeout=S3_READ_TIMEOUT_S,
            # botocore's default pool (10) would queue the transfer's parts behind each other.
            max_pool_connections=max(10, S3_MAX_CONCURRENCY),
            # Virtual-host addressing needs DNS for <bucket>.<host>, which custom
            # endpoints such as 127.0.0.1:8333 do not have.
            s3={"addressing_style": "path"} if self.endpoint_url else {},
        )
        session = _new_boto3_session()
        return session.client("s3", endpoint_url=self.endpoint_url or None, config=config)

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold_bytes,
            multipart_chunksize=self.multipart_chunksize_bytes,
            max_concurrency=S3_MAX_CONCURRENCY,
            num_download_attempts=S3_TRANSFER_MAX_ATTEMPTS,
        )

    @contextmanager
    def _s3_errors(self, action: str, rel: str) -> Iterator[None]:
        """Turn botocore's many failure types into one StorageError that says what to do."""
        try:
            yield
        except StorageError:
            raise
        except Exception as e:
            raise self._translate(e, action, self.uri_of(rel)) from e

    def _translate(self, error: Exception, action: str, where: str) -> StorageError:
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        error = _botocore_root(error)
        client_error = error if isinstance(error, ClientError) else None

        if isinstance(error, (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError)):
            return StorageError(
                f"cannot reach S3 endpoint {self._endpoint_name} to {action} {where} "
                f"({error}): check s3_endpoint_url / AWS_ENDPOINT_URL and that the server is up"
            )
        if isinstance(error, ReadTimeoutError):
            return StorageError(
                f"S3 endpoint {self._endpoint_name} did not answer in {S3_READ_TIMEOUT_S:.0f} s "
                f"to {action} {where}: check the server's health and load, then retry"
            )
        if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
            return StorageError(
                f"no usable AWS credentials to {action} {where}: set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the driver's and workers' environment"
            )
        if client_error is None:
            return StorageError(f"S3 failed to {action} {where} at {self._endpoint_name}: {error}")

        code = str(client_error.response.get("Error", {}).get("Code", ""))
        message = client_error.response.get("Error", {}).get("Message", "") or str(client_error)
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "InvalidClientTokenId", "AuthorizationHeaderMalformed"):
            return StorageError(
                f"S3 endpoint {self._endpoint_name} rejected the credentials ({code}) to {action} "
                f"{where}: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        if code == "403":
            # HEAD answers carry no error body, so a bad key and a missing grant look alike.
            return StorageError(
                f"S3 answered 403 Forbidden to {action} {where} at {self._endpoint_name}: check "
                f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and that they may read this bucket"
            )
        if code in ("AccessDenied", "AllAccessDisabled"):
            return StorageError(
                f"S3 access denied to {action} {where} at {self._endpoint_name}: grant these "
                f"credentials s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on it"
            )
        if code == "NoSuchBucket":
            return StorageError(
                f"S3 bucket '{self.bucket}' does not exist at {self._endpoint_name} "
                f"(needed to {action} {where}): create it or fix the URI"
            )
        if code == "NoSuchKey" or (code in ("404", "NotFound") and action in ("read", "stat")):
            return ObjectNotFoundError(f"{action}: no such object {where}")
        if code in ("404", "NotFound"):
            # A bare 404 to a write or a listing comes from something that is not S3 (a proxy,
            # a web server) or a bucket path it does not know.
            return StorageError(
                f"{self._endpoint_name} answered 404 Not Found to {action} {where}: check that "
                f"s3_endpoint_url / AWS_ENDPOINT_URL points at an S3 server and the bucket exists"
            )
        if code in ("SlowDown", "ServiceUnavailable", "503", "InternalError", "500"):
            return StorageError(
                f"S3 endpoint {self._endpoint_name} is overloaded or failing ({code}) to "
                f"{action} {where}, after retries: retry later, or see the server's log"
            )
        return StorageError(
            f"S3 failed to {action} {where} at {self._endpoint_name}: {code} {message}"
        )

    def put_bytes(self, rel: str, data: bytes) -> None:
        # Either way the object becomes visible only once complete. The transfer manager costs
        # a thread pool per call (~25 ms), so small objects such as manifests skip it.
        with self._s3_errors("write", rel):
            if len(data) < self.multipart_threshold_bytes:
                self.client().put_object(Bucket=self.bucket, Key=self._key(rel), Body=data)
            else:
                self.transfer_client().upload_fileobj(
                    io.BytesIO(data), self.bucket, self._key(rel), Config=self._transfer_config()
                )

    def put_file(self, rel: str, local_path: str) -> None:
        with self._s3_errors("write", rel):
            self.transfer_client().upload_file(
                local_path, self.bucket, self._key(rel), Config=self._transfer_config()
            )

    def get_bytes(self, rel: str, size_bytes: int | None = None) -> bytes:
        # Small or of unknown size: one streamed GET, no HEAD round trip and no thread pool,
        # which dominate for the many small reads (manifests). A large file of known size (a
        # checkpoint's, from its manifest): parallel ranged GETs into memory.
        with self._s3_errors("read", rel):
            if size_bytes is not None and size_bytes >= self.multipart_threshold_bytes:
                buffer = io.BytesIO()
                self.transfer_client().download_fileobj(
                    self.bucket, self._key(rel), buffer, Config=self._transfer_config())
                return buffer.getvalue()
            response = self.client().get_object(Bucket=self.bucket, Key=self._key(rel))
            data: bytes = response["Body"].read()
        return data

    def get_file(self, rel: str, local_path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        # download_file writes a temp name and renames it when done.
        with self._s3_errors("read", rel):
            self.transfer_client().download_file(
                self.bucket, self._key(rel), local_path, Config=self._transfer_config()
            )

    def exists(self, rel: str) -> bool:
        try:
            self.size(rel)
        except ObjectNotFoundError:
            return False
        return True

    def size(self, rel: str) -> int:
        with self._s3_errors("stat", rel):
            head = self.client().head_object(Bucket=self.bucket, Key=self._key(rel))
        return int(head["ContentLength"])

    def _iter_keys(self, prefix: str) -> Iterator[str]:
        dir_key = self._dir_key(prefix)
        paginator = self.client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=dir_key):
            for obj in page.get("Contents", []):
                key: str = obj["Key"]
                # Zero-byte "folder" markers made by consoles and some tools are not files.
                if not key.endswith("/"):
                    yield key

    def list(self, prefix: str = "") -> builtins.list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        with self._s3_errors("list", prefix):
            return sorted(key[len(root) :] for key in self._iter_keys(prefix))

    def delete(self, rel: str) -> None:
        # S3 DeleteObject succeeds for a missing key, which is the contract we want.
        with self._s3_errors("delete", rel):
            self.client().delete_object(Bucket=self.bucket, Key=self._key(rel))

    def delete_prefix(self, prefix: str) -> None:
        with self._s3_errors("delete", prefix):
            keys = list(self._iter_keys(prefix))
            for start in range(0, len(keys), _S3_DELETE_BATCH):
                batch = keys[start : start + _S3_DELETE_BATCH]
                response = self.client().delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
                # DeleteObjects reports per-key failures in the body with HTTP 200.
                failed = response.get("Errors", [])
                if failed:
                    first = failed[0]
                    raise StorageError(
                        f"S3 refused to delete {len(failed)} object(s) under "
                        f"{self.uri_of(prefix)}, e.g. {first.get('Key')}: {first.get('Code')} "
                        f"{first.get('Message')}; check s3:DeleteObject permission and object "
                        f"lock settings"
                    )


def open_store(uri: str, s3_endpoint_url: str = "") -> Store:
    """``s3://bucket/prefix`` opens S3 (endpoint: argument, else $AWS_ENDPOINT_URL, else AWS);
    anything else is a local path, made absolute against the current directory."""
    if uri.startswith("s3://"):
        # Resolved here rather than left to boto3 so that the endpoint travels with the store
        # to Ray workers whose environment may lack the variable.
        endpoint = s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
        return S3Store(uri, endpoint_url=endpoint)
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(
            f"unsupported storage URI {uri!r}: use an absolute local path or s3://bucket/prefix"
        )
    return LocalStore(uri)
