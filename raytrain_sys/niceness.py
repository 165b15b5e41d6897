"""The scheduling priority (nice value) of a job's training workers.

Ray starts every worker process, actors and task workers alike, at nice 15. A job's training
workers leave it for ``resources.worker_niceness`` (0 by default): a rank that fills its core
would otherwise lose it to every daemon wake-up, and its peers would wait for it at the next
collective. Every thread of the worker moves, not only the one that adopts the job: a warm
spare's torch threads were started by its warm-up, at 15.

The rest stays at Ray's 15: read tasks, spares, idle spare runners; except the job service's actor
(``service.service.SERVICE_NICENESS``, 0: its reconciler's passes, milliseconds of work that took
1-2 s at 15 under a sweep's load), a job's runner (``service.runner.RUN_NICENESS``, 0: its
imports, its job's start and run; at 15 beside four training workers at 0 a runner process took
57-88 s to its job's first step, and a growth's newcomer 7-9 s from the decision to its first
step, against 1.1-1.2 s at 0), and a sweep's Tune driver and its trial proxies, at 0
(``sweeps.process.CONTROL_NICENESS``): little CPU, but at 15 beside training workers at 0 a proxy's report waited up to 30 s for Tune to take it, and ASHA
stopped trials after they had ended; at 0, the stops came 0.04-0.06 s after the evaluations they
ranked (benchmarks/sweep.py, 4 training workers on 2 cores). Moving a job's runner *and its read
tasks* to 0 with its workers was measured (benchmarks/scheduler.py, reclaim, 2 cores): a
borrowing job's runner, reads and worker then took both cores at 0, and the processes a starting
job needs (a fresh worker, a spare's refill, its read tasks) started at 15 beside them: 19-33 s to
the new job's first step, against 7-13 s with them at 15. The read tasks, which do the work,
stay at 15; the runner alone at 0 left the reclaim as it was (0.80 s against 0.74 s at 15, one
invocation each, back to back).

Linux keeps a nice value per thread: ``set_niceness`` changes every thread the process has
(threads started later inherit their creator's). Lowering a value needs root or CAP_SYS_NICE;
without it the process keeps its value and says so once.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_refused: set[int] = set()  # values this process was refused (said once each)


def _thread_ids() -> list[int]:
    """This process's threads (Linux), else [0]: the calling thread (a process, elsewhere)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def set_niceness(nice: int | None, why: str = "") -> None:
    """Run every thread at nice value ``nice`` (None: leave them as they are); ``why``: what asks
    for it, in the warning when it is not permitted (default: the spec's worker_niceness)."""
    if nice is None:
        return
    for tid in _thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            if nice not in _refused:
                _refused.add(nice)
                log.warning("%s: nice %d not permitted here (lowering a nice value needs root or CAP_SYS_NICE); "
                            "keeping nice %d", why or "resources.worker_niceness", nice,
                            os.getpriority(os.PRIO_PROCESS, 0))
            return
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def process_niceness() -> int:
    """The highest nice value among this process's threads (its least favoured one): a
    process is at ``n`` only when every thread is."""
    values = []
    for tid in _thread_ids():
        try:
            values.append(os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:
            continue
    return max(values) if values else os.getpriority(os.PRIO_PROCESS, 0)
