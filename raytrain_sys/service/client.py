"""A Python client of the job service's HTTP API, for notebooks and the CLI.

    from raytrain_sys.service.client import Client
    c = Client("http://head:8265", token)        # or Client.from_env()
    job = c.submit("jobs/tiny.yaml", overrides=["train.max_steps=50"])
    for text in c.logs(job["id"], follow=True): print(text, end="")

Owns nothing on the server: every call is one HTTP request (``logs(follow=True)`` polls). It
speaks with the standard library's ``urllib`` (no extra dependency; the API is small JSON and
text). Errors say what happened and never carry the token: a refused request raises
``ServiceRequestError`` with the HTTP status and the server's message (``ServiceRequestInvalid``,
a ``ServiceInputError`` with ``.field``, for a 400; ``ServiceRequestConflict``, a
``JobStateConflict``, for a 409); a service that cannot be reached raises one
``ServiceRequestError`` naming the URL. A team's (or cohort's) name is checked before anything
is sent, by the rule the service holds it to (``service/bounds.py``): a name the service would
refuse raises the service's own answer (``ServiceRequestInvalid``, its field and message), so a
caller handles one error wherever it came from, and a name no URL could carry is never sent.
"""

from __future__ import annotations

import codecs
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

from raytrain_sys.errors import ServiceRequestConflict, ServiceRequestError, ServiceRequestInvalid, UserError
from raytrain_sys.service import packages
from raytrain_sys.service.bounds import name_problem, team_ref_problem
from raytrain_sys.spec import read_spec_file

URL_ENV = "RAYTRAIN_SYS_SERVICE_URL"
TOKEN_ENV = "RAYTRAIN_SYS_TOKEN"
TERMINAL_STATES = frozenset({"finished", "failed", "cancelled"})
REQUEST_TIMEOUT_S = 30.0  # one request; a store behind a slow database answers in well under this
FOLLOW_POLL_S = 1.0  # logs(follow=True) asks for new bytes this often
WAIT_POLL_S = 1.0


class Client:
    """The job service at ``url`` (e.g. ``http://127.0.0.1:8000``), acting with ``token``."""

    def __init__(self, url: str, token: Optional[str], *, timeout_s: float = REQUEST_TIMEOUT_S):
        if not url:
            raise UserError(f"no job service URL: pass --url or set {URL_ENV}")
        if not url.startswith(("http://", "https://")):
            raise UserError(f"job service URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    @classmethod
    def from_env(cls, url: Optional[str] = None, token: Optional[str] = None) -> "Client":
        """``url`` and ``token``, else ``RAYTRAIN_SYS_SERVICE_URL`` and ``RAYTRAIN_SYS_TOKEN``."""
        return cls(url or os.environ.get(URL_ENV, ""), token or os.environ.get(TOKEN_ENV) or None)

    def __repr__(self) -> str:  # never the token
        return f"Client({self.url!r})"

    # ------------------------------------------------------------------ jobs

    def submit(self, spec_or_path: Union[str, os.PathLike, dict], team: Optional[str] = None,
               priority: Optional[int] = None, overrides: Optional[Iterable[str]] = None,
               name: Optional[str] = None, working_dir: Union[str, os.PathLike, None] = None,
               excludes: Iterable[str] = ()) -> dict:
        """Queue a job: ``spec_or_path`` is a spec mapping, a path to a YAML spec, or YAML text.
        ``working_dir``: a local directory whose files travel with the job (its code: the
        modules ``model.factory``, ``train.task`` and ``data.transform`` name), packed and
        uploaded first (``upload_package``; ``excludes``: glob patterns left out). Returns the
        job as stored (state ``queued``)."""
        body: dict[str, Any] = {"spec": _spec_body(spec_or_path), "overrides": list(overrides or [])}
        if team is not None:
            body["team"] = _team_ref(team)
        if priority is not None:
            body["priority"] = priority
        if name is not None:
            body["name"] = name
        if working_dir is None:
            return self._json("POST", "/v1/jobs", body)
        for attempt in (1, 2):
            body["package"] = self.upload_package(working_dir, team=team, excludes=excludes)["sha256"]
            try:
                return self._json("POST", "/v1/jobs", body)
            except ServiceRequestInvalid as exc:  # pruned by the service since the upload found it there
                if exc.field != "package" or attempt == 2:
                    raise

    # ------------------------------------------------------------------ sweeps

    def submit_sweep(self, sweep_or_path: Union[str, os.PathLike, dict], team: Optional[str] = None,
                     priority: Optional[int] = None) -> dict:
        """Queue a sweep (docs/SWEEPS.md): ``sweep_or_path`` is a sweep mapping or a sweep file
        (its ``base`` may name a job spec file, read here). Returns the sweep (state ``queued``)."""
        from raytrain_sys.service.sweeps.spec import load_sweep_file

        sweep = sweep_or_path if isinstance(sweep_or_path, dict) else load_sweep_file(os.fspath(sweep_or_path))
        body: dict[str, Any] = {"sweep": sweep}
        if team is not None:
            body["team"] = _team_ref(team)
        if priority is not None:
            body["priority"] = priority
        return self._json("POST", "/v1/sweeps", body)

    def sweeps(self, team: Optional[str] = None) -> list[dict]:
        return self._json("GET", "/v1/sweeps", query=[("team", _team_ref(team))] if team else None)

    def sweep(self, sweep_id: int) -> dict:
        """The sweep with its trials' jobs (``trials``)."""
        return self._json("GET", f"/v1/sweeps/{int(sweep_id)}")

    def pause_sweep(self, sweep_id: int, reason: Optional[str] = None) -> dict:
        return self._json("POST", f"/v1/sweeps/{int(sweep_id)}/pause", _action(reason))

    def resume_sweep(self, sweep_id: int, reason: Optional[str] = None) -> dict:
        return self._json("POST", f"/v1/sweeps/{int(sweep_id)}/resume", _action(reason))

    def cancel_sweep(self, sweep_id: int, reason: Optional[str] = None) -> dict:
        return self._json("POST", f"/v1/sweeps/{int(sweep_id)}/cancel", _action(reason))

    def upload_package(self, directory: Union[str, os.PathLike], team: Optional[str] = None,
                       excludes: Iterable[str] = ()) -> dict:
        """Pack ``directory`` (``service/packages.pack``) and upload it unless the service holds
        it for the team already (``team``: the token's own when not given; the admin names one).
        Returns its info (``sha256``, ``size_bytes``, ``files``)."""
        data = packages.pack(directory, excludes)
        sha = packages.digest(data)
        path = f"{_team_path(team) if team else '/v1'}/packages/{sha}"
        try:
            return self._json("GET", path)
        except ServiceRequestError as exc:
            if exc.status != 404:
                raise
        _, _, raw = self._request("PUT", path, raw=data)
        return json.loads(raw)

    def jobs(self, states: Optional[Iterable[str]] = None, team: Optional[str] = None) -> list[dict]:
        query = [("state", s) for s in states or ()] + ([("team", _team_ref(team))] if team else [])
        return self._json("GET", "/v1/jobs", query=query)

    def progress(self, team: Optional[str] = None) -> list[dict]:
        """The jobs this token may list, each as ``{"job": ..., "progress": ...}``: its run's live
        numbers (what the jobs page shows), None before its run started."""
        return self._json("GET", "/v1/progress", query=[("team", _team_ref(team))] if team else None)

    def job(self, job_id: int) -> dict:
        """The job, with its validated spec as stored (JSON text) under ``spec``."""
        return self._json("GET", f"/v1/jobs/{int(job_id)}")

    def transitions(self, job_id: int) -> list[dict]:
        return self._json("GET", f"/v1/jobs/{int(job_id)}/transitions")

    def logs(self, job_id: int, follow: bool = False, *, offset: int = 0,
             poll_s: float = FOLLOW_POLL_S) -> Union[str, Iterator[str]]:
        """The job's log as text; with ``follow`` a generator of new text as it is written,
        ending once the job has ended and everything it wrote was read."""
        if not follow:
            return self._rest(job_id, offset)
        return self._follow(job_id, offset, poll_s)

    def log_chunk(self, job_id: int, offset: int = 0) -> tuple[bytes, int]:
        """One read: the log's bytes from ``offset`` and the offset to ask from next."""
        _, headers, data = self._request("GET", f"/v1/jobs/{int(job_id)}/logs", query=[("offset", offset)])
        return data, int(headers.get("X-Next-Offset", offset + len(data)))

    def _rest(self, job_id: int, offset: int) -> str:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts = []
        while True:
            data, offset = self.log_chunk(job_id, offset)
            if not data:
                return "".join(parts) + decoder.decode(b"", final=True)
            parts.append(decoder.decode(data))

    def _follow(self, job_id: int, offset: int, poll_s: float) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            # Read the state before the bytes: a job that had ended before this read has
            # written everything, so an empty read after it means the end.
            ended = self.job(job_id)["state"] in TERMINAL_STATES
            data, offset = self.log_chunk(job_id, offset)
            if data:
                text = decoder.decode(data)
                if text:
                    yield text
                continue
            if ended:
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield tail
                return
            time.sleep(poll_s)

    def pause(self, job_id: int, reason: Optional[str] = None) -> dict:
        return self._json("POST", f"/v1/jobs/{int(job_id)}/pause", _action(reason))

    def resume(self, job_id: int, reason: Optional[str] = None) -> dict:
        return self._json("POST", f"/v1/jobs/{int(job_id)}/resume", _action(reason))

    def cancel(self, job_id: int, reason: Optional[str] = None, delete_checkpoints: bool = False) -> dict:
        return self._json("POST", f"/v1/jobs/{int(job_id)}/cancel",
                          _action(reason) | ({"delete_checkpoints": True} if delete_checkpoints else {}))

    def wait(self, job_id: int, states: Iterable[str] = TERMINAL_STATES, timeout_s: float = 3600.0,
             poll_s: float = WAIT_POLL_S) -> dict:
        """Poll until the job is in one of ``states`` (default: ended); raises ``TimeoutError``
        naming the state it is still in."""
        wanted = {str(getattr(s, "value", s)) for s in states}
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["state"] in wanted:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout_s:g} s "
                                   f"(waited for {', '.join(sorted(wanted))})")
            time.sleep(poll_s)

    # ------------------------------------------------------------------ teams (admin token)

    def teams(self) -> list[dict]:
        return self._json("GET", "/v1/teams")

    def add_team(self, name: str, nominal_workers: int, *, cohort: Optional[str] = None,
                 borrowing_limit_workers: Optional[int] = None, lending_limit_workers: Optional[int] = None,
                 weight: Optional[float] = None) -> dict:
        _refuse("team.name", name_problem(name))
        _refuse("team.cohort", cohort is not None and name_problem(cohort, "cohort name"))
        body = {"name": name, "nominal_workers": nominal_workers, "cohort": cohort,
                "borrowing_limit_workers": borrowing_limit_workers, "lending_limit_workers": lending_limit_workers,
                "weight": weight}
        return self._json("POST", "/v1/teams", {k: v for k, v in body.items() if v is not None})

    def update_team(self, name: str, **fields: Any) -> dict:
        """Change only the fields given (``None`` clears a limit or the cohort)."""
        _refuse("team.cohort", fields.get("cohort") is not None and name_problem(fields["cohort"], "cohort name"))
        return self._json("PUT", _team_path(name), fields)

    def set_quotas(self, team: str, flavor: str, quotas: dict[str, Any]) -> dict:
        """Replace ``team``'s quotas on ``flavor``: resource -> nominal, or -> {"nominal": ...,
        "borrowing_limit": ..., "lending_limit": ...}; {} clears them. Returns the team."""
        _refuse("quota.flavor", name_problem(flavor, "flavor name"))
        body = [{"resource": r, **(q if isinstance(q, dict) else {"nominal": q})} for r, q in quotas.items()]
        return self._json("PUT", f"{_team_path(team)}/quotas/{urllib.parse.quote(flavor, safe='')}", {"quotas": body})

    # ------------------------------------------------------------------ flavors

    def flavors(self) -> list[dict]:
        """The service's flavor table, each flavor with its capacity now (any token)."""
        return self._json("GET", "/v1/flavors")

    def set_flavors(self, flavors: list[dict]) -> list[dict]:
        """Replace the flavor table (admin token): a list of {name, market, accelerator, resources,
        usd_per_cpu_hour, ..., max_cpu, ...}, in order of preference; [] goes back to no table."""
        return self._json("PUT", "/v1/flavors", {"flavors": list(flavors)})

    def issue_token(self, team: str) -> str:
        """A new token for ``team``: the only time it is shown."""
        return self._json("POST", f"{_team_path(team)}/tokens")["token"]

    def revoke_tokens(self, team: str) -> int:
        return self._json("DELETE", f"{_team_path(team)}/tokens")["revoked"]

    def health(self) -> dict:
        return self._json("GET", "/healthz")

    # ------------------------------------------------------------------ HTTP

    def _json(self, method: str, path: str, body: Any = None, query: Optional[list] = None) -> Any:
        _, _, data = self._request(method, path, body, query)
        return json.loads(data) if data else None

    def _request(self, method: str, path: str, body: Any = None,
                 query: Optional[list] = None, raw: Optional[bytes] = None) -> tuple[int, Any, bytes]:
        url = self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            headers["Content-Type"] = "application/zip"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as e:
            raise _refusal(e.code, e.read()) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as e:
            cause = getattr(e, "reason", None) or e
            raise ServiceRequestError(None, f"cannot reach the job service at {self.url}: {cause}") from None


def _refusal(status: int, raw: bytes) -> ServiceRequestError:
    try:
        payload = json.loads(raw)
        message, field = str(payload.get("error") or payload), payload.get("field")
    except (ValueError, AttributeError):
        message, field = raw.decode("utf-8", "replace").strip()[:500] or "no message", None
    if status == 400:
        return ServiceRequestInvalid(field or "request", message)
    if status == 409:
        return ServiceRequestConflict(message)
    return ServiceRequestError(status, message)


def _team_path(name: str) -> str:
    """The team's URL path (its name checked first, then quoted: a name from before the rule may
    hold characters a path must escape)."""
    return f"/v1/teams/{urllib.parse.quote(_team_ref(name), safe='')}"


def _team_ref(name: str) -> str:
    _refuse("team", team_ref_problem(name))
    return name


def _refuse(field: str, problem) -> None:
    """Raise what the service would answer (400 on ``field``) when ``problem`` names one."""
    if problem:
        raise ServiceRequestInvalid(field, f"field '{field}': {problem}")


def _action(reason: Optional[str]) -> dict:
    return {"reason": reason} if reason else {}


def _spec_body(spec_or_path: Union[str, os.PathLike, dict]) -> Union[dict, str]:
    """A mapping as it is; a path's YAML text (read here: the server cannot see the file); any
    other string as YAML text."""
    if isinstance(spec_or_path, dict):
        return spec_or_path
    text = os.fspath(spec_or_path)
    looks_like_path = isinstance(spec_or_path, os.PathLike) or (
        "\n" not in text and (text.endswith((".yaml", ".yml")) or os.path.exists(text)))
    if looks_like_path:
        text = read_spec_file(text)
    return text  # YAML text: the server parses it and names a bad line and column


__all__ = ["Client", "TERMINAL_STATES", "URL_ENV", "TOKEN_ENV"]
