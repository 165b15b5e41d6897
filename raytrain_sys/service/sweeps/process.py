"""How each process of a sweep starts: its runner (``runner.SweepRunner``) and its trial proxies
(``proxy.run_trial``), both light control processes on the safe nodes.

Owns: their nice value (``CONTROL_NICENESS``) and the sweep's log they append to (``log_to``),
where how late Tune's decisions come is read from.
"""

from __future__ import annotations

import logging

# The nice value of a sweep's Tune driver and its trial proxies (Ray starts them at 15; why 0:
# raytrain_sys/niceness.py).
CONTROL_NICENESS = 0

_LOGGED_TO: set[str] = set()


def log_to(log_path: str) -> None:
    """Append this process's sweep lines to the sweep's log (once a process): ours (the runner's
    and its proxies', each line timed to the millisecond: how late Tune's decisions come is read
    from them), and Tune's schedulers' decisions (PBT's exploits, or a "Skip exploit" of a trial
    with no checkpoint)."""
    if not log_path or log_path in _LOGGED_TO:
        return
    _LOGGED_TO.add(log_path)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    for name in ("raytrain_sys", "ray.tune.schedulers"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
