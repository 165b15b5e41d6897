"""Ask members which step they hold: the one question every part of the Supervisor asks.

Owns nothing and writes nothing: it pings on the workers' control path (which answers while a
step runs) and sorts the answers. ``liveness``, ``membership``, ``checkpoints`` and the
Supervisor use it, so that none of them has to call another for it.
"""

from __future__ import annotations

import ray

from raytrain_sys.control.supervisor.policy import PING_TIMEOUT_S
from raytrain_sys.control.worker_group import Worker


def ping_all(workers: list[Worker]) -> tuple[dict[int, int], list[Worker], list[Worker]]:
    """Ping every worker at once: ({slot: committed steps held} of those that answered, the
    workers Ray reports dead, the workers that did not answer within PING_TIMEOUT_S)."""
    if not workers:
        return {}, [], []
    refs = {w.slot: w.actor.ping.remote() for w in workers}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PING_TIMEOUT_S)
    held, dead, silent = {}, [], []
    for w in workers:
        if refs[w.slot] not in ready:
            silent.append(w)
            continue
        try:
            held[w.slot] = ray.get(refs[w.slot])
        except ray.exceptions.RayError:
            dead.append(w)
    return held, dead, silent
