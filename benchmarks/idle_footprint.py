"""What the job service costs while no job runs: memory and CPU of each of its idle processes.

One invocation: a local Ray cluster (``--cluster-cpus``, one node), the service started on it
with its defaults (warm spares: 2 per node; two spare runners; the HTTP API), left to settle
(the spares' pool full, the spare runners up, the machine quiet, then ``--settle-s``), then
each of the service's processes measured over ``--window-s``:

  service actor       the reconciler loop (a pass every 0.5 s) and the API's uvicorn thread;
  spare runner        a runner started ahead of any job, torch and MLflow imported;
  warm spare worker   a TrainWorker started ahead, torch and the parallel layouts imported;
  spare pool          the actor that keeps the warm spares (its refill loop, every 1 s).

Memory: RSS and PSS (``/proc/<pid>/smaps_rollup``: shared pages, torch's libraries among them,
counted in equal parts among the processes that map them; the fair share of the machine's
memory) and USS (pages of that process alone), the mean of one sample a second. CPU: user +
system seconds over the window, as % of one core. Ray's own daemons (GCS, raylet, dashboard
agent) are shown apart, for scale: they run with or without the service.

    .venv/bin/python benchmarks/idle_footprint.py                # ~2 min on 2 cores
    .venv/bin/python benchmarks/idle_footprint.py --quick        # 10 s window, no settle

Results: benchmarks/results/idle_footprint.json (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import _common as common  # noqa: E402

log = logging.getLogger("idle_footprint")

KINDS = ("service actor", "spare runner", "warm spare worker", "spare pool")
RAY_DAEMONS = ("gcs_server", "raylet", "dashboard_agent", "runtime_env_agent", "log_monitor")
MB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_of(handle) -> int:
    """The process of a live actor (any actor: Ray's own ``__ray_call__``)."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)


def service_processes() -> list[tuple[str, str, int]]:
    """(kind, actor name, pid) of each of the service's processes."""
    import ray

    from raytrain_sys.control.spares import NAMESPACE, POOL_NAME, SPARE_PREFIX
    from raytrain_sys.service.runner import SPARE_RUNNER_PREFIX
    from raytrain_sys.service.service import SERVICE_NAME

    found = []
    for actor in sorted(ray.util.list_named_actors(all_namespaces=True), key=lambda a: a["name"]):
        if actor["namespace"] != NAMESPACE:
            continue
        name = actor["name"]
        kind = ("service actor" if name == SERVICE_NAME else "spare pool" if name == POOL_NAME else
                "spare runner" if name.startswith(SPARE_RUNNER_PREFIX) else
                "warm spare worker" if name.startswith(SPARE_PREFIX) else None)
        if kind is not None:
            found.append((kind, name, pid_of(ray.get_actor(name, namespace=NAMESPACE))))
    return sorted(found, key=lambda f: (KINDS.index(f[0]), f[1]))


def ray_daemons(session_root: str) -> list[tuple[str, str, int]]:
    """This cluster's own daemons (their command lines name its temp dir; other clusters on the
    machine are not counted)."""
    import psutil

    out = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if session_root not in cmd:
            continue
        for daemon in RAY_DAEMONS:
            if daemon in (proc.info["name"] or "") or f"/{daemon}" in cmd or f"{daemon}.py" in cmd:
                out.append(("ray daemon", daemon, proc.info["pid"]))
                break
    return out


def measure(procs: list[tuple[str, str, int]], window_s: float) -> list[dict]:
    """Each process's mean RSS, PSS and USS (one sample a second) and CPU % of one core."""
    import psutil

    handles = {pid: psutil.Process(pid) for _, _, pid in procs}
    cpu0 = {pid: p.cpu_times() for pid, p in handles.items()}
    samples: dict[int, list] = {pid: [] for pid in handles}
    t0 = time.monotonic()
    while time.monotonic() - t0 < window_s:
        for pid, p in handles.items():
            m = p.memory_full_info()
            samples[pid].append((m.rss, m.pss, m.uss))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))
    wall = time.monotonic() - t0
    rows = []
    for kind, name, pid in procs:
        c0, c1 = cpu0[pid], handles[pid].cpu_times()
        cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
        rss, pss, uss = (sum(s[i] for s in samples[pid]) / len(samples[pid]) / MB for i in range(3))
        rows.append({"kind": kind, "name": name, "pid": pid, "rss_mb": round(rss, 1), "pss_mb": round(pss, 1),
                     "uss_mb": round(uss, 1), "cpu_pct_of_core": round(100 * cpu_s / wall, 2)})
    return rows


def by_kind(rows: list[dict]) -> dict:
    """Per kind: count, mean per process and total of each figure."""
    out = {}
    for kind in (*KINDS, "ray daemon"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        fig = {}
        for key in ("rss_mb", "pss_mb", "uss_mb", "cpu_pct_of_core"):
            total = sum(r[key] for r in mine)
            fig[key] = {"each": round(total / len(mine), 2), "total": round(total, 2)}
        out[kind] = {"count": len(mine), **fig}
    return out


def print_table(rows: list[dict], kinds: dict) -> None:
    head = f"{'process':<20} {'name':<34} {'RSS MB':>8} {'PSS MB':>8} {'USS MB':>8} {'CPU %':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kind']:<20} {r['name'][:34]:<34} {r['rss_mb']:>8.0f} {r['pss_mb']:>8.0f} {r['uss_mb']:>8.0f} "
              f"{r['cpu_pct_of_core']:>7.2f}")
    print()
    print(f"{'kind':<20} {'count':>5} {'PSS MB each':>12} {'PSS MB total':>13} {'CPU % each':>11} {'CPU % total':>12}")
    for kind, k in kinds.items():
        print(f"{kind:<20} {k['count']:>5} {k['pss_mb']['each']:>12.0f} {k['pss_mb']['total']:>13.0f} "
              f"{k['cpu_pct_of_core']['each']:>11.2f} {k['cpu_pct_of_core']['total']:>12.2f}")
    service = [r for r in rows if r["kind"] in KINDS]
    print(f"{'the service, all':<20} {len(service):>5} {'':>12} {sum(r['pss_mb'] for r in service):>13.0f} {'':>11} "
          f"{sum(r['cpu_pct_of_core'] for r in service):>12.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster-cpus", type=int, default=os.cpu_count() or 2, help="the local node's CPUs")
    p.add_argument("--settle-s", type=float, default=20.0,
                   help="seconds left after the warm processes are up and the machine is quiet")
    p.add_argument("--window-s", type=float, default=60.0, help="the measured window")
    p.add_argument("--quick", action="store_true", help="no settle, a 10 s window")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "idle_footprint.json"))
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.settle_s, args.window_s = 0.0, 10.0
    loadavg_before = os.getloadavg()
    work = common.start(args.verbose, log, "rts-idle-")

    import ray

    from raytrain_sys.control.spares import find_pool
    from raytrain_sys.service.service import DEFAULT_WARM_WORKERS, start_service, stop_service

    ray.init(address="local", num_cpus=args.cluster_cpus, include_dashboard=False,
             _temp_dir=os.path.join(work, "ray"), log_to_driver=args.verbose,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    port = free_port()  # the default port (8470) may be another service's on a shared machine
    t0 = time.monotonic()
    svc = start_service(f"sqlite:///{work}/service.db", port=port, base_dir=work)
    try:
        pool = find_pool()
        if not ray.get(pool.wait_full.remote(300.0)):
            raise RuntimeError(f"the warm spares' pool was not full within 300 s: {ray.get(pool.status.remote())}")
        while (runners := ray.get(svc.info.remote())["spare_runners"])["up"] < runners["wanted"]:
            if time.monotonic() - t0 > 300:
                raise RuntimeError(f"the spare runners were not up within 300 s: {runners}")
            time.sleep(0.5)
        warm_s = time.monotonic() - t0
        log.info("warm after %.1f s", warm_s)
        common.wait_until_quiet(log, below=0.25, max_s=60.0)
        time.sleep(args.settle_s)
        info = ray.get(svc.info.remote())
        rows = measure(service_processes() + ray_daemons(os.path.join(work, "ray")), args.window_s)
    finally:
        stop_service()
        ray.shutdown()
    kinds = by_kind(rows)
    print(f"the job service idle on one local node of {args.cluster_cpus} CPUs, defaults "
          f"({DEFAULT_WARM_WORKERS} warm spares a node, {info['spare_runners']['wanted']} spare runners, HTTP API); "
          f"{args.window_s:g} s window after {args.settle_s:g} s settled; CPU % of one core")
    print_table(rows, kinds)
    report = common.report_head("idle_footprint", args.quick, loadavg_before) | {
        "cluster_cpus": args.cluster_cpus, "window_s": args.window_s, "settle_s": args.settle_s,
        "warm_after_s": round(warm_s, 1), "warm_workers_per_node": DEFAULT_WARM_WORKERS,
        "spare_runners": info["spare_runners"]["wanted"], "reconciler_passes_at_measure": info["passes"],
        "processes": rows, "by_kind": kinds,
        "service_total": {"pss_mb": round(sum(r["pss_mb"] for r in rows if r["kind"] in KINDS), 1),
                          "rss_mb": round(sum(r["rss_mb"] for r in rows if r["kind"] in KINDS), 1),
                          "cpu_pct_of_core": round(sum(r["cpu_pct_of_core"] for r in rows if r["kind"] in KINDS), 2)}}
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
