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
launch), a resume's clean-up of what earlier launches of its run left (``find_leftovers``,
``clean_up_leftovers``: a launch whose owner is gone is removed at once; one whose owner lives
refuses the resume), and the job service's hard stop (``end_launches_of``: the runner it killed
owned these). Writer: the
launch's ``WorkerGroup`` (``record`` at its start, ``forget`` at its shutdown); a new
Supervisor that adopts a launch will rewrite its owner.

No torch import: the agents and the service's reconciler use it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, remove_placement_group

from raytrain_sys.control import NAME_PREFIX
from raytrain_sys.control.owners import JOB_OWNER, owner_gone, this_process
from raytrain_sys.errors import UserError

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


def _record_of(prefix: str) -> dict | None:
    """Launch ``prefix``'s record (``owner``, ``time``); None when there is none (a launch of
    code older than the records, one already forgotten) or it cannot be read."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_key(prefix), namespace=KV_NAMESPACE)
    try:
        record = json.loads(raw) if raw is not None else None
        return {"owner": str(record["owner"]), "time": float(record.get("time", 0.0))}
    except (ValueError, KeyError, TypeError):
        return None


def owner_of(prefix: str) -> str | None:
    """The owner id recorded for launch ``prefix``; None when there is no record."""
    record = _record_of(prefix)
    return record["owner"] if record is not None else None


def records(starting: str = "") -> dict[str, dict]:
    """Every recorded launch whose prefix starts with ``starting``: prefix -> its record (owner, time)."""
    from ray.experimental import internal_kv

    out = {}
    for key in internal_kv._internal_kv_list((KV_PREFIX + starting).encode(), namespace=KV_NAMESPACE) or []:
        prefix = (key.decode() if isinstance(key, bytes) else str(key))[len(KV_PREFIX):]
        record = _record_of(prefix)
        if record is not None:
            out[prefix] = record
    return out


def launches() -> dict[str, str]:
    """Every recorded launch: prefix -> owner id."""
    return {prefix: record["owner"] for prefix, record in records().items()}


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


def run_name_prefix(run_key: str) -> str:
    """The prefix of every actor and placement group name of one run (all its launches)."""
    return f"{NAME_PREFIX}:{run_key}:"


# ---------------------------------------------------------------------- what earlier launches left
@dataclass
class Leftover:
    """An actor or placement group of some earlier launch of a run that is still there."""

    kind: str  # "actor" | "placement_group"
    name: str
    job_id: str  # the Ray job (driver) that created it
    namespace: str = ""
    pg_id: str = ""


def find_leftovers(run_key: str) -> list[Leftover]:
    """Actors not dead and placement groups not removed whose names belong to ``run_key``.

    Reads the GCS tables directly: no dashboard needed, as on a locally started cluster.
    """
    from ray._private import state

    prefix = run_name_prefix(run_key)
    found = []
    named = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)}
    if named:
        for info in state.actors().values():
            name = info.get("Name") or ""
            if name in named and info.get("State") != "DEAD":
                found.append(Leftover("actor", name, info["JobID"], namespace=named[name]))
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            # A placement group id ends with the id of the job that created it (4 bytes).
            found.append(Leftover("placement_group", info["name"], pg_id[-8:], pg_id=pg_id))
    return found


def _live_jobs() -> dict[str, dict]:
    from ray._private import state

    return {j["JobID"]: j for j in state.state.job_table() if not j.get("IsDead")}


def remove_leftover(left: Leftover) -> None:
    try:
        if left.kind == "actor":
            ray.kill(ray.get_actor(left.name, namespace=left.namespace), no_restart=True)
        else:
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(left.pg_id))))
    except ValueError:  # gone between the listing and now
        pass


def clean_up_leftovers(run_key: str, grace_s: float = 10.0, poll_s: float = 0.2) -> list[Leftover]:
    """Remove what earlier launches of ``run_key`` left behind; return what was removed.

    A launch's owner is recorded in the GCS (``launches``): a launch whose owner is gone is
    ended at once (``end_launch``: its agents end their ranks, its slots are removed),
    before its agents' own ``elastic.orphan_timeout_s`` would. Leftovers of no recorded launch
    (a leak, another tool's) are removed once the Ray job that made them is dead; Ray removes a
    dead driver's non-detached actors by itself within about 0.3 s, which the grace period
    covers. Leftovers whose owner (or job) stays alive through the grace period mean the earlier
    driver still runs: resuming would train the same run twice, so that is an error.
    """
    me = this_process()
    my_job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + grace_s
    removed: dict[tuple[str, str], Leftover] = {}
    ended: set[str] = set()
    while True:
        left, held, live = [], [], None
        found = find_leftovers(run_key)
        owners = {}  # launch prefix -> its recorded owner (None: no record), read once a look
        for x in found:
            prefix = launch_prefix(x.name)
            if prefix not in owners:
                owners[prefix] = owner_of(prefix) if prefix else None
        gone = {p for p, owner in owners.items() if owner is not None and owner_gone(owner)}
        for prefix in gone - ended:
            log.warning("ending launch %s of run %s: its driver (%s) is gone", prefix, run_key, owners[prefix])
            end_launch(prefix)
            ended.add(prefix)
        for x in found:
            prefix = launch_prefix(x.name)
            owner = owners.get(prefix) or (prefix in ended and "ended") or None
            if owner == me or (owner is None and x.job_id == my_job):
                continue  # this process's own launch, or this job's own of no recorded launch
            left.append(x)
            if prefix in ended:
                removed[(x.kind, x.name)] = x  # ended: what is still listed goes meanwhile
            elif owner is not None:
                held.append((x, owner))
            else:
                live = _live_jobs() if live is None else live
                if x.job_id in live:
                    held.append((x, JOB_OWNER + x.job_id))
                else:  # removal is asynchronous: ask again only once
                    if (x.kind, x.name) not in removed:
                        log.warning("removing %s %s left by Ray job %s, whose driver is gone",
                                    x.kind.replace("_", " "), x.name, x.job_id)
                        remove_leftover(x)
                    removed[(x.kind, x.name)] = x
        if not left:
            return list(removed.values())
        if time.monotonic() >= deadline:
            if held:
                live = _live_jobs()
                drivers = ", ".join(sorted({_driver_words(owner, live) for _, owner in held}))
                raise UserError(
                    f"run {run_key} is still running: {len(held)} of its workers/placement groups "
                    f"belong to the live {drivers}; stop that driver (Ctrl-C, or `ray job "
                    f"stop`) and resume again")
            raise UserError(
                f"could not remove {len(left)} actors/placement groups left by an earlier driver "
                f"of run {run_key} within {grace_s:g} s ({', '.join(x.name for x in left)}); "
                f"check the cluster's state (`ray list actors`, `ray list placement-groups`)")
        time.sleep(poll_s)


def _driver_words(owner: str, live: dict[str, dict]) -> str:
    """An owner id as the error names it: a Ray job with its driver's pid and host, or an actor."""
    if not owner.startswith(JOB_OWNER):
        return f"actor {owner}"
    job = owner[len(JOB_OWNER):]
    info = live.get(job, {})
    return f"Ray job {job} (driver pid {info.get('DriverPid')} on {info.get('DriverIPAddress')})"
