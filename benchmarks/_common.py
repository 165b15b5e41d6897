"""What the benchmark scripts share around their measurements: argument checks and set-up."""

from __future__ import annotations

import argparse
import logging
import tempfile


def pick(p: argparse.ArgumentParser, value: str, allowed, flag: str) -> list[str]:
    """A comma list of names, each one of ``allowed``; an unknown one is a usage error."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = set(names) - set(allowed)
    if unknown:
        p.error(f"unknown {flag} {', '.join(sorted(unknown))}; allowed: {', '.join(allowed)}")
    return names


def start(verbose: bool, log: logging.Logger, prefix: str) -> str:
    """Logging as asked, and a private work dir for the run."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    # Short and under /tmp: Ray's unix socket paths must stay under 107 characters.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def wait_until_quiet(log: logging.Logger, below: float = 0.15, max_s: float = 60.0) -> float:
    """Wait until the whole machine's CPU use over one second is under ``below`` of its cores
    (a just-started Ray keeps a core busy for seconds: daemons, pre-started workers), at most
    ``max_s``. Each variant then starts on an equally quiet machine. Returns the seconds waited."""
    import time

    import psutil

    t0, busy = time.monotonic(), 0.0
    while time.monotonic() - t0 < max_s:
        busy = psutil.cpu_percent(interval=1.0) / 100.0
        if busy < below:
            break
    else:
        log.warning("the machine stayed busy (%.0f%% CPU) for %.0f s: results will be noisy",
                    busy * 100, max_s)
    waited = time.monotonic() - t0
    log.info("quiet after %.1f s", waited)
    return waited


class CallArgBytes:
    """Bytes Ray serializes for the arguments of every call of actor method ``method`` made by
    this process, per step for the members' leases (``train_steps``) (Ray's own serializer, so ObjectRefs count as what they cost, not as the
    objects). ``plans_at``: the argument holding the lease's plans (one per step; 2 when a rank's
    index comes first, as control_plane.py's packed stand-ins take it). ``every``: measure one call
    in this many (serializing a call again costs what Ray's own serializing of it does, which a
    benchmark of the driver's CPU must not add to it). Installed on creation; ``close()`` puts
    Ray's method back."""

    def __init__(self, method: str = "train_steps", plans_at: int = 1, every: int = 1):
        import ray._private.worker as ray_worker
        import ray.actor

        from raytrain_sys.data.batches import lease_length

        self.sizes: list[int] = []
        self._orig = remote = ray.actor.ActorMethod._remote
        sizes, calls = self.sizes, [0]

        def measured(actor_method, args=None, kwargs=None, **options):
            if actor_method._method_name == method and calls[0] % every == 0:
                ctx = ray_worker.global_worker.get_serialization_context()
                # A lease (train_steps, report_steps) carries a plan per step: bytes per rank per step.
                steps = lease_length(args[plans_at]) if method in ("train_steps", "report_steps") else 1
                sizes.append(ctx.serialize((args, kwargs)).total_bytes / steps)
            calls[0] += actor_method._method_name == method
            return remote(actor_method, args, kwargs, **options)

        ray.actor.ActorMethod._remote = measured

    def close(self) -> None:
        import ray.actor

        ray.actor.ActorMethod._remote = self._orig


def add_reference_flag(p: argparse.ArgumentParser) -> None:
    """``--reference run|file``: where ``warm_reference`` takes the warm start from."""
    p.add_argument("--reference", choices=("file", "run"), default="run",
                   help="the warm submit-to-first-step: run benchmarks/scheduler.py now (default, the same "
                        "invocation), or the latest benchmarks/results/scheduler.json (an older run's, on "
                        "another load)")


def warm_reference(reference: str, rounds: int, work) -> dict:
    """The warm submit-to-first-step of ``benchmarks/scheduler.py`` (its ``first_step`` section,
    warm spares and a spare runner), the yardstick of the service's other starts: measured now in
    a process of its own (``reference`` "run": ``rounds`` jobs, the ratio then of one machine
    state), or (``reference`` "file") the latest figure in ``benchmarks/results/scheduler.json``,
    which may be an older run's on another load; the result says which."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if reference == "run":
        out = Path(work) / "scheduler.json"
        # scheduler.py exits 1 when its own goals are not met; its figures are written all the same
        run = subprocess.run([sys.executable, str(here / "scheduler.py"), "--sections", "first_step", "--rounds",
                              str(rounds), "--out", str(out)], timeout=1800,
                             env={**os.environ, "PYTHONPATH": str(here.parent)})
        if run.returncode not in (0, 1) or not out.exists():
            raise RuntimeError(f"benchmarks/scheduler.py failed (exit {run.returncode}): no warm reference")
        source = "measured in this invocation (benchmarks/scheduler.py --sections first_step)"
    else:
        out = here / "results" / "scheduler.json"
        source = "the latest figure of benchmarks/scheduler.py (benchmarks/results/scheduler.json)"
    data = json.loads(out.read_text())
    warm = data["sections"]["first_step"]["warm"]
    return {"median_s": warm["median_s"], "source": source, "measured_at": data.get("time"),
            "runs_s": warm["submit_to_first_step_s"]}


def report_head(benchmark: str, quick: bool, loadavg_before: tuple) -> dict:
    """The fields every results JSON opens with: what ran, when, on which versions and load."""
    import os
    import sys
    import time

    import ray
    import torch

    return {"benchmark": benchmark, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick,
            "versions": {"ray": ray.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
            "machine": {"cpu_count": os.cpu_count(), "loadavg_before": loadavg_before,
                        "loadavg_at_end": os.getloadavg()}}


def write_report(path: str, report: dict) -> None:
    import json
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"results: {path}")
