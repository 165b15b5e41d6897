"""Code packages: a user's directory that travels with a service job (``raytrain-sys jobs submit
--working-dir DIR``, ``Client.submit(..., working_dir=DIR)``), the service's counterpart of
``ray job submit --working-dir``.

Owns: making a package from a directory (``pack``: a zip of its files, excludes applied, the
same bytes for the same files whatever their times, so its sha256 names its content), checking
one the service is sent (``check``), and putting one where the job's processes find it
(``runtime_env``).

How a package reaches a job:

* The client packs the directory and uploads it once (``PUT /v1/packages/<sha256>``; a package
  the service already holds for the team is not sent again), then submits the job naming it.
* The store keeps its bytes (``packages`` table) for the team that uploaded it: durable like the
  job, on SQLite or PostgreSQL, so a job resumed a week later, or after the service restarted,
  still has its code. A team can submit only packages it uploaded.
* Before the reconciler starts the job's runner, ``runtime_env`` puts the package in Ray's GCS
  under a content-addressed ``gcs://`` URI, if it is not there yet, and returns
  ``{"working_dir": uri}``. The runner is created with it; Ray unpacks the package on each node
  where the job has a process and makes it their working directory and first ``sys.path``
  entry. The runner's workers and read tasks inherit it (they are created by the runner), so
  ``model.factory``, ``train.task`` and ``data.transform`` import from it everywhere. Such a job
  takes no warm spare runner or worker: those processes were started without its code.

The one private Ray call: GCS is where ``ray job submit --working-dir`` puts its packages, and
Ray offers no public call to put one there for a single actor (a local directory in an actor's
``runtime_env`` is refused: "only supported at the job level"). ``_gcs`` finds the two functions
in ``ray._private.runtime_env.packaging`` and raises a ``UserError`` naming them if a Ray
version moved them; ``tests/test_service_packages.py`` runs them against a real cluster.

A package carries code, not data: the spec's paths are resolved as for any service job (see
``requests.py``). Keep data in the dataset's store; ``MAX_BYTES`` bounds a package.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import stat
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Optional

from raytrain_sys.errors import ServiceInputError, UserError, quote

MAX_BYTES = 64 * 1024 * 1024  # under Ray's GCS message limit with room; data belongs in the dataset store
# Never part of a package: version control, caches and virtual environments.
DEFAULT_EXCLUDES = (".git", "__pycache__", "*.pyc", ".ipynb_checkpoints", ".pytest_cache", ".mypy_cache",
                    ".venv", "venv", ".DS_Store")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # every member's time: the bytes depend on the files' content only
URI_PREFIX = "gcs://_raytrain_sys_pkg_"


def digest(data: bytes) -> str:
    """The package's name: the sha256 of its bytes, hex."""
    return hashlib.sha256(data).hexdigest()


def pack(directory: os.PathLike | str, excludes: Iterable[str] = (), *, field: str = "working_dir") -> bytes:
    """The files under ``directory`` as a zip, paths relative to it, in a fixed order and with a
    fixed time. ``excludes``: glob patterns matched against each file's or directory's name and
    its path relative to ``directory`` (added to ``DEFAULT_EXCLUDES``). Raises ``UserError``
    naming ``field`` for a path that is not a directory, one with no files, or a package over
    ``MAX_BYTES`` (with its largest files)."""
    root = Path(directory)
    if not root.is_dir():
        raise UserError(f"{field}: {os.fspath(directory)!r} is not a directory")
    patterns = tuple(DEFAULT_EXCLUDES) + tuple(excludes)
    files = list(_files(root, patterns))
    if not files:
        raise UserError(f"{field}: {os.fspath(directory)!r} has no files to send (excludes: {', '.join(patterns)})")
    total = sum(size for _, _, size in files)
    if total > MAX_BYTES:
        raise UserError(f"{field}: {os.fspath(directory)!r} holds {_mib(total)} of files, over the "
                        f"{_mib(MAX_BYTES)} a package may have; the largest: {_largest(files)}. Leave data out "
                        f"(--exclude PATTERN) and read it from its store (data.path)")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, path, _ in files:
            info = zipfile.ZipInfo(rel, date_time=_EPOCH)
            info.external_attr = (stat.S_IMODE(path.stat().st_mode) | stat.S_IFREG) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())
    data = out.getvalue()
    if len(data) > MAX_BYTES:
        raise UserError(f"{field}: the package of {os.fspath(directory)!r} is {_mib(len(data))}, over "
                        f"{_mib(MAX_BYTES)}; the largest files: {_largest(files)}")
    return data


def _files(root: Path, patterns: tuple[str, ...]):
    """(relative posix path, path, size) of every regular file under ``root`` not excluded, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        rel_dir = base.relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not _excluded(d, (rel_dir / d).as_posix(), patterns))
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            path = base / name
            if _excluded(name, rel, patterns) or not path.is_file():
                continue
            found.append((rel, path, path.stat().st_size))
    return sorted(found)


def _excluded(name: str, rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def _largest(files, count: int = 3) -> str:
    return ", ".join(f"{rel} ({_mib(size)})" for rel, _, size in sorted(files, key=lambda f: -f[2])[:count])


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check(data: bytes, sha256: str) -> int:
    """What the service accepts: bytes whose sha256 is the name they were sent under, a zip of
    at most ``MAX_BYTES`` whose members are relative paths inside the package. Returns the
    number of files; raises ``ServiceInputError`` on ``package``."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ServiceInputError("package", f"got {quote(sha256)}; a package is named by the sha256 of its bytes "
                                           f"(64 lower-case hex digits)")
    if len(data) > MAX_BYTES:
        raise ServiceInputError("package", f"is {_mib(len(data))}, over the {_mib(MAX_BYTES)} a package may have")
    got = digest(data)
    if got != sha256:
        raise ServiceInputError("package", f"the bytes sent have sha256 {got}, not {sha256}: the upload was "
                                           f"cut or changed; send it again")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = zf.namelist()
            bad = zf.testzip()
    except zipfile.BadZipFile as exc:
        raise ServiceInputError("package", f"is not a zip file ({exc})") from None
    if bad is not None:
        raise ServiceInputError("package", f"member {quote(bad)} is corrupt")
    for name in names:
        parts = Path(name).parts
        if name.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
            raise ServiceInputError("package", f"member {quote(name)} is not a path inside the package")
    if not names:
        raise ServiceInputError("package", "holds no files")
    return len(names)


def uri(sha256: str) -> str:
    """Where the package lives in the cluster: content-addressed, so two jobs of one package share it."""
    return f"{URI_PREFIX}{sha256}.zip"


def runtime_env(sha256: str, load: Callable[[str], Optional[bytes]]) -> dict:
    """The runtime env of a job's runner for package ``sha256``: put in the cluster's GCS first
    when it is not there (``load(sha256)`` gives its bytes, None when the store has none).
    Raises ``UserError`` when the package cannot be had."""
    exists, upload = _gcs()
    where = uri(sha256)
    if not exists(where):
        data = load(sha256)
        if data is None:
            raise UserError(f"package {sha256[:12]}: the service's store no longer holds the job's code package")
        try:
            upload(where, data)
        except Exception as exc:  # noqa: BLE001: a GCS refusal is the job's failure, said plainly
            raise UserError(f"package {sha256[:12]}: putting the job's code ({_mib(len(data))}) in the "
                            f"cluster failed: {exc}") from None
    return {"working_dir": where}


def _gcs():
    """(package_exists, upload_package_to_gcs) from Ray; see the module docstring."""
    try:
        from ray._private.runtime_env import packaging
        return packaging.package_exists, packaging.upload_package_to_gcs
    except (ImportError, AttributeError) as exc:
        import ray
        raise UserError(f"this Ray ({ray.__version__}) has no ray._private.runtime_env.packaging."
                        f"package_exists/upload_package_to_gcs, which the job service uses to send a job's "
                        f"code to the cluster ({exc}); install the code on the cluster's nodes instead") from None
