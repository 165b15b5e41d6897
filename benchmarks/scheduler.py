"""The job service's scheduling costs, one section each (issue 13).

Sections (``--sections``, comma list; each adds its figures and its goal to the JSON):

  pass      One ``decide(snapshot, now_s)`` pass of the pure scheduler, no Ray, no database, over
            a busy service: ``--queued`` (1,000) queued jobs across ``--teams`` (20) teams in
            cohorts of five, mixed priorities (0-4), gang sizes (1-8) and elastic ranges, submit
            times over the last two hours, a few paused and held jobs, and running jobs filling
            most of the cluster (some borrowing, so that reclaims are planned). The cluster is
            about the sum of the nominal quotas. Timed over ``--passes`` passes in one process
            after ``--warmup`` untimed ones; the goal (issue 13): a median pass under 50 ms.
            Also reported: the action counts of one pass (what a pass decides on this snapshot).

Later sections (submit to first step on a warm cluster, a high-priority submit into a full
cluster, pause to resources free) will join ``SECTIONS`` with the same shape: a function of the
parsed arguments that returns a dict with its figures and a ``goal`` dict (``met``, ``text``).

    .venv/bin/python benchmarks/scheduler.py            # pass: 1,000 queued jobs, 200 passes, ~5 s
    .venv/bin/python benchmarks/scheduler.py --quick    # 50 passes

Results go to benchmarks/results/scheduler.json (``"quick": true`` marks a smoke test's).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import _common as common  # noqa: E402

GOAL_PASS_MS = 50.0  # issue 13: one scheduling pass over 1,000 queued jobs across 20 teams

log = logging.getLogger("scheduler")


# ----------------------------------------------------------------------------- section: pass

def busy_snapshot(queued: int, teams: int, seed: int, now_s: float):
    """A service under load: ``queued`` waiting jobs, a cluster mostly taken by running ones."""
    from raytrain_sys.service.model import JobState, JobView, Snapshot, Team

    rng = random.Random(seed)
    team_list = []
    for i in range(teams):
        nominal = rng.choice([4, 6, 8, 10, 12])
        team_list.append(Team(f"team{i:02d}", nominal, cohort=f"cohort{i // 5}",
                              borrowing_limit_workers=rng.choice([None, None, 4, 8]),
                              lending_limit_workers=rng.choice([None, None, nominal // 2]),
                              weight=rng.choice([1.0, 1.0, 2.0])))
    cluster_workers = sum(t.nominal_workers for t in team_list)
    jobs = []
    job_id = 0
    # Running jobs: fill about 90% of the cluster, some teams over their nominal quota.
    held = 0
    while held < 0.9 * cluster_workers:
        t = rng.choice(team_list)
        lo = rng.choice([1, 2, 2, 4])
        hi = rng.choice([lo, lo, lo * 2, lo * 4])
        workers = rng.randint(lo, hi)
        if held + workers > cluster_workers:
            break
        held += workers
        job_id += 1
        jobs.append(JobView(id=job_id, team=t.name, priority=rng.randint(0, 4), state=JobState.RUNNING,
                            min_workers=lo, max_workers=hi, elastic=hi > lo, workers=workers,
                            target_workers=workers, submitted_at_s=now_s - rng.uniform(3600, 7200),
                            started_at_s=now_s - 3600, last_checkpoint_at_s=now_s - rng.uniform(0, 1800)))
    for _ in range(queued):
        t = rng.choice(team_list)
        lo = rng.choice([1, 1, 2, 2, 4, 8])
        hi = rng.choice([lo, lo, lo * 2])
        state = rng.choices([JobState.QUEUED, JobState.PAUSED], weights=[19, 1])[0]
        job_id += 1
        jobs.append(JobView(id=job_id, team=t.name, priority=rng.randint(0, 4), state=state,
                            min_workers=lo, max_workers=hi, elastic=hi > lo,
                            submitted_at_s=now_s - rng.uniform(0, 7200), held=rng.random() < 0.02))
    return Snapshot(team_list, jobs, cluster_workers=cluster_workers)


def section_pass(args: argparse.Namespace) -> dict:
    from raytrain_sys.service.scheduler import decide

    now_s = 1_800_000_000.0
    snapshot = busy_snapshot(args.queued, args.teams, args.seed, now_s)
    for _ in range(args.warmup):
        decide(snapshot, now_s)
    times_ms = []
    gc.collect()
    for i in range(args.passes):
        t0 = time.perf_counter()
        actions = decide(snapshot, now_s + i)  # the time moves, as between real passes
        times_ms.append((time.perf_counter() - t0) * 1000.0)
    times_ms.sort()
    median = statistics.median(times_ms)
    p90 = times_ms[int(0.9 * (len(times_ms) - 1))]
    counts = Counter(type(a).__name__ for a in actions)
    jobs = snapshot.jobs
    met = median < GOAL_PASS_MS
    return {
        "snapshot": {"teams": len(snapshot.teams), "cluster_workers": snapshot.cluster_workers,
                     "queued": sum(j.state.waiting for j in jobs),
                     "running": sum(j.state.admitted for j in jobs),
                     "running_workers": sum(j.workers for j in jobs)},
        "passes": args.passes,
        "pass_ms": {"median": median, "p90": p90, "min": times_ms[0], "max": times_ms[-1],
                    "mean": statistics.fmean(times_ms)},
        "actions_of_one_pass": dict(sorted(counts.items())),
        "goal": {"met": met,
                 "text": (f"goal (one pass over {args.queued} queued jobs, {args.teams} teams, under "
                          f"{GOAL_PASS_MS:g} ms): median {median:.1f} ms, p90 {p90:.1f} ms: "
                          + ("met" if met else "NOT met"))},
    }


def report_pass(r: dict) -> list[str]:
    s = r["snapshot"]
    return [f"scheduler pass: {s['queued']} waiting and {s['running']} running jobs ({s['running_workers']} "
            f"of {s['cluster_workers']} workers), {s['teams']} teams; {r['passes']} passes",
            f"  ms per pass: median {r['pass_ms']['median']:.2f}, p90 {r['pass_ms']['p90']:.2f}, "
            f"max {r['pass_ms']['max']:.2f}",
            f"  one pass decides: {', '.join(f'{n} {k}' for k, n in r['actions_of_one_pass'].items())}",
            "  " + r["goal"]["text"]]


# ----------------------------------------------------------------------------- main

SECTIONS = {"pass": (section_pass, report_pass)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="pass", help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--queued", type=int, default=1000, help="queued jobs in the snapshot")
    p.add_argument("--teams", type=int, default=20)
    p.add_argument("--passes", type=int, default=0, help="timed passes (default 200; --quick 50)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(HERE / "results" / "scheduler.json"))
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    names = common.pick(p, args.sections, list(SECTIONS), "section")
    args.passes = args.passes or (50 if args.quick else 200)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    results, lines = {}, []
    for name in names:
        run, report = SECTIONS[name]
        log.info("section %s", name)
        results[name] = run(args)
        lines += report(results[name])
    print("\n".join(lines))
    met = all(r["goal"]["met"] for r in results.values())
    out = {"benchmark": "scheduler", "quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "versions": {"python": platform.python_version()},
           "sections": results, "table": lines}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results: {args.out}")
    return 0 if met or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
