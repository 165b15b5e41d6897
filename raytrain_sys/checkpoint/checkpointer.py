"""Atomic checkpoints on a Store: data files first, manifest last.

A checkpoint is the directory ``step_{step:08d}/`` under the store root. Workers upload their
state files into it (``write_state``); the committer then checks that every file is there with
the right size and writes ``manifest.json`` (``commit``). The manifest is the commit point:
readers only see directories that have one, so a run that dies between the two leaves a partial
directory that nobody loads and that retention later removes. Every loaded file is checked
against the sha256 recorded in the manifest and unpickled with ``weights_only=True``, so a
tampered or bit-rotted checkpoint fails loudly instead of executing code or training on garbage.

torch is imported where a state is saved or loaded, not with the module: a process that only
lists or opens checkpoints (a sweep's trial proxy, pointing Tune at its job's checkpoints) never
pays for it (seconds of CPU a process, and the proxies of a sweep start together).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from raytrain_sys.checkpoint.store import ObjectNotFoundError, Store, open_store
from raytrain_sys.errors import CheckpointCorrupt, CheckpointError, StorageError

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
DAMAGED_MANIFEST_NAME = "manifest.damaged.json"  # a committed checkpoint found damaged, set aside
# Bumped when the manifest's meaning changes, so old readers can refuse new checkpoints.
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RESERVED_KEYS = ("format", "step", "files", "created_at")


@dataclass
class CheckpointInfo:
    uri: str
    step: int
    manifest: dict[str, Any]

    def file_record(self, filename: str) -> dict[str, Any]:
        for record in self.manifest.get("files", []):
            if record.get("name") == filename:
                return dict(record)
        names = [r.get("name") for r in self.manifest.get("files", [])]
        raise CheckpointError(
            f"checkpoint {self.uri} has no file '{filename}' (it holds {names}): it was written "
            f"by a different job layout; resume with the spec that wrote it"
        )


class Checkpointer:
    """Writes, commits, finds, loads and prunes the checkpoints under one store root.

    ``keep_last=None`` never deletes anything; readers that only load use it.
    """

    def __init__(self, store: Store, keep_last: int | None):
        if keep_last is not None and keep_last < 1:
            # Retention never deletes the newest checkpoint, so 0 could not be honoured.
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.store = store
        self.keep_last = keep_last
        # Steps retention keeps whatever keep_last says (checkpoint.keep_best: the best evaluation's).
        self.keep_steps: set[int] = set()

    @staticmethod
    def dir_name(step: int) -> str:
        return f"step_{step:08d}"

    @staticmethod
    def _file_rel(step: int, filename: str) -> str:
        return f"{Checkpointer.dir_name(step)}/{filename}"

    def uri_of(self, step: int) -> str:
        return self.store.uri_of(self.dir_name(step))

    # ---- writing -------------------------------------------------------------------------

    def write_state(self, step: int, filename: str, state: dict[str, Any],
                    stage_dir: str = "") -> dict[str, Any]:
        """Upload one state file into the (uncommitted) checkpoint; returns its manifest record.

        Runs in worker processes, in the training thread or in the background
        (raytrain_sys.checkpoint.background). ``state`` is emptied once serialized, so the
        caller's snapshot is freed before the upload. The bytes are built in memory, or with
        ``stage_dir`` written to a file there first ("write locally, upload later": only the
        local disk holds them during a slow upload); S3 uploads either in parallel parts above
        the store's multipart threshold, and a local store renames them into place.
        """
        if filename == MANIFEST_NAME or not filename or filename.startswith("/"):
            raise ValueError(f"invalid checkpoint file name {filename!r}")
        if self.store.exists(self._file_rel(step, MANIFEST_NAME)):
            # Overwriting files under a live manifest would make it point at other bytes.
            raise CheckpointError(
                f"checkpoint {self.uri_of(step)} is already committed; a run resumed from an "
                f"older checkpoint must write to a new checkpoint directory"
            )
        if stage_dir:
            return self._write_staged(step, filename, state, stage_dir)
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        state.clear()
        data = buffer.getvalue()
        del buffer
        _refuse_unsafe(filename, io.BytesIO(data))
        self.store.put_bytes(self._file_rel(step, filename), data)
        return {"name": filename, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def _write_staged(self, step: int, filename: str, state: dict[str, Any],
                      stage_dir: str) -> dict[str, Any]:
        import torch

        path = os.path.join(stage_dir, f"{uuid.uuid4().hex}-{filename.replace('/', '_')}")
        try:
            try:
                os.makedirs(stage_dir, exist_ok=True)
                torch.save(state, path)
                state.clear()
                with open(path, "rb") as f:
                    _refuse_unsafe(filename, f)
                    f.seek(0)
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                size = os.path.getsize(path)
            except OSError as e:
                raise StorageError(
                    f"cannot stage checkpoint file {filename} in checkpoint.stage_dir {stage_dir} "
                    f"({e.strerror or e}): make it a writable local directory with room for "
                    f"this rank's file, or set it to \"\""
                ) from e
            self.store.put_file(self._file_rel(step, filename), path)
        finally:
            with contextlib.suppress(OSError):  # never there, or gone: the error above is the news
                os.remove(path)
        return {"name": filename, "bytes": size, "sha256": digest}

    def commit(
        self, step: int, files: list[dict[str, Any]], meta: dict[str, Any]
    ) -> CheckpointInfo:
        """Make the checkpoint visible: verify its files, write the manifest last, prune."""
        clash = [k for k in meta if k in _RESERVED_KEYS]
        if clash:
            raise ValueError(f"checkpoint meta must not set reserved keys {clash}")
        names = [f["name"] for f in files]
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ValueError(
                f"checkpoint file names must be unique and not {MANIFEST_NAME}: {names}"
            )
        uri = self.uri_of(step)
        for record in files:
            rel = self._file_rel(step, record["name"])
            try:
                actual = self.store.size(rel)
            except ObjectNotFoundError as e:
                raise CheckpointError(
                    f"cannot commit checkpoint {uri}: file {record['name']} was never uploaded; "
                    f"the writing worker probably died, the checkpoint stays invisible"
                ) from e
            if actual != record["bytes"]:
                raise CheckpointError(
                    f"cannot commit checkpoint {uri}: file {record['name']} has {actual} bytes, "
                    f"the writer reported {record['bytes']}; two writers raced or an upload was cut"
                )
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "files": [dict(f) for f in files],
            "created_at": datetime.now(timezone.utc).isoformat(),
            **meta,
        }
        self.store.put_bytes(
            self._file_rel(step, MANIFEST_NAME), json.dumps(manifest, indent=1).encode()
        )
        log.info("committed checkpoint %s (%d files)", uri, len(files))
        self.apply_retention()
        return CheckpointInfo(uri=uri, step=step, manifest=manifest)

    # ---- finding -------------------------------------------------------------------------

    def _step_dirs(self) -> dict[int, set[str]]:
        """Step -> names of the files directly under its directory, from one recursive listing."""
        dirs: dict[int, set[str]] = {}
        for key in self.store.list():
            top, _, rest = key.partition("/")
            match = _STEP_DIR.match(top)
            if match and rest:
                dirs.setdefault(int(match.group(1)), set()).add(rest)
        return dirs

    def _read_manifest(self, step: int) -> dict[str, Any] | None:
        """The parsed manifest, or None (with a warning) when it is unreadable or inconsistent."""
        rel = self._file_rel(step, MANIFEST_NAME)
        try:
            manifest = json.loads(self.store.get_bytes(rel))
        except ObjectNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as e:
            log.warning(
                "ignoring checkpoint %s: corrupt %s (%s)", self.uri_of(step), MANIFEST_NAME, e
            )
            return None
        if not isinstance(manifest, dict) or manifest.get("step") != step or not isinstance(
            manifest.get("files"), list
        ):
            log.warning(
                "ignoring checkpoint %s: %s does not describe step %d",
                self.uri_of(step), MANIFEST_NAME, step,
            )
            return None
        if manifest.get("format", MANIFEST_FORMAT) > MANIFEST_FORMAT:
            log.warning(
                "ignoring checkpoint %s: written by a newer raytrain-sys (manifest format %s)",
                self.uri_of(step), manifest.get("format"),
            )
            return None
        return manifest

    def list_complete(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first; directories without a valid manifest are skipped."""
        return self._complete_in(self._step_dirs())

    def _complete_in(self, dirs: dict[int, set[str]]) -> list[CheckpointInfo]:
        infos = []
        for step, names in sorted(dirs.items()):
            if MANIFEST_NAME not in names:
                continue
            manifest = self._read_manifest(step)
            if manifest is not None:
                infos.append(CheckpointInfo(uri=self.uri_of(step), step=step, manifest=manifest))
        return infos

    def latest(self) -> CheckpointInfo | None:
        complete = self.list_complete()
        return complete[-1] if complete else None

    def problems(self, info: CheckpointInfo) -> list[str]:
        """What is wrong with a committed checkpoint's files, found without reading them: each
        file the manifest lists must exist with the size it records (one listing or HEAD per
        file). Contents are checked against their sha256 when loaded (``load_state``)."""
        found = []
        for record in info.manifest.get("files", []):
            name = record.get("name", "?")
            try:
                size = self.store.size(self._file_rel(info.step, name))
            except ObjectNotFoundError:
                found.append(f"{name} is missing")
                continue
            if record.get("bytes") is not None and size != record["bytes"]:
                found.append(f"{name} has {size} bytes, its manifest says {record['bytes']}")
        return found

    def set_aside(self, info: CheckpointInfo, why: str) -> None:
        """Make a damaged committed checkpoint invisible without deleting anything: its manifest
        moves to ``manifest.damaged.json`` (with ``why``), so that a run resumed from an older
        checkpoint can write this step again; its files stay until retention removes the
        directory."""
        record = dict(info.manifest, set_aside_because=why)
        self.store.put_bytes(self._file_rel(info.step, DAMAGED_MANIFEST_NAME), json.dumps(record, indent=1).encode())
        self.store.delete(self._file_rel(info.step, MANIFEST_NAME))
        log.warning("set aside checkpoint %s (%s): its manifest is now %s", info.uri, why, DAMAGED_MANIFEST_NAME)

    def newest_intact(self, before_step: int | None = None) -> CheckpointInfo | None:
        """The newest committed checkpoint (older than ``before_step`` if given) with no
        ``problems``."""
        for info in reversed(self.list_complete()):
            if before_step is not None and info.step >= before_step:
                continue
            if not self.problems(info):
                return info
        return None

    def older_than(self, step: int, how: str = "resume from it (checkpoint.resume_from={uri})",
                   none: str = "start the run afresh (no checkpoint.resume_from)") -> str:
        """What to use instead of the checkpoint of ``step``: the newest intact older one and
        ``how`` (``{uri}`` is its URI), or ``none`` when no older one is intact."""
        older = self.newest_intact(before_step=step)
        if older is None:
            return f"no older checkpoint under {self.store.uri} is intact: {none}"
        return f"the newest intact older checkpoint is {older.uri} (step {older.step}): {how.format(uri=older.uri)}"

    def resolve(self, uri_or_latest: str) -> CheckpointInfo:
        """``"latest"``, a checkpoint directory URI under this store, or a bare step_... name."""
        if uri_or_latest == "latest":
            info = self.latest()
            if info is None:
                raise CheckpointError(
                    f"no complete checkpoint under {self.store.uri}: start the run without "
                    f"resume, or point resume at the storage path the run wrote to"
                )
            return info
        name = uri_or_latest.rstrip("/")
        root = self.store.uri.rstrip("/") + "/"
        if name.startswith(root):
            name = name[len(root) :]
        match = _STEP_DIR.match(name)
        if not match:
            raise CheckpointError(
                f"{uri_or_latest!r} is not a checkpoint directory under {self.store.uri}: "
                f"give 'latest' or a .../step_NNNNNNNN URI"
            )
        step = int(match.group(1))
        uri = self.uri_of(step)
        if not self.store.exists(self._file_rel(step, MANIFEST_NAME)):
            present = "is empty or missing" if not self.store.list(name) else "has files but"
            raise CheckpointError(
                f"checkpoint {uri} {present} no manifest: incomplete checkpoint, written when the "
                f"run died? {self.older_than(step)}"
            )
        manifest = self._read_manifest(step)
        if manifest is None:
            raise CheckpointError(f"checkpoint {uri} has a corrupt {MANIFEST_NAME}: {self.older_than(step)}")
        return CheckpointInfo(uri=uri, step=step, manifest=manifest)

    # ---- loading -------------------------------------------------------------------------

    def load_state(self, info: CheckpointInfo, filename: str) -> dict[str, Any]:
        """Read, verify against the manifest's sha256, and load tensors onto the CPU."""
        record = info.file_record(filename)
        rel = self._file_rel(info.step, filename)
        try:
            data = self.store.get_bytes(rel, size_bytes=record.get("bytes"))
        except ObjectNotFoundError as e:
            raise CheckpointCorrupt(
                f"checkpoint file {info.uri}/{filename} is listed in the manifest but missing"
            ) from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != record.get("sha256"):
            raise CheckpointCorrupt(
                f"corrupt checkpoint file {info.uri}/{filename}: sha256 mismatch (manifest "
                f"{record.get('sha256')}, found {digest}, {len(data)} bytes)"
            )
        import torch

        try:
            state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"refusing to load {info.uri}/{filename}: it holds objects other than tensors "
                f"and plain Python types, which could run code{_what_torch_refused(e)}"
            ) from None
        if not isinstance(state, dict):
            raise CheckpointError(
                f"checkpoint file {info.uri}/{filename} holds a {type(state).__name__}, not a "
                f"state dict: it was not written by raytrain-sys"
            )
        return state

    # ---- retention -----------------------------------------------------------------------

    def apply_retention(self) -> list[int]:
        """Delete complete checkpoints beyond ``keep_last`` and stale partial ones.

        The newest complete checkpoint always survives. Partial directories newer than it are
        left alone: a writer may still be filling them.
        """
        if self.keep_last is None:
            return []
        dirs = self._step_dirs()
        complete = [info.step for info in self._complete_in(dirs)]
        if not complete:
            return []
        newest = complete[-1]
        doomed_complete = [s for s in complete[: -self.keep_last] if s not in self.keep_steps]
        doomed_partial = [s for s in dirs if s < newest and s not in complete]
        for step in doomed_complete:
            # Manifest first: if we die midway, what is left is an invisible partial directory.
            self.store.delete(self._file_rel(step, MANIFEST_NAME))
            self.store.delete_prefix(self.dir_name(step))
        for step in doomed_partial:
            self.store.delete_prefix(self.dir_name(step))
        deleted = sorted(doomed_complete + doomed_partial)
        if deleted:
            log.info(
                "retention (keep_last=%d) deleted checkpoint steps %s under %s",
                self.keep_last, deleted, self.store.uri,
            )
        return deleted


def _refuse_unsafe(filename: str, data: Any) -> None:
    """Refuse at save time what weights_only loading would refuse at resume time, when it is too
    late to fix; this scans pickle opcodes and does not deserialize tensors."""
    import torch

    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(data)
    if unsafe:
        raise TypeError(
            f"state for {filename} holds objects that cannot be loaded safely with "
            f"weights_only=True: {unsafe}; keep checkpoint state to tensors and plain "
            f"Python types"
        )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _what_torch_refused(error: Exception) -> str:
    """The object torch's weights-only load refused (" (GLOBAL pkg.Name)"), from its message,
    without the terminal escape codes and the advice on loading the file unsafely that the
    message also carries."""
    text = _ANSI.sub("", str(error))
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    return f" (it names {match.group(1)})" if match else ""


def split_checkpoint_uri(uri: str) -> tuple[str, int] | None:
    """A checkpoint directory URI (``.../step_00000010``) as (its store root, its step); None
    for anything else."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    match = _STEP_DIR.match(name)
    return (parent, int(match.group(1))) if match and parent else None


def open_checkpoint(uri: str, s3_endpoint_url: str = "") -> tuple[Checkpointer, CheckpointInfo]:
    """Open a checkpoint directory URI (``.../step_00000010``): a read-only Checkpointer on its
    parent store (retention off) and the checkpoint's info."""
    split = split_checkpoint_uri(uri)
    if split is None:
        raise CheckpointError(
            f"{uri!r} is not a checkpoint directory: expected a URI ending in /step_NNNNNNNN"
        )
    checkpointer = Checkpointer(open_store(split[0], s3_endpoint_url), keep_last=None)
    return checkpointer, checkpointer.resolve(uri.rstrip("/").rpartition("/")[2])


def load_checkpoint_dir(uri: str, s3_endpoint_url: str = "") -> CheckpointInfo:
    return open_checkpoint(uri, s3_endpoint_url)[1]
