"""An MLflow store as this process reaches it: checked, made once, one client per store.

Owns: whether a store can be used (``check_reachable``: fails fast, with what to do), the making
of a new SQLite store, once, under a lock on its directory and from a copy of an empty store
(``ensure_store``: runs opened at the same moment never race MLflow's migrations), this process's
one client per store (``client``: checked reachable and made first; ``warm`` and
``prepare_store`` open a store ahead of a run, so a spare runner's warm client is the one its
job's run opens on), one synchronous MLflow call with its retries and its ``TrackingError``
(``call``), a run read or an experiment made with errors a user can act on (``get_run``,
``ensure_experiment``), and MLflow's limits (``fit``: a value cut to them). Writes no run: a run's
record is the tracker's (``mlflow_tracker``), through its writer thread (``mlflow_writer``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.parse
from typing import Any, Callable

from raytrain_sys.errors import TrackingError

log = logging.getLogger(__name__)

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


def is_http(tracking_uri: str) -> bool:
    """Whether the store is an MLflow server (its client retries each request itself)."""
    return urllib.parse.urlparse(tracking_uri).scheme in ("http", "https")


def sqlite_path(tracking_uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI, or None for other stores and in-memory DBs."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    path = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else ""
    path = path.split("?", 1)[0]
    return None if path in ("", ":memory:") else path


def fit(value: Any, limit: int) -> str:
    """``value`` as text within ``limit`` characters (MLflow refuses a longer one), cut with a marker."""
    text = str(value)
    if len(text) <= limit:
        return text
    return text[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def first_line(exc: BaseException) -> str:
    """What an MLflow failure says, in one line a user can read."""
    text = str(exc).strip() or type(exc).__name__
    if "Max retries exceeded" in text or "Failed to establish a new connection" in text:
        # MLflow wraps urllib3's long repr of the failed connection; say what it means.
        return "cannot connect to the server (connection refused, reset or timed out)"
    return text.splitlines()[0][:300]


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the call may help (MLflow's error code is not one of the permanent ones)."""
    code = getattr(exc, "error_code", None)
    return code not in _PERMANENT_ERROR_CODES


def call(tracking_uri: str, what: str, fn: Callable[[], Any], attempts: int = 3) -> Any:
    """Run one synchronous MLflow call; transient failures are retried, then a TrackingError."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:  # MlflowException, requests and sqlite errors alike
            if attempt + 1 < attempts and is_transient(exc):
                time.sleep(0.5 * 2**attempt)
                continue
            raise TrackingError(
                f"MLflow at {tracking_uri} failed to {what}: {first_line(exc)}; "
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
    path = sqlite_path(tracking_uri)
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
    if is_http(tracking_uri):
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
    path = sqlite_path(tracking_uri)
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
            call(tracking_uri, "create its tables",
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


_clients: dict[str, Any] = {}  # tracking URI -> this process's client (``client``)
_clients_lock = threading.Lock()


def client(tracking_uri: str, *, recheck: bool = True):
    """This process's client of the store, made once (checked reachable first each time, so that
    a store gone since fails here with its clear error; ``recheck=False``: a client made already
    is returned unchecked, for a caller that polls). Kept: a spare runner's warm client
    (``warm``) is the one its job opens its run on, and a sweep's follower polls every second.
    One client serves every tracker and thread of the process: MLflow's client holds no run
    state, and its SQL store and HTTP session are shared per URI by MLflow itself."""
    if not recheck and tracking_uri in _clients:
        return _clients[tracking_uri]
    from mlflow import MlflowClient

    _bound_http_client(tracking_uri)
    check_reachable(tracking_uri)
    ensure_store(tracking_uri)
    with _clients_lock:
        made = _clients.get(tracking_uri)
        if made is None:
            made = _clients[tracking_uri] = MlflowClient(tracking_uri=tracking_uri)
        return made


def warm(tracking_uri: str) -> None:
    """Open the store as a run's start would, ahead of it: the client (MLflow keeps a SQLite
    store's engine per URI in the process, and a server's HTTP session), a first query, and
    the artifact code a run's start uses imported. In a new process the first open costs
    0.2-2 s (the schema checked, modules imported; more on a busy core); a process that waits
    for a job (a spare runner) pays it before the job comes. An error here is met again, and
    reported, when the run is opened."""
    try:
        client(tracking_uri).search_experiments(max_results=1)
        if not is_http(tracking_uri):
            import mlflow.store.artifact.local_artifact_repo  # noqa: F401 (the spec's artifacts)
    except Exception as exc:
        log.debug("preparing the MLflow store %s: %s (reported when the run is opened)", tracking_uri, exc)


def prepare_store(tracking_uri: str) -> threading.Thread:
    """Open the store in the background (``warm``: a new SQLite store spends seconds creating
    its tables), while the workers start; join the thread before the first real call."""
    thread = threading.Thread(target=warm, args=(tracking_uri,), name="mlflow-open", daemon=True)
    thread.start()
    return thread


def get_run(client, tracking_uri: str, run_id: str):
    try:
        run = client.get_run(run_id)
    except Exception as exc:
        if getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise TrackingError(
                f"no MLflow run {run_id} in {tracking_uri}: check --tracking-uri"
            ) from None
        raise TrackingError(
            f"MLflow at {tracking_uri} failed to read run {run_id}: {first_line(exc)}; "
            "check --tracking-uri and that the store is up"
        ) from exc
    if run.info.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow run {run_id} in {tracking_uri} is deleted: restore it with "
            f"`mlflow runs restore --run-id {run_id}` or start a new run"
        )
    return run


def ensure_experiment(client, tracking_uri: str, name: str, artifact_root: str | None) -> str:
    experiment = call(tracking_uri, f"look up experiment {name!r}",
                      lambda: client.get_experiment_by_name(name))
    if experiment is None:
        location = None
        if not is_http(tracking_uri):
            # Without an explicit location a SQL store puts artifacts in ./mlruns of whatever
            # directory the driver runs in; keep them next to the database instead.
            db = sqlite_path(tracking_uri)
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
                    f"{first_line(exc)}; check tracking.uri / --tracking-uri"
                ) from exc
            # Another tracker created it at the same moment.
            experiment = call(tracking_uri, f"look up experiment {name!r}",
                              lambda: client.get_experiment_by_name(name))
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} in {tracking_uri} is deleted: restore it with "
            f"`mlflow experiments restore --experiment-id {experiment.experiment_id}` or set "
            "tracking.experiment to another name"
        )
    return experiment.experiment_id

