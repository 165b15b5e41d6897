"""The HTTP API's front door: what every request meets before its endpoint and every refusal on
its way out, whichever layer refused it.

Owns:

* **Body limits** (``FrontDoor``, an ASGI middleware around the whole app): a package's body at
  most ``packages.MAX_BYTES``, any other at most ``JSON_BODY_MAX_BYTES``. A Content-Length over
  the limit is answered 413 before a byte of the body is read; a body that grows past it (no
  Content-Length, chunked) as soon as it does, and the rest is never read.
* **Body format**: a JSON body must be UTF-8 and strict JSON (RFC 8259: no NaN or Infinity, no
  number of more than Python's 4,300 digits, nested at most ``JSON_MAX_DEPTH`` deep). A refusal
  says which and where (line and column), never naming a byte offset as a field.
* **The refusal's shape**: every answer of 400 and above is ``ErrorOut`` JSON (``refusal``):
  FastAPI's request validation (translated by ``validation_refusal`` into one line naming the
  field: a body or query value out of bounds is 400, a path id that cannot exist 404), an
  unknown path (404), a method the path does not have (405, with an ``Allow`` header naming
  every method it has), the body checks above.
* **Every refusal audited once**: a refusal that left no audit row at the layer that refused it
  (``auth.audit_scope`` tells) gets one here: who (the token's principal if the token
  authenticates, else ``unauthenticated``), the method and path, the status and the reason.
  Values are quoted short (``errors.quote``; ``auth.record`` cuts each column).

It decides nothing about jobs or teams; the endpoints (``api.py``) do.
"""

from __future__ import annotations

import json
import logging
import re
import typing
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raytrain_sys.errors import quote
from raytrain_sys.service import auth, packages
from raytrain_sys.service.bounds import MAX_JOB_ID
from raytrain_sys.service.store import Store

log = logging.getLogger(__name__)

# A JSON body: a job spec is a few KB (the largest example, with every section, under 4 KB), so
# 1 MiB is hundreds of specs' worth, and parsing it takes milliseconds. Code and data travel
# otherwise (a code package; the dataset's store).
JSON_BODY_MAX_BYTES = 1 << 20
JSON_MAX_DEPTH = 64  # a spec is 3 levels deep; a body nested deeper is not a request
# Bodies under these are code packages (zip bytes): a team's (named), or the token's team's.
PACKAGES_PATH = re.compile(r"/v1/(teams/[^/]+/)?packages/")
ERROR_CAPTURE_BYTES = 1 << 16  # of a refusal's body, read back for its audit row
MESSAGE_MAX_CHARS = 2000  # a refusal's line: a few sentences, whatever a message quoted
FIELD_MAX_CHARS = 200  # a field's dotted name


def body_limit(path: str) -> tuple[int, str, str]:
    """(bytes, what, field) a request to ``path`` may send: a package's limit under
    ``PACKAGES_PATH``, else a JSON body's; ``field`` is what a 413 names."""
    if PACKAGES_PATH.match(path):
        return packages.MAX_BYTES, "a code package", "package"
    return JSON_BODY_MAX_BYTES, "a JSON body", "body"


def refusal(status: int, message: str, field: Optional[str] = None,
            headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """The one shape of every refusal: ``{"error": one line, "field": ...}`` (tokens blanked).
    Values in a message are quoted short where it is made (``errors.quote``); the cut here is
    the net under that, for a message that quoted something whole by mistake."""
    line = " ".join(auth.redact(message).split())
    if len(line) > MESSAGE_MAX_CHARS:
        line = line[:MESSAGE_MAX_CHARS] + f"... ({len(line)} characters)"
    if field is not None and len(field) > FIELD_MAX_CHARS:
        field = field[:FIELD_MAX_CHARS] + "..."
    return JSONResponse({"error": line, "field": field}, status_code=status, headers=headers)


class Refused(Exception):
    """A request the front door refuses before the app sees it."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status, self.field = status, field


# ----------------------------------------------------------------------------- the middleware


class FrontDoor:
    """The middleware (see the module docstring): body limit and format, and the audit row of a
    refusal no other layer recorded."""

    def __init__(self, app: ASGIApp, store: Store):
        self.app, self.store = app, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = {"status": 0, "body": b""}

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body" and answer["status"] >= 400:
                answer["body"] = (answer["body"] + message.get("body", b""))[:ERROR_CAPTURE_BYTES]
                if not message.get("more_body", False) and not rows:
                    # Before the answer's last byte: a client that has its answer finds the row.
                    await run_in_threadpool(self._audit, scope, answer["status"], answer["body"])
            await send(message)

        with auth.audit_scope() as rows:
            try:
                body = await _read_body(scope, receive)
                _check_json(scope, body)
            except Refused as refused:
                await refusal(refused.status, str(refused), refused.field)(scope, receive, noting)
            else:
                await self.app(scope, _replay(body, receive), noting)

    def _audit(self, scope: Scope, status: int, body: bytes) -> None:
        headers = dict(scope.get("headers") or [])
        who = auth.ANONYMOUS
        try:
            header = headers.get(b"authorization")
            if header:
                who = auth.authenticate(self.store, header.decode("latin-1")).name
        except auth.NotAuthenticated:
            pass
        try:
            reason = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            reason = quote(body.decode("utf-8", "replace"))
        try:
            auth.record(self.store, who, f"{scope['method']} {scope['path']}", "-", f"refused ({status}): {reason}")
        except Exception as exc:  # noqa: BLE001: the answer is sent; a store that is down cannot hold its row
            log.warning("could not audit a refusal (%s %s, %d): %s", scope["method"], quote(scope["path"]), status,
                        exc)


async def _read_body(scope: Scope, receive: Receive) -> bytes:
    """The whole body, or ``Refused`` (413) as soon as it is known to be over its limit."""
    limit, what, field = body_limit(scope["path"])
    declared = dict(scope.get("headers") or []).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise Refused(413, _too_large(what, limit, f"{int(declared)} bytes declared"), field)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(413, _too_large(what, limit, f"over {limit} bytes sent"), field)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _too_large(what: str, limit: int, got: str) -> str:
    advice = ("leave data out of it (--exclude PATTERN) and read it from its store (data.path)"
              if what == "a code package" else "a job spec is a few KB: send code as a package "
                                               "(jobs submit --working-dir) and keep data in its store")
    return f"request body: {got}, over the {limit / 2 ** 20:g} MiB ({limit} bytes) {what} may have; {advice}"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body read already, then the connection's own
    messages (a disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _is_json(scope: Scope) -> bool:
    content_type = dict(scope.get("headers") or []).get(b"content-type", b"").decode("latin-1")
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _check_json(scope: Scope, body: bytes) -> None:
    """A JSON body is UTF-8 and strict JSON, nested at most ``JSON_MAX_DEPTH`` deep."""
    if not body or not _is_json(scope):
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(400, f"the body is not UTF-8 text (byte {exc.start}: {quote(body[exc.start:exc.start + 4])}); "
                           f"send JSON encoded as UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise Refused(400, f"the body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise Refused(400, f"the body is not a request: JSON nested more than {JSON_MAX_DEPTH} deep") from None
    except ValueError as exc:  # a NaN or Infinity (_no_constant), a number of more than 4,300 digits
        raise Refused(400, f"the body is not valid JSON: {str(exc).split(';')[0]}") from None
    if _depth_over(value, JSON_MAX_DEPTH):
        raise Refused(400, f"the body is not a request: JSON nested more than {JSON_MAX_DEPTH} deep")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259); send a finite number")


def _depth_over(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


# ----------------------------------------------------------------------------- refusals of other layers


def install(app: FastAPI, store: Store) -> None:
    """Put the front door on ``app``: the middleware, the refusal handlers of FastAPI's and
    Starlette's own errors, and an OpenAPI document that says what the server answers."""
    app.add_middleware(FrontDoor, store=store)

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_refusal(request, exc.errors())

    @app.exception_handler(StarletteHTTPException)
    def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            return refusal(404, f"no such path: {request.method} {quote(path)} (the API's paths: /openapi.json)")
        if exc.status_code == 405:
            allowed = allowed_methods(app, path)
            return refusal(405, f"{quote(path)} has no method {request.method}; it has {', '.join(allowed)}",
                           headers={"Allow": ", ".join(allowed)})
        return refusal(exc.status_code, str(exc.detail))

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` has for ``path`` (a 405's ``Allow``)."""
    methods: set[str] = set()
    for route in app.router.routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= set(route_methods)
    return sorted(methods)


def validation_refusal(request: Request, errors: typing.Sequence[dict]) -> JSONResponse:
    """FastAPI's first validation error as one line naming the field. A body field is named as
    the API's errors name it (``team.`` before a team's fields); a list item by its list, with
    its index in the message; a path id that cannot exist is a 404."""
    first = dict(errors[0]) if errors else {"loc": ("body",), "msg": "invalid request", "type": "invalid"}
    loc = tuple(first.get("loc") or ("body",))
    where, names = loc[0], list(loc[1:])
    kind, value = first.get("type", ""), first.get("input")
    index = next((i for i, part in enumerate(names) if not isinstance(part, str)), None)
    item = f"item {names[index]}: " if index is not None else ""
    names = names[:index] if index is not None else names
    if kind == "json_invalid":  # FrontDoor parses JSON bodies first; kept for a route it does not see
        return refusal(400, f"the body is not valid JSON: {(first.get('ctx') or {}).get('error', 'decode error')}")
    if where == "body" and not names:
        return refusal(400, _body_problem(request, kind, value))
    if where == "path":
        return _path_refusal(request, str(names[0]), value, _reason(first))
    field = ".".join(str(n) for n in names)
    if where == "body":
        field = _body_prefix(request) + field
    if kind == "missing":
        return refusal(400, f"field '{field}': required", field)
    return refusal(400, f"field '{field}': {item}{_reason(first)}", field)


def _reason(error: dict) -> str:
    """What was wrong with the value, after ``got <its quote>``."""
    kind, value, msg = error.get("type", ""), error.get("input"), str(error.get("msg", "invalid"))
    if kind == "value_error":  # our own rules (bounds.name_problem, ...) say "got ..." themselves
        return msg.removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return "unknown field"
    return f"got {quote(value)}; {msg[:1].lower()}{msg[1:]}"


def _body_problem(request: Request, kind: str, value: Any) -> str:
    model = _body_model(request)
    takes = f"{{{', '.join(model.model_fields)}}}" if model is not None else "a JSON object"
    if kind == "missing":
        return f"the request needs a JSON body: {takes} (Content-Type: application/json)"
    if isinstance(value, (bytes, bytearray)):
        return f"the body must be JSON: send {takes} with Content-Type: application/json"
    return f"the body must be a JSON object {takes}, got {type(value).__name__} {quote(value)}"


def _path_refusal(request: Request, name: str, value: Any, reason: str) -> JSONResponse:
    if name == "job_id":
        return refusal(404, f"no job {quote(value)}: a job's id is an integer 1..{MAX_JOB_ID}", "job_id")
    if name == "sha256":
        if request.method == "PUT":  # an upload names a new package: its name is input
            return refusal(400, f"field 'package': got {quote(value)}; a package is named by its sha256: "
                                f"64 lower-case hex digits", "package")
        return refusal(404, f"no package {quote(value)}: a package is named by its sha256, 64 lower-case hex digits",
                       "sha256")
    if name == "name":
        return refusal(404, f"no team {quote(value)}: {reason}", "team")
    return refusal(404, f"no {name} {quote(value)}: {reason}", name)


def _body_model(request: Request) -> Optional[type[BaseModel]]:
    """The pydantic model of the route's body, if it has one."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    annotation = getattr(getattr(body_field, "field_info", None), "annotation", None)
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _body_prefix(request: Request) -> str:
    """How the API's errors name the fields of this route's body (``field_prefix`` of its model)."""
    return getattr(_body_model(request), "field_prefix", "")


# ----------------------------------------------------------------------------- the published schema


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, made to say what the server answers: a validation error is a 400 in
    ``ErrorOut`` (FastAPI documents a 422 that never comes), and its models are dropped."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    app.openapi_schema = doc
    return doc


__all__ = ["FrontDoor", "JSON_BODY_MAX_BYTES", "JSON_MAX_DEPTH", "allowed_methods", "body_limit", "install", "refusal",
           "validation_refusal"]
