"""Errors a user can act on.

Every error that reaches the CLI as a one-line message derives from ``UserError``: it says what
was wrong, where, and what to do next. Anything else is a bug in raytrain-sys and is shown with
its traceback.

A message quotes a user's value with ``quote``: its ``repr``, cut to ``QUOTE_CHARS`` characters,
so a 10 MB value is never echoed whole into an error, a log line or an audit row.
"""

import re

QUOTE_CHARS = 80  # enough to recognise a value; a whole value is the user's to keep, not ours to echo


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters of it, then how long the whole
    was. Control characters come out escaped (``repr``), so the quote stays on one line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"an integer of {value.bit_length()} bits"  # repr may refuse it (int_max_str_digits)
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{repr(value[:limit])[:limit]}... ({len(value)} characters)"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class UserError(Exception):
    """An error caused by input or environment, reported as one line with exit code 2."""

    exit_code = 2


class SpecError(UserError):
    """A job spec field is missing, unknown, of the wrong type or out of range."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"spec field '{field}': {message}")


class ClusterCapacityError(UserError):
    """The Ray cluster cannot hold the requested worker group."""


class StorageError(UserError):
    """A checkpoint or data store is unreachable, refuses credentials, or is full."""


class DataError(UserError):
    """A dataset, manifest or shard is missing or corrupt."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or corrupt."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint's files are not what its manifest records (found when loading:
    a file missing, of another sha256 or step, or not covering the state); an older one may
    still be intact."""


class TrackingError(UserError):
    """The MLflow tracking store is unreachable or refuses a write."""


class ServiceInputError(UserError):
    """A request to the job service names an unknown team, a value out of range, or asks for
    more than the team could ever get; nothing was written."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"field '{field}': {message}")

    def __reduce__(self):
        # Rebuilt from (field, message), not from the formatted text: a refusal raised in the
        # service actor reaches its caller (a notebook, a test) as itself, field included.
        return type(self), (self.field, self.message)


class ServiceStoreError(UserError):
    """The job service's database is unreachable or refused a write (the URL is shown with its
    password masked)."""


class JobStateConflict(UserError):
    """A job is not in a state the requested change can start from (it moved meanwhile, or the
    request does not apply to it); nothing was written."""


class ServiceRequestError(UserError):
    """The job service refused a request: ``status`` is the HTTP status (None when the service
    could not be reached at all) and the message is the server's."""

    def __init__(self, status: int | None, message: str):
        self.status = status
        # UserError's, not super()'s: in the subclasses below the next class in line is
        # ServiceInputError or JobStateConflict, whose message is made differently.
        UserError.__init__(self, message if status is None else f"HTTP {status}: {message}")


class ServiceRequestInvalid(ServiceRequestError, ServiceInputError):
    """HTTP 400 from the job service: the field it names is wrong; nothing was written."""

    def __init__(self, field: str, message: str):
        self.field = field
        ServiceRequestError.__init__(self, 400, message)


class ServiceRequestConflict(ServiceRequestError, JobStateConflict):
    """HTTP 409 from the job service: the job's state does not allow the request."""

    def __init__(self, message: str):
        ServiceRequestError.__init__(self, 409, message)


class TrainingFailed(UserError):
    """Training stopped because workers failed and the run could not continue."""

    exit_code = 3


def find_user_error(exc: BaseException) -> UserError | None:
    """The UserError behind ``exc``, if any, with a one-line message.

    Ray wraps exceptions raised in tasks and actors (RayTaskError, Ray Data's UserCodeException)
    and appends the remote traceback to the message; the user needs only our line.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            cls = next((c for c in type(e).__mro__ if c.__module__ == __name__), UserError)
            line = str(e).strip().splitlines()
            err = cls.__new__(cls)
            Exception.__init__(err, _our_line(line))
            return err
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return _named_in_text(exc)


# How a traceback's last line names one of ours: "raytrain_sys.errors.UserError: <message>".
_OURS_IN_TEXT = re.compile(rf"^{re.escape(__name__)}\.(\w+): (.+)$", re.MULTILINE)


def _named_in_text(exc: BaseException) -> UserError | None:
    """The UserError a remote traceback's text ends with: all that Ray keeps of an exception
    raised in an actor's constructor (its ActorDiedError carries the text, no cause)."""
    found = _OURS_IN_TEXT.findall(str(exc))
    cls = globals().get(found[-1][0]) if found else None
    if not (isinstance(cls, type) and issubclass(cls, UserError)):
        return None
    err = cls.__new__(cls)
    Exception.__init__(err, found[-1][1].strip())
    return err


def _our_line(lines: list[str]) -> str:
    # RayTaskError text ends with "<ErrorClass>: <message>"; keep the message only.
    for line in reversed(lines):
        for name in ("StorageError", "DataError", "CheckpointError", "CheckpointCorrupt", "TrackingError", "SpecError",
                     "ClusterCapacityError", "ServiceInputError", "ServiceStoreError", "JobStateConflict",
                     "ServiceRequestError", "ServiceRequestInvalid", "ServiceRequestConflict",
                     "TrainingFailed", "UserError"):
            marker = f"{name}: "
            if marker in line:
                return line.split(marker, 1)[1]
    return lines[-1] if lines else ""
