"""Who a launch of a run belongs to, written in Ray's GCS, and how a launch is ended.

A launch is one start of a run: its actors and placement groups share the name prefix
``raytrain-sys:<run key>:<launch id>:`` (``worker_group.WorkerGroup.name_prefix``). Since the
node agents (``node_agent``), nothing of a launch dies with the process that drives it: the
agents are detached and own the ranks, the slots' placement groups are detached. So whether a
launch is still driven cannot be read from Ray's job table (a job's runner is an actor inside the
service's job, which lives on); it is written here, as the launch's *owner*: the id of the
process that supervises it (``owners.this_process``: an actor's id, or ``job:<id>`` for a
driver), in the GCS internal KV (``launch/<prefix>``), before the launch places anything.

Readers: the agents (``NodeAgent``: an owner gone for ``elastic.orphan_timeout_s`` ends the
launch), a resume's clean-up of an earlier launch (``worker_group.clean_up_leftovers``: a launch
whose owner is gone is removed at once; one whose owner lives refuses the resume), and the job
service's hard stop (``end_launches_of``: the runner it killed owned these). Writer: the
launch's ``WorkerGroup`` (``record`` at its start, ``forget`` at its shutdown); a new
Supervisor that adopts a launch will rewrite its owner.

No torch import: the agents and the service's reconciler use it.
"""

from __future__ import annotations

import json
import logging
import time

import ray

from raytrain_sys.control import NAME_PREFIX

log = logging.getLogger(__name__)

KV_NAMESPACE = "raytrain_sys"
KV_PREFIX = "launch/"
# The word a node agent's name carries after its launch's prefix (``agent_name``).
AGENT_WORD = "agent"


def _key(prefix: str) -> bytes:
    return (KV_PREFIX + prefix).encode()


def record(prefix: str, owner_id: str) -> None:
    """Launch ``prefix`` is supervised by ``owner_id`` from now on (written before it places
    anything, so that no slot of it exists without its owner known)."""
    from ray.experimental import internal_kv

    value = json.dumps({"owner": owner_id, "time": time.time()}).encode()
    internal_kv._internal_kv_put(_key(prefix), value, overwrite=True, namespace=KV_NAMESPACE)


def forget(prefix: str) -> None:
    """Launch ``prefix`` ended: its record goes (best effort: a stale record names a dead owner,
    which every reader takes as a launch to end)."""
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_del(_key(prefix), namespace=KV_NAMESPACE)
    except Exception as exc:  # noqa: BLE001: the GCS briefly unreachable
        log.debug("could not forget launch %s: %s", prefix, exc)


def owner_of(prefix: str) -> str | None:
    """The owner id recorded for launch ``prefix``; None when there is no record (a launch of
    code older than the records, or one already forgotten)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_key(prefix), namespace=KV_NAMESPACE)
    if raw is None:
        return None
    try:
        return str(json.loads(raw)["owner"])
    except (ValueError, KeyError, TypeError):
        return None


def launches() -> dict[str, str]:
    """Every recorded launch: prefix -> owner id."""
    from ray.experimental import internal_kv

    out = {}
    for key in internal_kv._internal_kv_list(KV_PREFIX.encode(), namespace=KV_NAMESPACE) or []:
        prefix = (key.decode() if isinstance(key, bytes) else str(key))[len(KV_PREFIX):]
        owner = owner_of(prefix)
        if owner is not None:
            out[prefix] = owner
    return out


def launch_prefix(name: str) -> str:
    """The launch prefix of one of its actors' or placement groups' names
    (``raytrain-sys:<run key>:<launch id>:...``); "" for a name of no launch."""
    parts = name.split(":")
    if len(parts) < 4 or parts[0] != NAME_PREFIX:
        return ""
    return ":".join(parts[:3]) + ":"


def agent_name(prefix: str, node_id: str, index: int) -> str:
    """The name of launch ``prefix``'s ``index``-th agent on node ``node_id``."""
    return f"{prefix}{AGENT_WORD}:{node_id[:16]}:{index}"


def end_launch(prefix: str, agents_first: bool = True, timeout_s: float = 10.0) -> int:
    """End everything of launch ``prefix``: its agents end their ranks (``NodeAgent.end``, warm
    spares among them), then every placement group and actor of the launch still there is
    removed, and its record forgotten. Returns how many actors and placement
    groups were found."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    handles = []
    for a in named:
        try:
            handles.append((a["name"], ray.get_actor(a["name"], namespace=a["namespace"])))
        except ValueError:  # gone since the listing
            continue
    if agents_first:
        ends = [h.end.remote() for name, h in handles if name[len(prefix):].startswith(AGENT_WORD + ":")]
        if ends:
            ray.wait(ends, num_returns=len(ends), timeout=timeout_s)
    # The slots first: an agent ending its launch is among the actors killed below.
    groups = 0
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            groups += 1
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            except Exception:  # noqa: BLE001: removed meanwhile
                pass
    forget(prefix)
    me = ray.get_runtime_context().get_actor_id()
    for _, h in sorted(handles, key=lambda nh: nh[1]._actor_id.hex() == me):  # this actor last
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001: ended already
            pass
    return len(handles) + groups


def end_launches_of(owner_id: str, agents_first: bool = False) -> int:
    """End every launch ``owner_id`` supervises (the job service killed that runner, or found it
    gone: its ranks would otherwise train on, orphaned, until their agents'
    ``elastic.orphan_timeout_s``). By default without waiting for the agents to end their ranks:
    every actor of the launch is killed by name (the ranks claimed by an agent end with it), so
    the caller waits only for the GCS. Returns how many launches there were."""
    if not owner_id:
        return 0
    try:
        mine = [p for p, owner in launches().items() if owner == owner_id]
    except Exception as exc:  # noqa: BLE001: the GCS briefly unreachable: the agents end them later
        log.warning("could not read the launches of %s: %s", owner_id[:8], exc)
        return 0
    for prefix in mine:
        try:
            end_launch(prefix, agents_first=agents_first)
        except Exception as exc:  # noqa: BLE001: the agents end it later anyway
            log.warning("could not end launch %s: %s", prefix, exc)
    return len(mine)
