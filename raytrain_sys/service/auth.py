"""Who may do what in the job service: bearer tokens, team scoping, the audit trail.

Owns: turning an ``Authorization: Bearer <token>`` header into a ``Principal`` (a team, or the
admin), the rule that a team's token acts on its own team's jobs only and that teams and tokens
are the admin's, the audit row of every action (allowed or refused), and the first admin
token (``init_admin``). It writes only audit rows (and, in ``init_admin``, one token).

Tokens never leave the request that carries them: the store keeps only their HMAC, a message
or audit row names the principal ("team a", "admin"), never the token, and
``TokenRedactingFilter`` on the service's and uvicorn's loggers blanks anything shaped like one
in case a caller logs a header by mistake. No HTTP here: refusals are ``NotAuthenticated`` and
``NotAllowed``, which the API turns into 401 and 403.

An audit row holds what a user sent only as a short quote: ``record`` escapes control
characters and cuts each column to its width (``errors.quote``'s length for a user's value), so
a 10 MB value or a NUL byte is never stored. ``audit_scope`` lets the API see whether a request
left a row (so a refusal is recorded once, at whichever layer refused it).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Iterator
from typing import Optional

from raytrain_sys.service.store import TOKEN_PREFIX, Principal, Store

ANONYMOUS = "unauthenticated"  # the audit actor of a request without a valid token
BOOTSTRAP = "bootstrap"  # the audit actor of init_admin (whoever holds the database URL)
_TOKEN_RE = re.compile(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_\-]+")
# The audit table's column widths (tables.audit): actor and action 64, target 200; result is
# text, cut here to a few lines' worth: a refusal's reason, not the request that caused it.
AUDIT_WIDTHS = {"actor": 64, "action": 64, "target": 200, "result": 1000}
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# The rows recorded in the current request so far (None outside one): see ``audit_scope``.
_ROWS: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("raytrain_sys_audit_rows", default=None)


class NotAuthenticated(Exception):
    """No token, a malformed header, or a token the store does not know (or has revoked)."""


class NotAllowed(Exception):
    """A valid token asked for something its principal may not do."""


def redact(text: str) -> str:
    """``text`` with anything shaped like a service token replaced by ``rts_***``."""
    return _TOKEN_RE.sub(TOKEN_PREFIX + "***", text)


class TokenRedactingFilter(logging.Filter):
    """Blanks tokens in a record's message before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if TOKEN_PREFIX in message:
            record.msg, record.args = redact(message), None
        return True


_FILTER = TokenRedactingFilter()
REDACTED_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "fastapi", "raytrain_sys.service",
                    "raytrain_sys.service.api", "raytrain_sys.service.auth", "raytrain_sys.service.store",
                    "raytrain_sys.service.client")


def install_log_redaction() -> None:
    """Put the redacting filter on the service's and uvicorn's loggers (idempotent). A filter on
    a logger sees only records made on that logger, hence each is named."""
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def bearer_token(header: Optional[str]) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; raises ``NotAuthenticated``."""
    if not header:
        raise NotAuthenticated("missing token: send 'Authorization: Bearer <token>'")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise NotAuthenticated("malformed Authorization header: expected 'Bearer <token>'")
    return token.strip()


def authenticate(store: Store, header: Optional[str]) -> Principal:
    """The principal behind the header's token; raises ``NotAuthenticated`` (never naming the
    token) when it is missing, malformed, unknown or revoked."""
    principal = store.authenticate(bearer_token(header))
    if principal is None:
        raise NotAuthenticated("invalid or revoked token")
    return principal


def check_team(principal: Principal, team: str, what: str) -> None:
    """A team's token acts only on its own team; the admin on every team."""
    if not principal.is_admin and principal.team != team:
        raise NotAllowed(f"team {principal.team}'s token cannot act on {what} of team {team}")


def check_admin(principal: Principal, what: str) -> None:
    if not principal.is_admin:
        raise NotAllowed(f"{what} needs an admin token; team {principal.team}'s token is not one")


def record(store: Store, actor: str, action: str, target: str, result: str) -> None:
    """One audit row (who, what, on what, how it ended), with any token-shaped text blanked,
    control characters escaped and each column cut to its width (``AUDIT_WIDTHS``)."""
    actor, action, target, result = (_column(name, text) for name, text in
                                      (("actor", actor), ("action", action), ("target", target), ("result", result)))
    store.record_audit(actor, action, target, result)
    rows = _ROWS.get()
    if rows is not None:
        rows.append((action, result))


def _column(name: str, text: str) -> str:
    text = _CONTROL_RE.sub(lambda m: repr(m.group())[1:-1], redact(str(text)))
    width = AUDIT_WIDTHS[name]
    if len(text) <= width:
        return text
    more = f"... ({len(text)} characters)"
    return text[:width - len(more)] + more


@contextlib.contextmanager
def audit_scope() -> Iterator[list]:
    """The audit rows ``record`` writes inside the block (in this context and in threads started
    with a copy of it, as Starlette's threadpool does), as (action, result) pairs."""
    rows: list = []
    reset = _ROWS.set(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(reset)


def init_admin(store: Store, *, rotate: bool = False) -> str:
    """Issue an admin token and return it (the only time it is visible). With ``rotate`` every
    earlier admin token is revoked first. Whoever can open the database can do this: the
    database URL is the root credential of the service."""
    revoked = store.revoke_tokens(None) if rotate else 0
    token = store.issue_token(None)
    record(store, BOOTSTRAP, "issue_admin_token", "admin",
           f"ok (revoked {revoked} earlier admin tokens)" if rotate else "ok")
    return token


__all__ = ["ANONYMOUS", "AUDIT_WIDTHS", "NotAuthenticated", "audit_scope", "NotAllowed", "Principal", "TokenRedactingFilter", "authenticate",
           "bearer_token", "check_admin", "check_team", "init_admin", "install_log_redaction", "record", "redact"]
