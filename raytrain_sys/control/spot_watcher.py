"""Per-node daemon that turns a spot interruption notice (AWS or GCE) into a Ray drain.

Nothing in Ray reads the EC2 two-minute notice, nor GCE's 30-second one. This daemon runs on
every spot worker node
(the cluster configs in ``cluster_configs/`` start it right after ``ray start``), polls the
instance metadata service (IMDSv2) every few seconds and, when a notice appears, drains ITS OWN
Ray node with reason PREEMPTION and the notice's time as the deadline. The Supervisor sees the
drain (``raytrain_sys.control.drain.draining_nodes``) and shrinks away at a step boundary.

    python -m raytrain_sys.control.spot_watcher --gcs-address $RAY_HEAD_IP:6379

``--provider gce`` reads the GCE metadata server instead (see ``GceMetadataClient``): a Spot or
preemptible VM is stopped 30 s after ``instance/preempted`` turns ``TRUE``, so the drain's
deadline is the moment the watcher first saw it plus 30 s.

IMDS protocol (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
returns a session token; ``GET /latest/meta-data/spot/instance-action`` with
``X-aws-ec2-metadata-token`` returns 404 until the instance is marked for interruption, then
``{"action": "terminate" | "stop" | "hibernate", "time": "2026-11-22T05:12:00Z"}``; an expired or
missing token gives 401. Proxies are bypassed (``HTTP_PROXY`` must never see IMDS traffic).

Behaviour:
* 404: nothing to do. 401: the token is dropped and fetched again, once per poll.
* IMDS unreachable or failing (timeouts, refused, 5xx): logged, retried with exponential backoff
  (poll interval doubling up to ``--max-backoff-s``); the daemon never exits on it.
* A notice is acted on once (keyed by action and time); a drain that fails (GCS down, node not
  found yet) is retried at the next poll until it is accepted. A notice with a new time drains
  again (Ray replaces the deadline). The daemon keeps running after a drain.
* Which node: ``--node-id`` (or ``RAYTRAIN_SYS_NODE_ID``) if given; otherwise the only alive
  Ray node whose raylet address is this host's IP (``--node-ip``, default Ray's own
  ``get_node_ip_address()``), looked up in the GCS when the notice arrives (and once at start,
  for the log). Several Ray nodes on one IP (a test cluster) is an error: pass ``--node-id``.
* GCS address: ``--gcs-address``, else ``RAY_ADDRESS``, else the cluster ``ray start`` recorded
  on this machine. With token authentication on, run it with the same ``RAY_AUTH_MODE`` /
  ``RAY_AUTH_TOKEN`` environment as ``ray start``.
* ``--lock-file PATH``: at most one watcher per lock file (a second one exits 0), so re-running
  a node's start commands does not stack watchers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("raytrain_sys.spot_watcher")

DEFAULT_IMDS_URL = "http://169.254.169.254"
IMDS_URL_ENV = "RAYTRAIN_SYS_IMDS_URL"
NODE_ID_ENV = "RAYTRAIN_SYS_NODE_ID"
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_TOKEN_TTL_S = 21600
DEFAULT_POLL_INTERVAL_S = 5.0
DEFAULT_MAX_BACKOFF_S = 30.0

# GCE's metadata server (the same link-local address as AWS's IMDS).
GCE_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCE_FLAVOR_HEADER = "Metadata-Flavor"  # "Google": required on a request, sent on every answer
GCE_NOTICE_S = 30.0  # a Spot or preemptible VM is stopped this long after its notice
# Each poll waits up to this long for the value to change (wait_for_change): a notice is seen
# the moment it is posted, and a stopping watcher (SIGTERM) exits within this long.
DEFAULT_GCE_WAIT_S = 10.0
# Between two GCE polls: short, since each one already waited on the server.
DEFAULT_GCE_POLL_INTERVAL_S = 0.5
PROVIDERS = ("aws", "gce")
PROVIDER_ENV = "RAYTRAIN_SYS_SPOT_PROVIDER"

# poll_once() outcomes
NO_NOTICE = "no-notice"
DRAINED = "drained"
ALREADY_HANDLED = "already-handled"
DRAIN_FAILED = "drain-failed"
IMDS_UNAVAILABLE = "imds-unavailable"
BAD_NOTICE = "bad-notice"


class ImdsUnavailable(Exception):
    """The metadata service did not answer usefully (network error, timeout, 5xx, ...)."""


@dataclass(frozen=True)
class InterruptionNotice:
    action: str  # terminate | stop | hibernate
    time_iso: str  # as IMDS sent it
    deadline_unix_s: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.action, self.time_iso)


def parse_notice(body: bytes | str) -> InterruptionNotice:
    """Parse the ``spot/instance-action`` JSON; raises ValueError when it is not a notice."""
    doc = json.loads(body)
    if not isinstance(doc, dict) or "time" not in doc:
        raise ValueError(f"not an instance-action document: {body!r}")
    time_iso = str(doc["time"])
    text = time_iso[:-1] + "+00:00" if time_iso.endswith(("Z", "z")) else time_iso
    when = _dt.datetime.fromisoformat(text)
    if when.tzinfo is None:  # IMDS times are UTC
        when = when.replace(tzinfo=_dt.timezone.utc)
    return InterruptionNotice(str(doc.get("action", "terminate")), time_iso, when.timestamp())


class ImdsClient:
    """Minimal IMDSv2 client: one cached session token, refreshed before expiry or on 401."""

    def __init__(self, base_url: str = DEFAULT_IMDS_URL, token_ttl_s: int = DEFAULT_TOKEN_TTL_S,
                 timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.base_url = base_url.rstrip("/")
        self.token_ttl_s = int(token_ttl_s)
        self.timeout_s = timeout_s
        self._clock = clock
        self._token: Optional[str] = None
        self._token_expiry = 0.0
        # No proxies: IMDS is link-local, and HTTP_PROXY must never see the token.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.token_fetches = 0

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, bytes]:
        status, _, body = _fetch(self._opener, method, self.base_url + path, headers,
                                 self.timeout_s)
        return status, body

    def token(self) -> str:
        # Refresh a minute early (or at half the TTL for very short TTLs).
        if self._token is None or self._clock() >= self._token_expiry:
            status, body = self._request("PUT", TOKEN_PATH,
                                         {TOKEN_TTL_HEADER: str(self.token_ttl_s)})
            if status != 200 or not body:
                raise ImdsUnavailable(f"token request answered {status}: {body[:200]!r}")
            self.token_fetches += 1
            self._token = body.decode().strip()
            margin = min(60.0, self.token_ttl_s / 2.0)
            self._token_expiry = self._clock() + self.token_ttl_s - margin
        return self._token

    def drop_token(self) -> None:
        self._token = None

    def get(self, path: str) -> tuple[int, bytes]:
        """GET with the session token; on 401 fetch a new token and try once more."""
        status, body = self._request("GET", path, {TOKEN_HEADER: self.token()})
        if status == 401:
            log.info("IMDS token rejected (401); fetching a new one")
            self.drop_token()
            status, body = self._request("GET", path, {TOKEN_HEADER: self.token()})
        return status, body

    def instance_action(self) -> Optional[InterruptionNotice]:
        """The pending interruption notice, or None (404). Raises ImdsUnavailable or ValueError."""
        status, body = self.get(INSTANCE_ACTION_PATH)
        if status == 404:
            return None
        if status != 200:
            raise ImdsUnavailable(f"{INSTANCE_ACTION_PATH} answered {status}: {body[:200]!r}")
        return parse_notice(body)


def _fetch(opener, method: str, url: str, headers: dict, timeout_s: float):
    """One metadata request: (status, answer headers, body); an HTTP error status is an
    answer, a network failure (refused, timeout, reset) raises ImdsUnavailable."""
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        body = e.read() if e.fp is not None else b""
        return e.code, e.headers, body
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImdsUnavailable(f"{method} {url}: {e}") from e


class GceMetadataClient:
    """GCE metadata server: ``GET /computeMetadata/v1/instance/preempted`` with
    ``Metadata-Flavor: Google`` answers ``FALSE`` until the VM is preempted and ``TRUE`` from
    the notice on (30 s before the VM stops). After the first answer each request long-polls
    (``wait_for_change=true&last_etag=..&timeout_sec=..``): the server answers when the value
    changes, or with the same value after ``wait_s``. An answer without ``Metadata-Flavor:
    Google`` did not come from a metadata server (a proxy, a captive portal) and counts as
    unavailable. The notice carries no time: its deadline is when this client first saw TRUE
    plus ``GCE_NOTICE_S``, and it stays the same notice while TRUE lasts (one drain)."""

    def __init__(self, base_url: str = DEFAULT_IMDS_URL, timeout_s: float = 2.0,
                 wait_s: float = DEFAULT_GCE_WAIT_S, clock: Callable[[], float] = time.time):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self._clock = clock
        self._etag: Optional[str] = None
        self._notice: Optional[InterruptionNotice] = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def instance_action(self) -> Optional[InterruptionNotice]:
        path = GCE_PREEMPTED_PATH
        wait_s = self.wait_s if self._etag else 0.0
        if wait_s > 0:
            path += f"?wait_for_change=true&timeout_sec={int(wait_s)}&last_etag={self._etag}"
        status, headers, body = _fetch(self._opener, "GET", self.base_url + path,
                                       {GCE_FLAVOR_HEADER: "Google"}, self.timeout_s + wait_s)
        if status != 200:
            raise ImdsUnavailable(f"{GCE_PREEMPTED_PATH} answered {status}: {body[:200]!r}")
        if (headers.get(GCE_FLAVOR_HEADER) or "") != "Google":
            raise ImdsUnavailable(f"{self.base_url} answered without {GCE_FLAVOR_HEADER}: Google "
                                  f"(not a GCE metadata server)")
        self._etag = headers.get("ETag") or None
        value = body.decode(errors="replace").strip().upper()
        if value == "FALSE":
            self._notice = None
            return None
        if value != "TRUE":
            raise ValueError(f"instance/preempted answered {value!r}, not TRUE or FALSE")
        if self._notice is None:
            seen = self._clock()
            when = _dt.datetime.fromtimestamp(seen, _dt.timezone.utc)
            self._notice = InterruptionNotice("preempt", when.isoformat(), seen + GCE_NOTICE_S)
        return self._notice


@dataclass
class SpotWatcher:
    """The polling logic, independent of Ray: ``on_notice`` does the drain and returns whether
    it was accepted (exceptions count as a failure and are retried at the next poll)."""

    imds: "ImdsClient | GceMetadataClient"
    on_notice: Callable[[InterruptionNotice], bool]
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    handled: set = field(default_factory=set)
    drains: int = 0
    consecutive_failures: int = 0
    last_outcome: str = ""

    def poll_once(self) -> str:
        try:
            notice = self.imds.instance_action()
        except ImdsUnavailable as e:
            self.consecutive_failures += 1
            level = logging.WARNING if self.consecutive_failures <= 3 or \
                self.consecutive_failures % 10 == 0 else logging.DEBUG
            log.log(level, "event=imds_unavailable attempt=%d retry_in_s=%.1f error=%s",
                    self.consecutive_failures, self.next_delay_for(self.consecutive_failures), e)
            return self._done(IMDS_UNAVAILABLE)
        except ValueError as e:
            self.consecutive_failures = 0
            log.warning("event=bad_notice error=%s", e)
            return self._done(BAD_NOTICE)
        if self.consecutive_failures:
            log.info("event=imds_reachable after_failures=%d", self.consecutive_failures)
        self.consecutive_failures = 0
        if notice is None:
            return self._done(NO_NOTICE)
        if notice.key in self.handled:
            return self._done(ALREADY_HANDLED)
        log.warning("event=interruption_notice action=%s time=%s deadline_in_s=%.1f",
                    notice.action, notice.time_iso, notice.deadline_unix_s - time.time())
        try:
            accepted = bool(self.on_notice(notice))
        except Exception as e:
            log.error("event=drain_failed error=%s: %s (retrying at the next poll)",
                      type(e).__name__, e)
            return self._done(DRAIN_FAILED)
        if not accepted:
            log.error("event=drain_rejected (retrying at the next poll)")
            return self._done(DRAIN_FAILED)
        self.handled.add(notice.key)
        self.drains += 1
        return self._done(DRAINED)

    def _done(self, outcome: str) -> str:
        self.last_outcome = outcome
        return outcome

    def next_delay_for(self, failures: int) -> float:
        if failures <= 0:
            return self.poll_interval_s
        return min(self.max_backoff_s, self.poll_interval_s * (2 ** min(failures, 30)))

    def next_delay(self) -> float:
        return self.next_delay_for(self.consecutive_failures)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll_once()
            except Exception:  # never die on a bug in one poll
                log.exception("event=poll_error")
            stop.wait(self.next_delay())


class NodeDrainer:
    """Drains this host's Ray node with reason PREEMPTION and the notice's deadline."""

    def __init__(self, gcs_address: Optional[str] = None, node_id: Optional[str] = None,
                 node_ip: Optional[str] = None):
        self.gcs_address = gcs_address
        self.fixed_node_id = node_id or None
        self.node_ip = node_ip
        self._discovered: Optional[str] = None

    def _address(self) -> str:
        from raytrain_sys.control import drain

        if not self.gcs_address:
            self.gcs_address = drain.resolve_gcs_address(None)
        return self.gcs_address

    def resolve(self) -> str:
        """The node to drain: the fixed id, else this host's node (``drain.local_node``: by
        ``$RAY_CLOUD_INSTANCE_ID`` when set, else the only alive node on this host's IP)."""
        if self.fixed_node_id:
            return self.fixed_node_id
        from raytrain_sys.control import drain

        address = self._address()
        if self._discovered:
            alive = drain.alive_nodes(address)
            if self._discovered in alive:
                return self._discovered
            log.info("event=node_gone node_id=%s (looking for this host's node again)",
                     self._discovered)
            self._discovered = None
        self._discovered = drain.local_node(ip=self.node_ip, gcs_address=address)
        log.info("event=node_discovered node_id=%s", self._discovered)
        return self._discovered

    def __call__(self, notice: InterruptionNotice) -> bool:
        from raytrain_sys.control import drain

        node_id = self.resolve()
        message = (f"spot interruption notice: action={notice.action} time={notice.time_iso} "
                   f"(raytrain-sys spot watcher)")
        result = drain.drain_node_result(node_id, "PREEMPTION", None, message,
                                         deadline_unix_s=notice.deadline_unix_s,
                                         gcs_address=self._address())
        log.warning("event=drain_requested node_id=%s reason=PREEMPTION deadline_unix_s=%.3f "
                    "accepted=%s %s", node_id, notice.deadline_unix_s, result.accepted,
                    result.rejection_message)
        return result.accepted


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raytrain_sys.control.spot_watcher",
        description="Drain this Ray node (reason PREEMPTION) when EC2 announces a spot "
                    "interruption or GCE a preemption.")
    p.add_argument("--provider", choices=PROVIDERS, default=os.environ.get(PROVIDER_ENV, "aws"),
                   help=f"whose notice to read: aws (IMDSv2 spot/instance-action) or gce "
                        f"(instance/preempted); env {PROVIDER_ENV}, default aws")
    p.add_argument("--imds-url", default=os.environ.get(IMDS_URL_ENV, DEFAULT_IMDS_URL),
                   help=f"instance metadata service base URL, AWS's or GCE's (env {IMDS_URL_ENV}; "
                        f"default {DEFAULT_IMDS_URL})")
    p.add_argument("--gcs-address", default=None,
                   help="Ray GCS host:port (default: RAY_ADDRESS, then the local ray start)")
    p.add_argument("--node-id", default=os.environ.get(NODE_ID_ENV) or None,
                   help=f"hex id of the Ray node to drain (env {NODE_ID_ENV}; default: the only "
                        "alive node on this host's IP)")
    p.add_argument("--node-ip", default=None,
                   help="this host's Ray node IP for discovery (default: Ray's detection)")
    p.add_argument("--poll-interval-s", type=float, default=None,
                   help=f"between polls (default {DEFAULT_POLL_INTERVAL_S:g} s on aws, "
                        f"{DEFAULT_GCE_POLL_INTERVAL_S:g} s on gce, whose polls wait on the server)")
    p.add_argument("--max-backoff-s", type=float, default=DEFAULT_MAX_BACKOFF_S)
    p.add_argument("--token-ttl-s", type=int, default=DEFAULT_TOKEN_TTL_S)
    p.add_argument("--http-timeout-s", type=float, default=2.0)
    p.add_argument("--lock-file", default=None,
                   help="run only if no other watcher holds this lock file")
    p.add_argument("--once", action="store_true",
                   help="poll once, print the outcome and exit (1 if IMDS is unavailable or the "
                        "drain failed)")
    p.add_argument("--log-level", default="INFO")
    return p


def _take_lock(path: str):
    import fcntl

    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s spot_watcher[%(process)d] %(message)s",
                        stream=sys.stderr)
    lock = None
    if args.lock_file:
        lock = _take_lock(args.lock_file)
        if lock is None:
            log.info("event=already_running lock_file=%s", args.lock_file)
            return 0

    drainer = NodeDrainer(args.gcs_address, args.node_id, args.node_ip)
    if args.provider == "gce":
        imds = GceMetadataClient(args.imds_url, args.http_timeout_s)
        poll_s = DEFAULT_GCE_POLL_INTERVAL_S
    else:
        imds = ImdsClient(args.imds_url, args.token_ttl_s, args.http_timeout_s)
        poll_s = DEFAULT_POLL_INTERVAL_S
    if args.poll_interval_s is not None:
        poll_s = args.poll_interval_s
    watcher = SpotWatcher(imds, drainer, poll_s, args.max_backoff_s)

    if args.once:
        outcome = watcher.poll_once()
        print(outcome, flush=True)
        return 1 if outcome in (IMDS_UNAVAILABLE, DRAIN_FAILED) else 0

    stop = threading.Event()

    def _stop(signum, _frame):
        log.info("event=stopping signal=%s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("event=started provider=%s imds_url=%s gcs_address=%s node_id=%s "
             "poll_interval_s=%s", args.provider, args.imds_url, args.gcs_address or "(auto)",
             args.node_id or "(discover)", poll_s)

    def _preflight():  # only to log early which node this watcher will drain
        try:
            log.info("event=watching node_id=%s", drainer.resolve())
        except Exception as e:
            log.warning("event=node_not_resolved_yet error=%s (retried at notice time)", e)

    if not args.node_id:
        threading.Thread(target=_preflight, name="preflight", daemon=True).start()
    watcher.run(stop)
    log.info("event=stopped drains=%d", watcher.drains)
    if lock is not None:
        lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
