"""The Store contract on a local directory and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import errno
import os
import pickle
import socket
import time
from pathlib import Path

import pytest

from raytrain_sys.checkpoint.store import (
    LocalStore,
    ObjectNotFoundError,
    S3Store,
    Store,
    open_store,
)
from raytrain_sys.errors import StorageError
from tests.fixtures.s3_server import S3Server

MIB = 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "runs" / "x"))
    server: S3Server = request.getfixturevalue("s3_server")
    bucket: str = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/runs/x", s3_endpoint_url=server.endpoint_url)


def test_put_get_list_delete_round_trip(store: Store) -> None:
    store.put_bytes("a/one.bin", b"1")
    store.put_bytes("a/sub/two.bin", b"22")
    store.put_bytes("ab/three.bin", b"333")
    store.put_bytes("top.txt", b"top")

    assert store.get_bytes("a/sub/two.bin") == b"22"
    assert store.size("ab/three.bin") == 3
    assert store.exists("top.txt") and not store.exists("nope.txt")
    assert store.list() == ["a/one.bin", "a/sub/two.bin", "ab/three.bin", "top.txt"]
    # A prefix is a directory: "a" must not pick up "ab/...".
    assert store.list("a") == ["a/one.bin", "a/sub/two.bin"]
    assert store.list("a/") == ["a/one.bin", "a/sub/two.bin"]
    assert store.list("missing") == []

    store.put_bytes("top.txt", b"replaced")
    assert store.get_bytes("top.txt") == b"replaced"

    store.delete("top.txt")
    store.delete("top.txt")  # deleting a missing key is fine
    assert not store.exists("top.txt")

    store.delete_prefix("a")
    assert store.list() == ["ab/three.bin"]
    store.delete_prefix("does/not/exist")


def test_child_is_rooted_under_parent(store: Store) -> None:
    child = store.child("step_00000010")
    assert child.uri == store.uri_of("step_00000010") == f"{store.uri}/step_00000010"
    child.put_bytes("model.pt", b"weights")
    assert store.list() == ["step_00000010/model.pt"]
    assert store.get_bytes("step_00000010/model.pt") == b"weights"
    assert child.list() == ["model.pt"]


def test_file_round_trip(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    payload = os.urandom(300_000)
    src.write_bytes(payload)
    store.put_file("files/blob.bin", str(src))
    dest = tmp_path / "out" / "blob.bin"
    store.get_file("files/blob.bin", str(dest))
    assert dest.read_bytes() == payload


def test_missing_key_is_object_not_found(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError, match="no such"):
        store.get_bytes("missing.bin")
    with pytest.raises(ObjectNotFoundError):
        store.size("missing.bin")
    with pytest.raises(ObjectNotFoundError):
        store.get_file("missing.bin", str(tmp_path / "x"))


def test_keys_cannot_escape_root(store: Store) -> None:
    with pytest.raises(ValueError, match=r"\.\."):
        store.put_bytes("../outside", b"x")


def test_check_access_passes_and_leaves_nothing(store: Store) -> None:
    store.check_access()
    assert store.list() == []


def test_store_survives_pickling_after_use(store: Store) -> None:
    # Ray ships stores to workers; an S3 store must drop its live client and rebuild it.
    store.put_bytes("before.bin", b"x")
    clone = pickle.loads(pickle.dumps(store))
    clone.put_bytes("after.bin", b"y")
    assert store.list() == ["after.bin", "before.bin"]


def test_open_store_chooses_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = open_store("relative/dir")
    assert isinstance(local, LocalStore) and local.uri == str(tmp_path / "relative" / "dir")

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://from-env:9000")
    s3 = open_store("s3://bucket/some/prefix/")
    assert isinstance(s3, S3Store)
    assert (s3.uri, s3.bucket, s3.prefix) == ("s3://bucket/some/prefix", "bucket", "some/prefix")
    assert s3.endpoint_url == "http://from-env:9000"
    assert open_store("s3://bucket", s3_endpoint_url="http://arg:1").endpoint_url == "http://arg:1"

    with pytest.raises(StorageError, match="unsupported storage URI"):
        open_store("gs://bucket/x")


def test_s3_large_upload_goes_multipart(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    # 5 MiB is the smallest part S3 allows; 9 MiB then needs exactly two parts.
    store = S3Store(
        f"s3://{s3_bucket}/big",
        endpoint_url=s3_server.endpoint_url,
        multipart_threshold_bytes=5 * MIB,
        multipart_chunksize_bytes=5 * MIB,
    )
    payload = os.urandom(9 * MIB)
    src = tmp_path / "big.bin"
    src.write_bytes(payload)

    store.put_file("from_file.bin", str(src))
    store.put_bytes("from_bytes.bin", payload)
    store.put_bytes("small.bin", b"tiny")

    def etag(key: str) -> str:
        return s3_server.client().head_object(Bucket=s3_bucket, Key=f"big/{key}")["ETag"]

    # A multipart object's ETag is "<md5 of part md5s>-<number of parts>".
    assert etag("from_file.bin").strip('"').endswith("-2")
    assert etag("from_bytes.bin").strip('"').endswith("-2")
    assert "-" not in etag("small.bin")

    dest = tmp_path / "back.bin"
    store.get_file("from_file.bin", str(dest))
    assert dest.read_bytes() == payload
    assert store.get_bytes("from_bytes.bin") == payload
    # With its size known (a manifest records it), a large file is read in parallel ranges.
    assert store.get_bytes("from_bytes.bin", size_bytes=len(payload)) == payload


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_fails_fast_with_clear_message() -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = open_store("s3://bucket/run", s3_endpoint_url=endpoint)
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        store.check_access()
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"took {elapsed:.1f} s to give up on a closed port"
    message = str(caught.value)
    assert "cannot reach S3 endpoint" in message
    assert endpoint in message and "s3://bucket/run" in message
    assert "AWS_ENDPOINT_URL" in message


@pytest.mark.slow
def test_blackholed_endpoint_gives_up_within_about_ten_seconds() -> None:
    # A firewalled endpoint drops SYNs instead of refusing them, so only the connect timeout
    # ends the wait. A listener whose accept queue is full does the same on loopback.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(listener.getsockname())
        fillers.append(filler)
    time.sleep(0.2)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(StorageError, match="cannot reach S3 endpoint"):
            open_store("s3://bucket/run", s3_endpoint_url=endpoint).check_access()
    finally:
        for sock in [*fillers, listener]:
            sock.close()
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    ("variable", "value", "code"),
    [
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret", "SignatureDoesNotMatch"),
        ("AWS_ACCESS_KEY_ID", "no-such-key", "InvalidAccessKeyId"),
    ],
)
def test_bad_credentials_are_named(
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    code: str,
) -> None:
    monkeypatch.setenv(variable, value)
    store = open_store(f"s3://{s3_bucket}/run", s3_endpoint_url=s3_server.endpoint_url)
    with pytest.raises(StorageError, match="rejected the credentials") as caught:
        store.check_access()
    assert code in str(caught.value) and "AWS_SECRET_ACCESS_KEY" in str(caught.value)


def test_missing_bucket_is_named(s3_server: S3Server) -> None:
    store = open_store("s3://no-such-bucket-here/run", s3_endpoint_url=s3_server.endpoint_url)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        store.check_access()
    with pytest.raises(StorageError, match="does not exist"):
        store.list()


def test_local_disk_full_is_reported_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk cannot be produced here without root mounts; fsync is where a real one
    # surfaces ENOSPC for buffered writes, so the OS call is the edge we replace.
    store = LocalStore(str(tmp_path / "ckpt"))

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(StorageError, match=r"disk full at .*ckpt.*model\.pt"):
        store.put_bytes("step_00000010/model.pt", b"x" * 1000)
    monkeypatch.undo()
    assert store.list() == []
    assert os.listdir(tmp_path / "ckpt" / "step_00000010") == []


def test_the_session_s3_server_takes_a_bucket_per_test_for_the_whole_suite(
    s3_server: S3Server,
) -> None:
    # weed mini gives each bucket volumes of its own; left to size itself it allowed free disk /
    # 1 GiB volumes (25 here) and the suite's 25th bucket failed every write as InternalError.
    for _ in range(40):
        bucket = s3_server.make_bucket()
        s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"x")
        assert s3_server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"x"
