"""Node drains and preemption notices, written to and read from Ray's GCS.

A drain is how Ray says "this node is going away": a reason (PREEMPTION or IDLE_TERMINATION)
and a deadline after which the node may be killed. Anyone can set one (this module, the hidden
``ray drain-node`` CLI, Ray's own SIGTERM handler on ``ray start --block`` nodes, KubeRay, the
autoscaler v2, our spot watcher); the Supervisor reads them to shrink away from a node at a step
boundary before its deadline. Everything here talks to the GCS directly through
``ray._raylet.GcsClient``: no dashboard, and no ``ray.init`` needed.

What Ray 2.60 does, measured on ``ray.cluster_utils.Cluster`` (see tests/test_drain.py):

* ``GcsClient.drain_node(node_id_hex, reason, message, deadline_ms)`` is synchronous: the GCS
  forwards the request to the node's raylet and answers with its verdict, so a drain is visible
  in ``get_draining_nodes()`` by the time the call returns (a few ms).
* PREEMPTION drains cannot be refused. IDLE_TERMINATION drains are refused on a busy node
  ("The node to be idle terminated is no longer idle.").
* The node id must be the HEX string. Bytes are silently accepted and drain nothing.
* A draining node takes no new leases (tasks, actors, placement-group bundles) and its raylet
  exits by itself, at once, as soon as it is idle: draining an idle node, or removing the last
  actor AND the last placement group from a drained node (a bundle alone keeps it alive), ends
  it within milliseconds, with death reason AUTOSCALER_DRAIN_PREEMPTED (or
  AUTOSCALER_DRAIN_IDLE). Nothing happens at the deadline itself: a busy node stays alive and
  draining past it until somebody kills it.
* A drained node that is killed (SIGKILL, instance gone) dies labelled AUTOSCALER_DRAIN_PREEMPTED
  only when the drain reason was PREEMPTION and the deadline had passed; killed before its
  deadline it is UNEXPECTED_TERMINATION, like any crash. A graceful stop (SIGTERM to the raylet,
  ``cluster.remove_node``) is EXPECTED_TERMINATION whatever the drain said.
* ``get_draining_nodes()`` returns ``{node_id_hex: deadline_ms}`` (0 = no deadline) for alive
  draining nodes only; Ray 2.60 exposes no drain *reason* for an alive node (not in the node
  table, the resource reports nor the autoscaler state). So ``drain_node`` here records the
  reason in the GCS internal KV, and ``draining_nodes`` reports a drain it did not record as
  PREEMPTION, ``reason_source="inferred"``: an IDLE_TERMINATION drain is only accepted on an
  idle node, which then exits at once, so a node that stays alive while draining was drained
  for preemption (or for an equivalent shutdown such as Ray's SIGTERM drain).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

log = logging.getLogger(__name__)

REASONS = ("PREEMPTION", "IDLE_TERMINATION")

# Where drain_node() records the reason of the drains it sets (Ray keeps no readable copy).
KV_NAMESPACE = b"raytrain_sys"
KV_PREFIX = b"drain/"

# Names of rpc::NodeDeathInfo::Reason, as reported in NodeInfo.death_reason.
DEATH_EXPECTED = "EXPECTED_TERMINATION"
DEATH_UNEXPECTED = "UNEXPECTED_TERMINATION"
DEATH_PREEMPTED = "AUTOSCALER_DRAIN_PREEMPTED"
DEATH_IDLE = "AUTOSCALER_DRAIN_IDLE"

_NODE_ID_RE = re.compile(r"^[0-9a-f]{56}$")
DEFAULT_TIMEOUT_S = 10.0
STALE_RECORD_S = 30.0


class DrainError(Exception):
    """A drain request could not be sent (bad argument or GCS unreachable)."""


class NodeNotFound(LookupError):
    """No alive Ray node matches (``local_node``): it is gone, or never started."""


@dataclass(frozen=True)
class DrainInfo:
    """One alive node's drain, as the GCS reports it."""

    reason: str  # "PREEMPTION" | "IDLE_TERMINATION"
    deadline_unix_s: Optional[float]  # None: the drain has no deadline
    message: str = ""
    # "recorded": drain_node() of this module set it and stored its reason; "inferred": set by
    # someone else (ray drain-node, Ray's SIGTERM drain, KubeRay, the autoscaler), see above.
    reason_source: str = "recorded"

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        if self.deadline_unix_s is None:
            return None
        return self.deadline_unix_s - (time.time() if now is None else now)


@dataclass(frozen=True)
class DrainResult:
    accepted: bool
    rejection_message: str = ""
    deadline_unix_s: Optional[float] = None

    def __bool__(self) -> bool:
        return self.accepted


@dataclass(frozen=True)
class NodeInfo:
    """One node of the GCS node table (alive or dead) with its drain, if any."""

    node_id: str
    alive: bool
    is_head: bool
    ip: str
    resources: dict = field(default_factory=dict)
    drain: Optional[DrainInfo] = None  # set while the node is alive and draining
    death_reason: Optional[str] = None  # one of the DEATH_* names once dead
    death_message: str = ""
    start_time_unix_s: Optional[float] = None
    end_time_unix_s: Optional[float] = None
    # RAY_CLOUD_INSTANCE_ID of the node's `ray start` (KubeRay: the pod's name), "" if unset
    instance_id: str = ""
    labels: dict = field(default_factory=dict)

    @property
    def draining(self) -> bool:
        return self.drain is not None

    @property
    def preempted(self) -> bool:
        """Dead, and Ray labelled the death as the end of a preemption drain."""
        return self.death_reason == DEATH_PREEMPTED


# --------------------------------------------------------------------------- GCS access
_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def resolve_gcs_address(gcs_address: Optional[str] = None) -> str:
    """The GCS address to use: the argument, the connected driver's, ``RAY_ADDRESS``, then the
    cluster ``ray start`` last recorded on this machine (``/tmp/ray/ray_current_cluster``) or
    the only GCS process running here."""
    if gcs_address:
        return gcs_address
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    return canonicalize_bootstrap_address_or_die(os.environ.get("RAY_ADDRESS") or None)


def gcs_client(gcs_address: Optional[str] = None):
    """A ``ray._raylet.GcsClient`` for the cluster (cached per address).

    Inside a connected driver or actor the process's own client is reused. Constructing a new
    client blocks until the GCS answers (about 40 s before giving up on an unreachable one).
    """
    import ray

    if not gcs_address and ray.is_initialized():
        client = getattr(ray._private.worker.global_worker, "gcs_client", None)
        if client is not None:
            return client
    address = resolve_gcs_address(gcs_address)
    with _clients_lock:
        client = _clients.get(address)
        if client is None:
            client = ray._raylet.GcsClient(address=address)
            _clients[address] = client
        return client


def _reason_value(reason: str) -> int:
    from ray.core.generated import autoscaler_pb2

    name = str(reason).upper()
    if name.startswith("DRAIN_NODE_REASON_"):
        name = name[len("DRAIN_NODE_REASON_"):]
    if name not in REASONS:
        raise DrainError(f"drain reason must be one of {REASONS}, got {reason!r}")
    return autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_" + name)


def normalize_node_id(node_id: Any) -> str:
    """The 56-character hex id Ray's drain API needs (bytes and NodeID objects converted)."""
    if isinstance(node_id, (bytes, bytearray)):
        node_id = bytes(node_id).hex()
    elif not isinstance(node_id, str) and hasattr(node_id, "hex"):
        node_id = node_id.hex()
    node_id = str(node_id).strip().lower()
    if not _NODE_ID_RE.match(node_id) or node_id == "f" * 56:
        raise DrainError(f"not a Ray node id (56 hex characters, not nil): {node_id!r}")
    return node_id


def _kv_key(node_id: str) -> bytes:
    return KV_PREFIX + node_id.encode()


# --------------------------------------------------------------------------- drains
def drain_node(node_id: str, reason: str, deadline_s_from_now: Optional[float], message: str,
               *, deadline_unix_s: Optional[float] = None, gcs_address: Optional[str] = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Ask Ray to drain a node; returns whether the drain was accepted.

    ``reason``: "PREEMPTION" (never refused) or "IDLE_TERMINATION" (refused when the node is
    busy, and refused here when the node is already draining: it would replace a preemption
    drain's deadline). ``deadline_s_from_now``: seconds until the node will be killed (may be
    <= 0 for "already due"), or None for no deadline; ``deadline_unix_s`` sets an absolute
    deadline instead (the spot notice's time). Note that Ray does not kill anything at the
    deadline; it is a promise to the workloads. A dead or unknown node counts as drained (Ray
    answers accepted). See :func:`drain_node_result` for the rejection message.
    """
    return drain_node_result(node_id, reason, deadline_s_from_now, message,
                             deadline_unix_s=deadline_unix_s, gcs_address=gcs_address,
                             timeout_s=timeout_s).accepted


def drain_node_result(node_id: str, reason: str, deadline_s_from_now: Optional[float],
                      message: str, *, deadline_unix_s: Optional[float] = None,
                      gcs_address: Optional[str] = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> DrainResult:
    """Like :func:`drain_node` but returns the verdict with Ray's rejection message and the
    deadline actually sent. Raises :class:`DrainError` on bad arguments or an RPC failure."""
    node_id = normalize_node_id(node_id)
    reason_name = str(reason).upper().replace("DRAIN_NODE_REASON_", "")
    reason_value = _reason_value(reason_name)
    if deadline_unix_s is None and deadline_s_from_now is not None:
        deadline_unix_s = time.time() + float(deadline_s_from_now)
    deadline_ms = 0 if deadline_unix_s is None else max(1, int(round(deadline_unix_s * 1000)))

    try:
        client = gcs_client(gcs_address)
        current = client.get_draining_nodes(timeout=timeout_s)
        if reason_name == "IDLE_TERMINATION" and node_id in current:
            msg = "node is already draining; an idle-termination drain would replace it"
            log.info("drain of node %s (IDLE_TERMINATION) not sent: %s", node_id, msg)
            return DrainResult(False, msg, None)

        key = _kv_key(node_id)
        previous = client.internal_kv_get(key, namespace=KV_NAMESPACE, timeout=timeout_s)
        record = json.dumps({"reason": reason_name, "deadline_ms": deadline_ms,
                             "message": message, "host": socket.gethostname(),
                             "pid": os.getpid(), "time": time.time()}).encode()
        # Recorded before the drain so that a reader never sees our drain without its reason.
        client.internal_kv_put(key, record, True, namespace=KV_NAMESPACE, timeout=timeout_s)
        try:
            accepted, rejection = client.drain_node(node_id, reason_value, message, deadline_ms,
                                                    timeout=timeout_s)
        except BaseException:
            _restore_record(client, key, previous, timeout_s)
            raise
        if not accepted:
            _restore_record(client, key, previous, timeout_s)
    except DrainError:
        raise
    except Exception as e:  # RpcError, GetTimeoutError, ...
        raise DrainError(f"drain of node {node_id} failed: {type(e).__name__}: {e}") from e

    rejection = rejection.decode() if isinstance(rejection, bytes) else str(rejection or "")
    if accepted:
        log.info("node %s draining: reason=%s deadline_unix_s=%s message=%r", node_id,
                 reason_name, None if not deadline_ms else deadline_ms / 1000.0, message)
    else:
        log.info("drain of node %s (%s) rejected: %s", node_id, reason_name, rejection)
    return DrainResult(bool(accepted), rejection,
                       None if not deadline_ms else deadline_ms / 1000.0)


def _restore_record(client, key: bytes, previous: Optional[bytes], timeout_s: float) -> None:
    try:
        if previous is None:
            client.internal_kv_del(key, False, namespace=KV_NAMESPACE, timeout=timeout_s)
        else:
            client.internal_kv_put(key, previous, True, namespace=KV_NAMESPACE,
                                   timeout=timeout_s)
    except Exception:  # best effort: a stale record is ignored when its deadline differs
        log.debug("could not restore the drain record %r", key, exc_info=True)


def draining_nodes(gcs_address: Optional[str] = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, DrainInfo]:
    """Alive nodes that are draining: ``{node_id_hex: DrainInfo}``.

    Deadlines come from the GCS (``GcsClient.get_draining_nodes``); the reason comes from the
    record :func:`drain_node` left when it matches that deadline, else it is inferred as
    PREEMPTION (see the module docstring). Records of nodes no longer draining are removed
    after STALE_RECORD_S.
    """
    client = gcs_client(gcs_address)
    raw = client.get_draining_nodes(timeout=timeout_s)  # {hex: deadline_ms}
    records = _read_records(client, timeout_s)
    out: dict[str, DrainInfo] = {}
    for node_id, deadline_ms in raw.items():
        node_id = node_id.decode() if isinstance(node_id, bytes) else str(node_id)
        deadline_ms = int(deadline_ms)
        deadline = deadline_ms / 1000.0 if deadline_ms else None
        rec = records.get(node_id)
        if rec is not None and int(rec.get("deadline_ms", -1)) == deadline_ms:
            out[node_id] = DrainInfo(rec.get("reason", "PREEMPTION"), deadline,
                                     rec.get("message", ""), "recorded")
        else:
            out[node_id] = DrainInfo("PREEMPTION", deadline, "", "inferred")
    # Records of nodes no longer draining (dead, or a drain that was refused or raced) are
    # dropped once they are old enough not to belong to a drain_node() call in flight.
    now = time.time()
    for node_id, rec in records.items():
        if node_id not in out and now - float(rec.get("time", 0)) > STALE_RECORD_S:
            _restore_record(client, _kv_key(node_id), None, timeout_s)
    return out


def _read_records(client, timeout_s: float) -> dict[str, dict]:
    try:
        keys = client.internal_kv_keys(KV_PREFIX, namespace=KV_NAMESPACE, timeout=timeout_s)
        if not keys:
            return {}
        values = client.internal_kv_multi_get(list(keys), namespace=KV_NAMESPACE,
                                              timeout=timeout_s)
    except Exception:
        log.debug("could not read drain records", exc_info=True)
        return {}
    out = {}
    for key, value in values.items():
        try:
            out[key[len(KV_PREFIX):].decode()] = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            continue
    return out


# --------------------------------------------------------------------------- nodes
def _death_reason_name(value: int) -> str:
    from ray.core.generated import gcs_pb2

    enum = gcs_pb2.GcsNodeInfo.DESCRIPTOR.fields_by_name["death_info"].message_type \
        .enum_types_by_name["Reason"]
    v = enum.values_by_number.get(int(value))
    return v.name if v is not None else str(value)


def nodes(gcs_address: Optional[str] = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, NodeInfo]:
    """Every node the GCS knows (alive, and the dead ones it still remembers), with drains."""
    from ray.core.generated import gcs_pb2

    client = gcs_client(gcs_address)
    infos = client.get_all_node_info(timeout=timeout_s)
    drains = draining_nodes(gcs_address, timeout_s)
    out: dict[str, NodeInfo] = {}
    for nid, info in infos.items():
        node_id = nid.hex() if hasattr(nid, "hex") else str(nid)
        alive = info.state == gcs_pb2.GcsNodeInfo.ALIVE
        death_reason = None
        if not alive:
            death_reason = _death_reason_name(info.death_info.reason)
        out[node_id] = NodeInfo(
            node_id=node_id,
            alive=alive,
            is_head=bool(info.is_head_node),
            ip=info.node_manager_address,
            resources=dict(info.resources_total),
            drain=drains.get(node_id) if alive else None,
            death_reason=death_reason,
            death_message=info.death_info.reason_message if not alive else "",
            start_time_unix_s=info.start_time_ms / 1000.0 if info.start_time_ms else None,
            end_time_unix_s=info.end_time_ms / 1000.0 if info.end_time_ms else None,
            instance_id=info.instance_id,
            labels=dict(info.labels),
        )
    return out


def alive_nodes(gcs_address: Optional[str] = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, NodeInfo]:
    """Alive nodes only (draining ones included; check ``.draining``)."""
    return {k: v for k, v in nodes(gcs_address, timeout_s).items() if v.alive}


def node_of_actor(actor: Any) -> Optional[str]:
    """Hex id of the node an actor runs on, from the GCS actor table (needs ``ray.init``);
    None while the actor is not placed yet."""
    import ray

    info = ray._private.state.state.actor_table(actor._actor_id.hex())
    node_id = (info or {}).get("Address", {}).get("NodeID", "")
    if not node_id or node_id == "f" * 56 or not _NODE_ID_RE.match(node_id):
        return None
    return node_id


def nodes_on_ip(ip: str, gcs_address: Optional[str] = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> list[NodeInfo]:
    """Alive nodes whose raylet listens on ``ip`` (how a per-host daemon finds its node)."""
    return [n for n in alive_nodes(gcs_address, timeout_s).values() if n.ip == ip]


# Set by `ray start` from its environment; KubeRay sets it to the pod's name on every Ray pod.
INSTANCE_ID_ENV = "RAY_CLOUD_INSTANCE_ID"


def local_node(node_id: Optional[str] = None, instance_id: Optional[str] = None,
               ip: Optional[str] = None, gcs_address: Optional[str] = None) -> str:
    """The hex id of the Ray node a per-node process (the spot watcher, a pod's preStop hook)
    acts for, in this order: ``node_id`` if given; else the alive node whose instance id is
    ``instance_id`` (default ``$RAY_CLOUD_INSTANCE_ID``: on KubeRay the pod's name, which one
    pod's processes share); else the only alive node on ``ip`` (default: this host's IP as Ray
    detects it). Raises NodeNotFound when none matches, LookupError when several do."""
    if node_id:
        return normalize_node_id(node_id)
    instance_id = os.environ.get(INSTANCE_ID_ENV, "") if instance_id is None else instance_id
    if instance_id:
        found = [n for n in alive_nodes(gcs_address).values() if n.instance_id == instance_id]
        what = f"instance id {instance_id!r} (${INSTANCE_ID_ENV})"
    else:
        if not ip:
            from ray._private.services import get_node_ip_address

            ip = get_node_ip_address()
        found = nodes_on_ip(ip, gcs_address)
        what = f"IP {ip}"
    if not found:
        raise NodeNotFound(f"no alive Ray node with {what} in the cluster at "
                          f"{resolve_gcs_address(gcs_address)}")
    if len(found) > 1:
        raise LookupError(f"{len(found)} alive Ray nodes have {what}: pass --node-id "
                          f"({', '.join(n.node_id for n in found)})")
    return found[0].node_id


def training_slots_on(node_id: str, gcs_address: Optional[str] = None) -> list[str]:
    """Names of the training slots still placed on a node: placement groups of raytrain-sys
    runs (``launches.run_name_prefix``) with a bundle there, not removed.

    Every worker of a run works in its own one-bundle placement group (warm spares included:
    a spare adopted by a job works in the job's group), and the Supervisor removes it when
    the worker leaves, so an empty list means no worker of ours trains there any more. Idle
    spares and runners hold no placement group and do not count. Read from the GCS's
    placement-group table without ``ray.init``, as Ray's own tools read it.
    """
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    from raytrain_sys.control import NAME_PREFIX

    node_id = normalize_node_id(node_id)
    state = GlobalState()
    state._initialize_global_state(GcsClientOptions.create(
        resolve_gcs_address(gcs_address), None, allow_cluster_id_nil=True,
        fetch_cluster_id_if_nil=False))
    try:
        table = state.placement_group_table()
    finally:
        state.disconnect()
    return sorted(info["name"] for info in table.values()
                  if info["state"] != "REMOVED" and info["name"].startswith(NAME_PREFIX + ":")
                  and node_id in info["bundles_to_node_id"].values())
