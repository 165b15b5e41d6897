"""The MLflow record of a run, written only from the driver.

One ``Tracker`` per job run. It holds an ``MlflowClient`` of its own (never the fluent API's
global state), so several trackers and threads can coexist in one process.

What a run holds, and where ``lookup()`` (hence ``raytrain-sys resume``) reads it back from:

- params: every ``spec.flat()`` field, as text (long values truncated with a marker);
- tags: git commit, spec and training hashes, run dir, checkpoint root, latest checkpoint,
  supervisor state, resume count and per-resume overrides (names below);
- metrics: the training loop's step metrics and ``checkpoint_step`` at each committed checkpoint;
- artifacts: ``spec.json`` (the latest spec, exact, read back by ``lookup``),
  ``spec.original.json`` (as first started), ``checkpoints.json``, ``events.json`` and
  ``plots/*.png`` (``monitor/plots.py``, redrawn at the first checkpoint, then at most every
  ``PLOTS_EVERY_S``, and at the end).

Writes made while training runs (metrics, tags, events, checkpoint records, plots), and the
params of a run just started, go through one background thread, in order: a slow or unreachable
MLflow never stalls the training loop. A write that still fails after a few retries is dropped
with a warning and counted (``Tracker.dropped_batches``); ``flush()`` and ``finish()`` wait for
the queue to drain.
``begin`` makes a new run as the writer's first write (the run and its spec; its params the
next writes): it returns at once, the writes made before the run exists wait behind its opening,
and a failed opening is kept for ``check_open``/``opened`` to raise (the Supervisor trains
while a new run opens). ``start`` is ``begin`` waited for; it, ``resume`` and ``lookup`` are
synchronous and raise ``TrackingError``. ``warm`` opens a store ahead of a run; a process keeps one client per
store (``_client``), so a spare runner's warm client is the one its job's run opens on.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

from raytrain_sys.version import __version__
from raytrain_sys.errors import TrackingError
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- names

TAG_GIT_COMMIT = "raytrain.git_commit"
TAG_RUN_DIR = "raytrain.run_dir"
TAG_CHECKPOINT_ROOT = "raytrain.checkpoint_root"
TAG_SPEC_HASH = "raytrain.spec_hash"
TAG_TRAINING_HASH = "raytrain.training_hash"
TAG_VERSION = "raytrain.version"
TAG_LATEST_CHECKPOINT = "raytrain.latest_checkpoint"
TAG_STATE = "raytrain.state"
TAG_STATE_REASON = "raytrain.state_reason"
TAG_RESUME_COUNT = "raytrain.resume_count"


def resume_override_tag(resume_index: int, key: str) -> str:
    """Tag recording that resume number ``resume_index`` changed the param ``key``."""
    return f"raytrain.resume.{resume_index}.override.{key}"


SPEC_ARTIFACT = "spec.json"  # the latest spec; rewritten on resume
ORIGINAL_SPEC_ARTIFACT = "spec.original.json"  # the spec the run was started with
CHECKPOINTS_ARTIFACT = "checkpoints.json"
EVENTS_ARTIFACT = "events.json"
PLOTS_ARTIFACT_DIR = "plots"  # monitor/plots.py's PNGs
STACKS_ARTIFACT_DIR = "hangs"  # a hung (or replaced straggler) worker's stacks: Tracker.log_stack
# While a run trains, its plots are redrawn at its first checkpoint, then at a checkpoint at most
# this often; the end of the run always redraws them (and its last checkpoint leaves it to the end).
# A redraw costs about a CPU-second: a short run checkpointing every few steps paid one a checkpoint
# on the cores its workers train on, and its end waited for the last checkpoint's before its own.
PLOTS_EVERY_S = 30.0
CHECKPOINT_STEP_METRIC = "checkpoint_step"

TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")

# MLflow's server-side limits; read from MLflow when it exposes them (values of MLflow 3.x).
try:
    from mlflow.utils.validation import (
        MAX_ENTITIES_PER_BATCH,
        MAX_METRICS_PER_BATCH,
        MAX_PARAM_VAL_LENGTH,
        MAX_PARAMS_TAGS_PER_BATCH,
        MAX_TAG_VAL_LENGTH,
    )
except ImportError:  # pragma: no cover - older or newer MLflow layouts
    MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH = 6000, 8000
    MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH, MAX_ENTITIES_PER_BATCH = 1000, 100, 1000

TRUNCATION_MARKER = "...[truncated]"

# MLflow's HTTP client retries 7 times with exponential backoff and a 120 s timeout per request
# by default, which holds a caller for minutes when the server is down. These bounds apply
# unless the user set the variables; the writer thread adds its own retries on top.
_HTTP_CLIENT_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}

# MLflow error codes that retrying cannot fix.
_PERMANENT_ERROR_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED", "BAD_REQUEST", "ENDPOINT_NOT_FOUND",
})


# ----------------------------------------------------------------------------- helpers

def default_tracking_uri(output_dir: str) -> str:
    """The embedded default: a SQLite file in the job's output directory."""
    return f"sqlite:///{os.path.abspath(output_dir)}/mlflow.db"


def spec_tracking_uri(spec: dict) -> str:
    """Where a job spec given as a plain dict (the service's stored spec) tracks: its
    tracking.uri, else the embedded default under its output_dir."""
    uri = (spec.get("tracking") or {}).get("uri") or ""
    return uri or default_tracking_uri(spec.get("output_dir") or "runs")


def _is_http(tracking_uri: str) -> bool:
    return urllib.parse.urlparse(tracking_uri).scheme in ("http", "https")


def _sqlite_path(tracking_uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI, or None for other stores and in-memory DBs."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    path = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else ""
    path = path.split("?", 1)[0]
    return None if path in ("", ":memory:") else path


def _fit(value: Any, limit: int) -> str:
    text = str(value)
    if len(text) <= limit:
        return text
    return text[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def _spec_params(spec: JobSpec) -> dict[str, str]:
    return {key: _fit(value, MAX_PARAM_VAL_LENGTH) for key, value in spec.flat().items()}


def _spec_json(spec: JobSpec) -> str:
    return json.dumps(spec.plain_dict(), indent=2, sort_keys=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if "Max retries exceeded" in text or "Failed to establish a new connection" in text:
        # MLflow wraps urllib3's long repr of the failed connection; say what it means.
        return "cannot connect to the server (connection refused, reset or timed out)"
    return text.splitlines()[0][:300]


def _is_transient(exc: BaseException) -> bool:
    code = getattr(exc, "error_code", None)
    return code not in _PERMANENT_ERROR_CODES


def _call(tracking_uri: str, what: str, fn: Callable[[], Any], attempts: int = 3) -> Any:
    """Run one synchronous MLflow call; transient failures are retried, then a TrackingError."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:  # MlflowException, requests and sqlite errors alike
            if attempt + 1 < attempts and _is_transient(exc):
                time.sleep(0.5 * 2**attempt)
                continue
            raise TrackingError(
                f"MLflow at {tracking_uri} failed to {what}: {_first_line(exc)}; "
                "check tracking.uri / --tracking-uri and that the store is up and writable"
            ) from exc
    raise AssertionError("unreachable")


def check_reachable(tracking_uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, with a TrackingError, when the tracking store cannot be used.

    http(s): one GET of ``<uri>/health``, bounded by ``timeout_s`` (a refused connection fails at
    once; any HTTP answer below 500 counts as reachable, since auth or a path prefix may hide
    /health). sqlite: the database's directory must exist or be creatable, and be writable.
    Other stores (postgresql, databricks, ...) are left to MLflow's own errors.
    """
    scheme = urllib.parse.urlparse(tracking_uri).scheme
    if scheme in ("http", "https"):
        import requests

        url = tracking_uri.rstrip("/") + "/health"
        # The same TLS settings MLflow's own client honours.
        verify: bool | str = True
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            verify = False
        elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            verify = os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"]
        half = max(timeout_s / 2, 0.1)  # connect + read together stay within timeout_s
        try:
            response = requests.get(url, timeout=(half, half), verify=verify)
        except requests.exceptions.Timeout:
            raise TrackingError(
                f"MLflow server {tracking_uri} did not answer within {timeout_s:g} s: check that "
                "it is up and not overloaded, or fix tracking.uri / --tracking-uri"
            ) from None
        except requests.exceptions.RequestException as exc:
            raise TrackingError(
                f"cannot reach MLflow server {tracking_uri} ({type(exc).__name__}): start it "
                "(`mlflow server --host ... --port ...`) or fix tracking.uri / --tracking-uri"
            ) from None
        if response.status_code >= 500:
            raise TrackingError(
                f"MLflow server {tracking_uri} answered HTTP {response.status_code} on /health: "
                "check the server's log"
            )
        return
    path = _sqlite_path(tracking_uri)
    if scheme == "sqlite" and path is not None:
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise TrackingError(
                f"cannot create the MLflow database directory {directory} for {tracking_uri}: "
                f"{exc.strerror}; choose another output_dir or tracking.uri"
            ) from None
        if not os.access(directory, os.W_OK):
            raise TrackingError(
                f"the MLflow database directory {directory} is not writable: fix its "
                "permissions or choose another output_dir or tracking.uri"
            )


def _bound_http_client(tracking_uri: str) -> None:
    if _is_http(tracking_uri):
        for name, value in _HTTP_CLIENT_BOUNDS.items():
            os.environ.setdefault(name, value)


_made_stores: set[str] = set()  # SQLite files this process has seen made (ensure_store)
_made_stores_lock = threading.Lock()


def ensure_store(tracking_uri: str) -> None:
    """Make (or migrate) a SQLite tracking store once, holding an exclusive lock on its
    directory: MLflow creates a new SQLite store's tables on first open, and two processes
    opening one at the same moment both run the migrations and fail ("duplicate column name",
    "table ... already exists"), leaving the file half-made. The lock holds every other process
    of this machine (two runs, two service jobs, a resume) until the first has made it; after
    that each opens a finished store. A directory, not a file beside the database: it leaves
    nothing in the output directory, and takes no lock on the database file, whose own locks
    are SQLite's. Other stores need nothing: a server or PostgreSQL makes its own schema.
    Raises ``TrackingError`` when the store cannot be made."""
    path = _sqlite_path(tracking_uri)
    if path is None:
        return
    path = os.path.abspath(path)
    with _made_stores_lock:  # threads of this process: one makes it, the others wait for it
        if path in _made_stores:
            return
        check_reachable(tracking_uri)  # its directory made and writable, or a clear error
        from mlflow import MlflowClient

        with _directory_locked(os.path.dirname(path)):
            if not os.path.exists(path):
                _copy_empty_store(path)
            _call(tracking_uri, "create its tables",
                  lambda: MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1))
        _made_stores.add(path)


def _copy_empty_store(path: str) -> None:
    """Put at ``path`` a copy of an empty store: MLflow's tables, migrated to its schema's head
    and holding no experiment, made once per user and MLflow schema (in the user's cache
    directory). MLflow makes a new SQLite store by running its 60-odd migrations, 2-4 s of CPU
    (as long as a tiny job's training here), on every new store; a copy takes milliseconds.
    The first open of the copy finds its tables at the head and no experiment, and makes the
    Default experiment itself, with the artifact root it would have given a store it made. Any
    failure (a new MLflow without these helpers, an unwritable cache) leaves the path alone:
    MLflow then makes the store as before."""
    import shutil

    try:
        import mlflow
        from mlflow.store.db import utils as db_utils

        cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "raytrain-sys")
        template = os.path.join(cache, f"mlflow-{mlflow.__version__}-{db_utils._get_latest_schema_revision()}.db")
        if not os.path.exists(template):
            os.makedirs(cache, exist_ok=True)
            made = f"{template}.{os.getpid()}.{threading.get_ident()}"
            engine = db_utils.create_sqlalchemy_engine_with_retry(f"sqlite:///{made}")
            try:
                db_utils._initialize_tables(engine)
            finally:
                engine.dispose()
            os.replace(made, template)  # whole or not at all, whoever makes it first
        copied = f"{path}.{os.getpid()}.{threading.get_ident()}"
        shutil.copyfile(template, copied)
        os.replace(copied, path)
    except Exception as exc:  # noqa: BLE001: MLflow makes the store itself
        log.debug("no copy of an empty MLflow store for %s (%s): MLflow makes it", path, exc)


@contextlib.contextmanager
def _directory_locked(directory: str):
    """An exclusive flock on ``directory`` while the block runs. Where a directory cannot be
    locked (an NFS mount emulates flock with write locks, which a directory refuses) the block
    runs unlocked: SQLite on such a mount is unsafe anyway."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            log.debug("cannot lock %s (%s): the MLflow store is made unlocked", directory, exc)
        yield
    finally:
        os.close(fd)  # the lock goes with it


_clients: dict[str, Any] = {}  # tracking URI -> this process's client (``_client``)
_clients_lock = threading.Lock()


def _client(tracking_uri: str):
    """This process's client of the store, made once (checked reachable first each time, so that
    a store gone since fails here with its clear error). Kept: a spare runner's warm client
    (``warm``) is the one its job opens its run on, and a sweep's follower polls every second.
    One client serves every tracker and thread of the process: MLflow's client holds no run
    state, and its SQL store and HTTP session are shared per URI by MLflow itself."""
    from mlflow import MlflowClient

    _bound_http_client(tracking_uri)
    check_reachable(tracking_uri)
    ensure_store(tracking_uri)
    with _clients_lock:
        client = _clients.get(tracking_uri)
        if client is None:
            client = _clients[tracking_uri] = MlflowClient(tracking_uri=tracking_uri)
        return client


def warm(tracking_uri: str) -> None:
    """Open the store as a run's start would, ahead of it: the client (MLflow keeps a SQLite
    store's engine per URI in the process, and a server's HTTP session), a first query, and
    the artifact code a run's start uses imported. In a new process the first open costs
    0.2-2 s (the schema checked, modules imported; more on a busy core); a process that waits
    for a job (a spare runner) pays it before the job comes. An error here is met again, and
    reported, when the run is opened."""
    try:
        _client(tracking_uri).search_experiments(max_results=1)
        if not _is_http(tracking_uri):
            import mlflow.store.artifact.local_artifact_repo  # noqa: F401 (the spec's artifacts)
    except Exception as exc:
        log.debug("preparing the MLflow store %s: %s (reported when the run is opened)", tracking_uri, exc)


def prepare_store(tracking_uri: str) -> threading.Thread:
    """Open the store in the background (``warm``: a new SQLite store spends seconds creating
    its tables), while the workers start; join the thread before the first real call."""
    thread = threading.Thread(target=warm, args=(tracking_uri,), name="mlflow-open", daemon=True)
    thread.start()
    return thread


def _get_run(client, tracking_uri: str, run_id: str):
    try:
        run = client.get_run(run_id)
    except Exception as exc:
        if getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise TrackingError(
                f"no MLflow run {run_id} in {tracking_uri}: check --tracking-uri"
            ) from None
        raise TrackingError(
            f"MLflow at {tracking_uri} failed to read run {run_id}: {_first_line(exc)}; "
            "check --tracking-uri and that the store is up"
        ) from exc
    if run.info.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow run {run_id} in {tracking_uri} is deleted: restore it with "
            f"`mlflow runs restore --run-id {run_id}` or start a new run"
        )
    return run


def _read_json_artifacts(client, tracking_uri: str, run_id: str, names: list[str]) -> dict[str, Any]:
    """The parsed JSON of those ``names`` that exist at the run's artifact root."""

    def read() -> dict[str, Any]:
        present = {info.path for info in client.list_artifacts(run_id)}
        out: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="raytrain-mlflow-") as tmp:
            for name in names:
                if name in present:
                    local = client.download_artifacts(run_id, name, dst_path=tmp)
                    with open(local, encoding="utf-8") as f:
                        out[name] = json.load(f)
        return out

    return _call(tracking_uri, f"read the artifacts of run {run_id}", read)


def _ensure_experiment(client, tracking_uri: str, name: str, artifact_root: str | None) -> str:
    experiment = _call(tracking_uri, f"look up experiment {name!r}",
                       lambda: client.get_experiment_by_name(name))
    if experiment is None:
        location = None
        if not _is_http(tracking_uri):
            # Without an explicit location a SQL store puts artifacts in ./mlruns of whatever
            # directory the driver runs in; keep them next to the database instead.
            db = _sqlite_path(tracking_uri)
            if artifact_root:
                location = os.path.abspath(artifact_root)
            elif db:
                location = os.path.join(os.path.dirname(os.path.abspath(db)), "mlartifacts")
        try:
            return client.create_experiment(name, artifact_location=location)
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise TrackingError(
                    f"MLflow at {tracking_uri} failed to create experiment {name!r}: "
                    f"{_first_line(exc)}; check tracking.uri / --tracking-uri"
                ) from exc
            # Another tracker created it at the same moment.
            experiment = _call(tracking_uri, f"look up experiment {name!r}",
                               lambda: client.get_experiment_by_name(name))
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} in {tracking_uri} is deleted: restore it with "
            f"`mlflow experiments restore --experiment-id {experiment.experiment_id}` or set "
            "tracking.experiment to another name"
        )
    return experiment.experiment_id


def _create_run(client, tracking_uri: str, experiment: str, run_name: str, spec: JobSpec,
                tags: dict[str, str], artifact_root: str | None) -> tuple[str, str]:
    """A new run (and its experiment if missing) with its tags and the spec's artifacts: its run
    id and experiment id. A run whose spec cannot be stored is marked FAILED, then raised."""
    experiment_id = _ensure_experiment(client, tracking_uri, experiment, artifact_root)
    run_tags = {k: _fit(v, MAX_TAG_VAL_LENGTH) for k, v in tags.items()}
    run_tags.update({
        TAG_SPEC_HASH: spec.spec_hash(),
        TAG_TRAINING_HASH: spec.training_hash(),
        TAG_VERSION: __version__,
        TAG_RESUME_COUNT: "0",
    })
    run = _call(tracking_uri, f"create a run in experiment {experiment!r}",
                lambda: client.create_run(experiment_id, run_name=run_name or None, tags=run_tags))
    run_id = run.info.run_id
    try:
        text = _spec_json(spec)
        for name in (ORIGINAL_SPEC_ARTIFACT, SPEC_ARTIFACT):
            _call(tracking_uri, f"store {name} of run {run_id}",
                  lambda name=name: client.log_text(run_id, text, name))
    except TrackingError:
        # Leave no half-made run looking alive.
        try:
            client.set_terminated(run_id, "FAILED")
        except Exception:
            pass
        raise
    return run_id, experiment_id


def _chunks(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


# ----------------------------------------------------------------------------- writer thread

@dataclass
class _Write:
    kind: str  # "open" (the run made: Tracker.begin), "batch" (metrics + tags), "params", "text" (an
    # artifact rewritten whole) or "plots"
    metrics: list = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    artifact: str = ""
    text: str = ""
    summary: dict = field(default_factory=dict)  # "plots": the summary they are drawn from
    count: int = 1  # calls merged into this write, for the dropped count
    params: list = field(default_factory=list)  # "params": the run's params, one batch
    opener: Callable[[], tuple] | None = None  # "open": makes the run, returns (client, run_id)


class _Writer:
    """One daemon thread applying a run's writes in order, with retries and a bounded queue.
    Made before its run exists (``Tracker.begin``: client None, run id ""), its first write is
    the "open" that makes the run; if that fails, ``open_error`` keeps why and every write
    queued or made after it is dropped (counted, without a warning each: the run failed)."""

    max_pending = 10_000  # writes waiting; beyond this new ones are dropped (MLflow down for long)
    backoff_s = 0.5  # doubled after each failed attempt
    warn_every_s = 30.0  # at most one "dropped" warning per interval

    def __init__(self, client, run_id: str, tracking_uri: str):
        self._client = client
        self._run_id = run_id
        self._tracking_uri = tracking_uri
        # MLflow's HTTP client already retries each request (_HTTP_CLIENT_BOUNDS); a local store
        # does not, and a busy SQLite file ("database is locked") clears within a second or two.
        self.attempts = 2 if _is_http(tracking_uri) else 4
        self._pending: collections.deque[_Write] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight = False
        self._closing = False
        self.dropped = 0
        self._last_warning = -float("inf")
        self.open_error: BaseException | None = None  # the "open" write's failure (Tracker.begin)
        self.opened = threading.Event()  # set once the run exists or failed to (at once: made open)
        if run_id:
            self.opened.set()
        self._thread = threading.Thread(
            target=self._loop, name=f"mlflow-writer-{run_id[:8] or 'opening'}", daemon=True
        )
        self._thread.start()

    # --- caller side
    def submit(self, write: _Write) -> None:
        with self._cond:
            if self.open_error is not None:  # no run to write to; the run was told (check_open)
                self.dropped += write.count
                return
            if self._closing:
                log.warning("MLflow run %s is finished; a late write was ignored", self._run_id)
                return
            if write.kind in ("text", "plots"):
                # A newer snapshot of the same file supersedes a pending one.
                self._pending = collections.deque(
                    w for w in self._pending
                    if not (w.kind == write.kind and w.artifact == write.artifact)
                )
            if len(self._pending) >= self.max_pending:
                self._drop(write, "the write queue is full")
                return
            self._pending.append(write)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending and not self._in_flight, timeout=timeout_s
            )

    def close(self, timeout_s: float) -> bool:
        """Stop taking writes and wait up to ``timeout_s`` for the queue; False if it did not drain."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        drained = self.flush(timeout_s)
        if not drained:
            self.abandon()
        self._thread.join(timeout=0.1 if not drained else 5.0)
        return drained

    def abandon(self) -> None:
        """Drop every queued write (counted); the one in flight, if any, ends on its own."""
        with self._cond:
            self._closing = True
            self.dropped += sum(w.count for w in self._pending)
            self._pending.clear()
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + int(self._in_flight)

    # --- thread side
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return
                write = self._take_locked()
                self._in_flight = True
            try:
                self._apply_with_retries(write)
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()

    def _take_locked(self) -> _Write:
        """Pop the next write; consecutive batches merge into one log_batch within MLflow's limits."""
        write = self._pending.popleft()
        if write.kind != "batch":
            return write
        merged = _Write("batch", list(write.metrics), dict(write.tags), count=write.count)
        while self._pending and self._pending[0].kind == "batch":
            nxt = self._pending[0]
            n_metrics = len(merged.metrics) + len(nxt.metrics)
            n_tags = len(merged.tags.keys() | nxt.tags.keys())
            if (n_metrics > MAX_METRICS_PER_BATCH or n_tags > MAX_PARAMS_TAGS_PER_BATCH
                    or n_metrics + n_tags > MAX_ENTITIES_PER_BATCH):
                break
            self._pending.popleft()
            merged.metrics.extend(nxt.metrics)
            merged.tags.update(nxt.tags)
            merged.count += nxt.count
        return merged

    def _apply(self, write: _Write) -> None:
        from mlflow.entities import RunTag

        if write.kind == "open":
            self._client, self._run_id = write.opener()
        elif write.kind == "batch":
            self._client.log_batch(
                self._run_id,
                metrics=write.metrics,
                tags=[RunTag(k, v) for k, v in write.tags.items()],
                synchronous=True,
            )
        elif write.kind == "params":
            self._client.log_batch(self._run_id, params=write.params, synchronous=True)
        elif write.kind == "plots":
            # Drawn in a child process, which this thread waits for: the step loop only handed
            # over a snapshot, and keeps this process's GIL to itself.
            from raytrain_sys.monitor.plots import write_plots_apart

            with tempfile.TemporaryDirectory(prefix="raytrain-plots-") as tmp:
                if write_plots_apart(write.summary, tmp):
                    self._client.log_artifacts(self._run_id, tmp, write.artifact)
        else:
            self._client.log_text(self._run_id, write.text, write.artifact)

    def _apply_with_retries(self, write: _Write) -> None:
        if write.kind == "open":  # retried inside (``_call``); what fails is kept, never retried here
            try:
                self._apply(write)
            except BaseException as exc:  # noqa: BLE001: raised in the caller's thread (check_open)
                with self._cond:
                    self.open_error, self._closing = exc, True  # the thread ends: no run to write to
                    self.dropped += sum(w.count for w in self._pending)
                    self._pending.clear()
            finally:
                self.opened.set()
            return
        for attempt in range(self.attempts):
            try:
                self._apply(write)
                return
            except Exception as exc:
                if attempt + 1 == self.attempts or not _is_transient(exc):
                    with self._cond:
                        self._drop(write, _first_line(exc))
                    return
                time.sleep(self.backoff_s * 2**attempt)

    def _drop(self, write: _Write, reason: str) -> None:
        # Called with the lock held.
        self.dropped += write.count
        now = time.monotonic()
        if now - self._last_warning >= self.warn_every_s:
            self._last_warning = now
            what = {"batch": "metrics/tags", "params": "params"}.get(write.kind, f"artifact {write.artifact}")
            log.warning(
                "MLflow write (%s) to run %s at %s dropped: %s (%d dropped so far; training "
                "continues)", what, self._run_id, self._tracking_uri, reason, self.dropped,
            )


# ----------------------------------------------------------------------------- the tracker

@dataclass
class RunRecord:
    """What ``lookup`` reads back from a run: enough to resume it."""

    run_id: str
    status: str
    spec_dict: dict[str, Any]  # the latest spec (after any resume); rebuild with spec.from_dict
    tags: dict[str, str]
    checkpoint_records: list[dict[str, Any]]  # in commit order; each has step, uri, recorded_at_s
    latest_checkpoint_uri: str  # "" when no checkpoint was recorded
    run_dir: str  # "" when the driver did not set raytrain.run_dir
    experiment_id: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)  # step, state, reason, time_s
    original_spec_dict: dict[str, Any] | None = None  # the spec the run was started with


class Tracker:
    """The driver's handle on one MLflow run. Create with ``start`` or ``resume``."""

    finish_timeout_s = 60.0  # how long finish() waits for queued writes before giving up

    def __init__(self, client, tracking_uri: str, run_id: str, experiment_id: str):
        self._client = client
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.experiment_id = experiment_id
        self._events: list[dict[str, Any]] = []
        self._checkpoints: list[dict[str, Any]] = []
        self._records_lock = threading.Lock()  # the lists are appended to and snapshotted whole
        self._finished = False
        self.open_span: tuple[float, float] | None = None  # begin(): the opening's perf_counter times
        self._plots_drawn_at: float | None = None  # the last redraw while training (plots_due)
        self._writer = _Writer(client, run_id, tracking_uri)

    # --- opening a run
    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        spec: JobSpec,
        tags: dict[str, str],
        artifact_root: str | None = None,
    ) -> Tracker:
        """Create a run (and its experiment if missing) holding the spec as params and artifact,
        and return once it exists (``begin``, waited for; its params still go through the
        writer). ``artifact_root`` is where a local (sqlite) store keeps artifacts, e.g.
        ``<output_dir>/mlartifacts``; an http server decides that itself.
        """
        tracker = cls.begin(tracking_uri, experiment, run_name, spec, tags, artifact_root)
        tracker.opened()
        return tracker

    @classmethod
    def begin(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        spec: JobSpec,
        tags: dict[str, str],
        artifact_root: str | None = None,
        on_open: Callable[[Tracker], None] | None = None,
    ) -> Tracker:
        """A run (and its experiment if missing) made by the writer as its first write, holding
        the spec as an artifact (stored with the run: what a resume reads) and as params (the
        writer's next writes: on a busy core their batches were most of a start's MLflow
        seconds, 0.2-0.6 s against 0.1 s to create the run). Returns at once, ``run_id`` ""
        until the run exists; what is logged meanwhile waits behind the opening, in order.
        ``on_open(tracker)`` is called in the writer's thread once the run exists (its spec
        stored, before its params), ``open_span`` then holding when the opening began and ended
        (``time.perf_counter``). A failed opening (the store refused, an experiment deleted; an
        unreachable store is the caller's pre-flight check) is kept: ``check_open`` raises it,
        ``opened`` waits for the opening and raises it, and every write is dropped."""
        from mlflow.entities import Param

        tracker = cls(None, tracking_uri, "", "")
        began = time.perf_counter()

        def open_run() -> tuple:
            client = _client(tracking_uri)
            run_id, experiment_id = _create_run(client, tracking_uri, experiment, run_name, spec, tags,
                                                artifact_root)
            tracker._client, tracker.run_id, tracker.experiment_id = client, run_id, experiment_id
            tracker.open_span = (began, time.perf_counter())
            if on_open is not None:
                try:
                    on_open(tracker)
                except Exception as exc:  # the caller's bookkeeping: the run stands
                    log.warning("after MLflow run %s opened: %s", run_id, exc)
            return client, run_id

        tracker._writer.submit(_Write("open", opener=open_run))
        params = [Param(k, v) for k, v in _spec_params(spec).items()]
        for chunk in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
            tracker._writer.submit(_Write("params", params=chunk))
        return tracker

    def check_open(self) -> None:
        """Raise the ``TrackingError`` of a failed opening (``begin``); nothing while it opens."""
        error = self._writer.open_error
        if error is None:
            return
        if isinstance(error, TrackingError):
            raise error
        raise TrackingError(f"MLflow at {self.tracking_uri} failed to open the run: {_first_line(error)}; "
                            "check tracking.uri / --tracking-uri and that the store is up and writable") from error

    def opened(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the run to exist (``begin``); raise if it failed to open.
        False on timeout."""
        done = self._writer.opened.wait(timeout_s)
        self.check_open()
        return done

    @classmethod
    def resume(cls, tracking_uri: str, run_id: str, spec: JobSpec) -> Tracker:
        """Reopen the same run for a resumed job (status RUNNING again, no new run).

        New spec fields become params; fields whose value changed (e.g. a raised
        train.max_steps) cannot be re-logged as params (MLflow refuses), so they are recorded as
        tags ``raytrain.resume.<n>.override.<key>``. ``spec.json`` becomes the resumed spec.
        """
        from mlflow.entities import Param, RunTag

        client = _client(tracking_uri)
        run = _get_run(client, tracking_uri, run_id)
        resume_index = int(run.data.tags.get(TAG_RESUME_COUNT, "0") or 0) + 1
        logged = run.data.params
        new_params: list[Param] = []
        tags = {
            TAG_RESUME_COUNT: str(resume_index),
            TAG_SPEC_HASH: spec.spec_hash(),
            TAG_TRAINING_HASH: spec.training_hash(),
            TAG_VERSION: __version__,
        }
        for key, value in _spec_params(spec).items():
            if key not in logged:
                new_params.append(Param(key, value))
            elif logged[key] != value:
                tags[resume_override_tag(resume_index, key)] = _fit(value, MAX_TAG_VAL_LENGTH)

        artifacts = _read_json_artifacts(client, tracking_uri, run_id,
                                         [CHECKPOINTS_ARTIFACT, EVENTS_ARTIFACT])
        _call(tracking_uri, f"reopen run {run_id}",
              lambda: client.update_run(run_id, status="RUNNING"))
        entities: list[Any] = new_params + [RunTag(k, v) for k, v in tags.items()]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            _call(tracking_uri, f"log the resumed params of run {run_id}",
                  lambda chunk=chunk: client.log_batch(
                      run_id,
                      params=[e for e in chunk if isinstance(e, Param)],
                      tags=[e for e in chunk if isinstance(e, RunTag)],
                      synchronous=True,
                  ))
        _call(tracking_uri, f"store {SPEC_ARTIFACT} of run {run_id}",
              lambda: client.log_text(run_id, _spec_json(spec), SPEC_ARTIFACT))
        tracker = cls(client, tracking_uri, run_id, run.info.experiment_id)
        # Records are rewritten whole, so carry the earlier ones forward.
        tracker._checkpoints = list(artifacts.get(CHECKPOINTS_ARTIFACT, []))
        tracker._events = list(artifacts.get(EVENTS_ARTIFACT, []))
        return tracker

    # --- writes while training (queued; never raise for MLflow trouble)
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)  # when measured, not when the writer sends it
        batch = [Metric(k, float(v), timestamp_ms, int(step)) for k, v in metrics.items()]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self._writer.submit(_Write("batch", metrics=chunk))

    def set_tags(self, tags: dict[str, str]) -> None:
        items = [(k, _fit(v, MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._writer.submit(_Write("batch", tags=dict(chunk)))

    def log_event(self, step: int, state: str, reason: str) -> None:
        """A supervisor state transition: tag ``raytrain.state`` and the list in events.json."""
        with self._records_lock:  # held while queueing so snapshots are queued in order
            self._events.append(
                {"step": int(step), "state": state, "reason": reason, "time_s": time.time()}
            )
            self._writer.submit(_Write("batch", tags={
                TAG_STATE: _fit(state, MAX_TAG_VAL_LENGTH),
                TAG_STATE_REASON: _fit(reason, MAX_TAG_VAL_LENGTH),
            }))
            text = json.dumps(self._events, indent=1, default=str)
            self._writer.submit(_Write("text", artifact=EVENTS_ARTIFACT, text=text))

    def record_checkpoint(self, step: int, uri: str, meta: dict) -> None:
        """A committed checkpoint: metric checkpoint_step, tag latest_checkpoint, checkpoints.json."""
        from mlflow.entities import Metric

        now = time.time()
        with self._records_lock:  # held while queueing so snapshots are queued in order
            self._checkpoints.append({**meta, "step": int(step), "uri": uri, "recorded_at_s": now})
            self._writer.submit(_Write(
                "batch",
                metrics=[Metric(CHECKPOINT_STEP_METRIC, float(step), int(now * 1000), int(step))],
                tags={TAG_LATEST_CHECKPOINT: _fit(uri, MAX_TAG_VAL_LENGTH)},
            ))
            text = json.dumps(self._checkpoints, indent=1, default=str)
            self._writer.submit(_Write("text", artifact=CHECKPOINTS_ARTIFACT, text=text))

    def log_stack(self, record: dict, kind: str = "hung") -> None:
        """A worker found hung (``kind`` "hung") or a straggler replaced ("straggler"): why, and
        every thread's Python stack (``liveness.hang_record``), as the text artifact
        ``hangs/step-<n>-worker-<slot>.txt`` (``hangs/step-<n>-straggler-<slot>.txt``)."""
        who = "worker" if kind == "hung" else kind
        name = f"{STACKS_ARTIFACT_DIR}/step-{record['step']}-{who}-{record['slot']}.txt"
        text = (f"{kind} worker {record['slot']} (rank {record['rank']}, pid {record.get('pid')}, node "
                f"{record.get('node', '')}) at step {record['step']}\n{record['reason']}\n\n{record['stack']}\n")
        self._writer.submit(_Write("text", artifact=name, text=text))

    def plots_due(self, now: float | None = None) -> bool:
        """Whether a checkpoint should redraw the plots while the run trains: none yet, or
        ``PLOTS_EVERY_S`` since the last. The end always redraws."""
        if self._plots_drawn_at is None:
            return True
        return (time.monotonic() if now is None else now) - self._plots_drawn_at >= PLOTS_EVERY_S

    def log_plots(self, summary: dict, *, at_end: bool = True) -> None:
        """Redraw the run's plots (``plots/*.png``) from ``summary`` (a snapshot: the caller's
        record keeps changing), in a child process the writer's thread waits for; a newer call
        supersedes a pending one. ``at_end=False``: a redraw while the run trains (a checkpoint;
        ask ``plots_due`` first, before taking the snapshot)."""
        if not at_end:
            self._plots_drawn_at = time.monotonic()
        self._writer.submit(_Write("plots", artifact=PLOTS_ARTIFACT_DIR, summary=summary))

    @property
    def dropped_batches(self) -> int:
        """Writes given up on after retries (metrics batches, tags, artifact rewrites)."""
        return self._writer.dropped

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write was sent (or dropped); False on timeout."""
        return self._writer.flush(timeout_s)

    # --- closing
    def finish(self, status: str) -> None:
        """Drain queued writes, then mark the run FINISHED, FAILED or KILLED.

        MLflow trouble here is a warning, not an error: the training result stands either way.
        When the server is unreachable at this point, finish returns at once instead of waiting
        for retries that cannot succeed.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status {status!r}: expected one of {', '.join(TERMINAL_STATUSES)}")
        if self._finished:
            return
        self._finished = True
        if self._writer.open_error is not None:  # no run was made; its error was raised (check_open)
            return
        if self._writer.dropped or self._writer.pending():
            try:
                check_reachable(self.tracking_uri, timeout_s=5.0)
            except TrackingError as exc:
                self._writer.abandon()
                log.warning("%s; run %s keeps status RUNNING in MLflow and lost %d writes",
                            exc, self.run_id, self._writer.dropped)
                return
        if not self._writer.close(self.finish_timeout_s):
            log.warning("MLflow run %s: writes still queued after %g s were abandoned",
                        self.run_id, self.finish_timeout_s)
        if self._writer.open_error is not None:  # the opening, still queued, failed meanwhile
            return
        if self._writer.dropped:
            log.warning("MLflow run %s: %d writes were dropped (MLflow unavailable or refused "
                        "them; see the earlier warnings)", self.run_id, self._writer.dropped)
        try:
            _call(self.tracking_uri, f"mark run {self.run_id} {status}",
                  lambda: self._client.set_terminated(self.run_id, status))
        except TrackingError as exc:
            log.warning("%s (the run stays RUNNING in MLflow)", exc)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # --- reading back
    @staticmethod
    def lookup(tracking_uri: str, run_id: str) -> RunRecord:
        """Read a run back for ``resume``; TrackingError if it does not exist or has no spec."""
        client = _client(tracking_uri)
        run = _get_run(client, tracking_uri, run_id)
        artifacts = _read_json_artifacts(
            client, tracking_uri, run_id,
            [SPEC_ARTIFACT, ORIGINAL_SPEC_ARTIFACT, CHECKPOINTS_ARTIFACT, EVENTS_ARTIFACT],
        )
        if SPEC_ARTIFACT not in artifacts:
            raise TrackingError(
                f"MLflow run {run_id} in {tracking_uri} has no {SPEC_ARTIFACT}: it was not "
                "started by raytrain-sys; give the run id printed by `raytrain-sys run`"
            )
        tags = dict(run.data.tags)
        return RunRecord(
            run_id=run_id,
            status=run.info.status,
            spec_dict=artifacts[SPEC_ARTIFACT],
            tags=tags,
            checkpoint_records=list(artifacts.get(CHECKPOINTS_ARTIFACT, [])),
            latest_checkpoint_uri=tags.get(TAG_LATEST_CHECKPOINT, ""),
            run_dir=tags.get(TAG_RUN_DIR, ""),
            experiment_id=run.info.experiment_id,
            events=list(artifacts.get(EVENTS_ARTIFACT, [])),
            original_spec_dict=artifacts.get(ORIGINAL_SPEC_ARTIFACT),
        )


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """Every (step, value) of one metric of a run, one value a step (the last logged: a resumed
    run that logged a step again), in step order. A sweep's trial follows its job's evaluations
    with it."""
    client = _clients.get(tracking_uri) or _client(tracking_uri)  # polled every second: no check each time
    points = _call(tracking_uri, f"read metric {key} of run {run_id}",
                   lambda: client.get_metric_history(run_id, key))
    by_step: dict[int, tuple[int, float]] = {}
    for m in points:
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[int(m.step)] = (m.timestamp, float(m.value))
    return [(step, value) for step, (_, value) in sorted(by_step.items())]


TAG_PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: the UI nests a child run under its parent
TAG_SWEEP = "raytrain_sys.sweep"


def start_parent_run(tracking_uri: str, experiment: str, run_name: str, params: dict[str, str],
                     tags: dict[str, str]) -> str:
    """A sweep's parent run (its trials' runs are its children): created with ``params``, left
    running until ``end_parent_run``. Returns its id."""
    from mlflow.entities import Param

    client = _client(tracking_uri)
    experiment_id = _ensure_experiment(client, tracking_uri, experiment, None)
    run = _call(tracking_uri, f"create a run in experiment {experiment!r}",
                lambda: client.create_run(experiment_id, run_name=run_name,
                                          tags={k: _fit(v, MAX_TAG_VAL_LENGTH) for k, v in tags.items()}))
    items = [Param(k, _fit(v, MAX_PARAM_VAL_LENGTH)) for k, v in params.items()]
    _call(tracking_uri, "log the sweep's params", lambda: client.log_batch(run.info.run_id, params=items))
    return run.info.run_id


def end_parent_run(tracking_uri: str, run_id: str, metrics: dict[str, float], tags: dict[str, str],
                   artifacts: dict[str, Any], status: str = "FINISHED", figures: dict[str, Any] | None = None) -> None:
    """Record a sweep's outcome on its parent run (metrics, tags, JSON artifacts, and
    ``figures``: matplotlib figures saved as PNGs under their names) and end it."""
    import tempfile
    import time as _time

    from mlflow.entities import Metric, RunTag

    client = _client(tracking_uri)
    now_ms = int(_time.time() * 1000)
    _call(tracking_uri, "log the sweep's outcome", lambda: client.log_batch(
        run_id, metrics=[Metric(k, float(v), now_ms, 0) for k, v in metrics.items()],
        tags=[RunTag(k, _fit(v, MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]))
    with tempfile.TemporaryDirectory() as tmp:
        for name, value in artifacts.items():
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                json.dump(value, f, indent=1, default=str)
            _call(tracking_uri, f"log {name}", lambda p=path: client.log_artifact(run_id, p))
        for name, fig in (figures or {}).items():
            path = os.path.join(tmp, name)
            fig.savefig(path)
            _call(tracking_uri, f"log {name}", lambda p=path: client.log_artifact(run_id, p))
    _call(tracking_uri, "end the sweep's run", lambda: client.set_terminated(run_id, status))


TAG_SEGMENT = "raytrain_sys.segment"
TAG_DONOR_TRIAL = "raytrain_sys.donor_trial"
TAG_DONOR_STEP = "raytrain_sys.donor_step"
TAG_DONOR_CHECKPOINT = "raytrain_sys.donor_checkpoint"


def mark_segment(tracking_uri: str, run_id: str, tags: dict[str, str], metrics: dict[str, float], step: int) -> bool:
    """Tag a PBT segment's run with its donor and log its mutated values as metrics at ``step``
    (its start), once: False when the run was marked already (a trial proxy driven again)."""
    from mlflow.entities import Metric, RunTag

    client = _client(tracking_uri)
    run = _get_run(client, tracking_uri, run_id)
    if TAG_SEGMENT in run.data.tags:
        return False
    now_ms = int(time.time() * 1000)
    _call(tracking_uri, "mark the segment's run", lambda: client.log_batch(
        run_id, metrics=[Metric(k, float(v), now_ms, int(step)) for k, v in metrics.items()],
        tags=[RunTag(k, _fit(v, MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]))
    return True


def spec_checkpoint_root(spec: dict, run_id: str | None) -> str:
    """Where a job spec given as a plain dict keeps its checkpoints: its ``checkpoint.uri``, else
    the root its MLflow run recorded (``<run dir>/checkpoints``); "" when it never started a run."""
    uri = (spec.get("checkpoint") or {}).get("uri") or ""
    if uri or not run_id:
        return uri
    return Tracker.lookup(spec_tracking_uri(spec), run_id).tags.get(TAG_CHECKPOINT_ROOT, "")
