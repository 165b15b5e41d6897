"""Who owns a warm spare's claim or a launch of a run, and whether that owner is gone: read from
the cluster's tables.

An owner id is an actor's id (a job's runner) or ``job:<id>``, a driver's Ray job (a notebook or
script that took spares from a pool of its own job). No torch import: the pool and the workers
both ask it.
"""

from __future__ import annotations

JOB_OWNER = "job:"  # an owner id that names a Ray job (a driver), not an actor


def this_process() -> str:
    """This process's owner id: its actor's id inside an actor (a job's runner), else its Ray
    job's as ``job:<id>`` (a driver: a CLI run, a notebook, a script)."""
    import ray

    context = ray.get_runtime_context()
    return context.get_actor_id() or JOB_OWNER + context.get_job_id()


def owner_gone(owner_id: str) -> bool:
    """Whether the owner of a claim is dead, as the cluster's tables say: an actor id (its
    entry's state DEAD) or ``job:<id>`` (a driver's Ray job, its entry ``IsDead``). Anything
    else (alive, restarting, the table briefly unreadable) means it lives."""
    from ray._private import state

    try:
        if owner_id.startswith(JOB_OWNER):
            job = owner_id[len(JOB_OWNER):]
            return any(j.get("JobID") == job and j.get("IsDead") for j in state.state.job_table())
        info = state.actors(actor_id=owner_id)
    except Exception:  # noqa: BLE001: the GCS briefly unreachable: ask again
        return False
    return bool(info) and info.get("State") == "DEAD"
