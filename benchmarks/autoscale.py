"""The job service on Ray's own autoscaler (issue 27): how long a job beyond capacity takes to
train, whose seconds they are, what a drained node costs, and how soon an idle node goes.

Each round is ``tests/autoscale_scenario.py`` in a process of its own: a fake autoscaling cluster
(Ray's fake multi-node provider, ``tests/autoscaling_cluster.py``; its head has no CPU, so every
job needs a node the autoscaler adds; nodes idle 6 s are released), the service on it with
autoscaling on (a pass every 0.5 s), and a 2-worker job submitted on the empty cluster.

Sections (``--sections``, comma list; each adds its figures and its goal to the JSON):

  scale_up  Submit beyond capacity to the first committed step (``--rounds``, medians), split into
            the node's start (the scale request to the node's join: the autoscaler's reaction and
            the node's boot) and ours (the submit to the request, and the node's join to the
            first step: the runner, placement, worker processes, the MLflow run, the process
            group). Goal: ours at most 1.2x the warm submit-to-first-step of
            ``benchmarks/scheduler.py`` (its ``first_step`` section: measured here in the same
            invocation, the default, so the ratio is of one machine state; ``--reference file``
            reads the latest figure in ``benchmarks/results/scheduler.json`` instead, which may
            be an older run's on another load, and the JSON says which).
  release   From the queue empty (the job's end) to the node's release. Goal: the idle timeout
            plus one pass.
  drain     The termination path on an autoscaled node: the job elastic 1..2 on two 1-CPU nodes,
            one of them drained by ``raytrain-sys node drain --wait`` (a worker pod's preStop)
            while the job trains: steps lost (``steps_redone``, goal 0) and the hook's seconds.

    .venv/bin/python benchmarks/autoscale.py                     # scale_up and release, 3 rounds; drain once
    .venv/bin/python benchmarks/autoscale.py --rounds 1 --quick  # one round of each
    .venv/bin/python benchmarks/autoscale.py --reference file    # the warm reference read, not measured

Results go to benchmarks/results/autoscale.json (``"quick": true`` marks a smoke test's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import _common as common  # noqa: E402

SECTIONS = ("scale_up", "release", "drain")
GOAL_OURS_RATIO = 1.2  # issue 27: our share of a scale-up at most 1.2x a warm cluster's submit-to-first-step
SCENARIO_TIMEOUT_S = 900

log = logging.getLogger("autoscale")


def scenario(work: Path, dataset: str, *flags: str) -> dict:
    """One run of tests/autoscale_scenario.py in a child process (its own Ray connection)."""
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, "-m", "tests.autoscale_scenario", "--work", str(work), "--dataset", dataset,
                          *flags], env=env, cwd=work, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    if run.returncode != 0:
        raise RuntimeError(f"the scenario failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def run_scale_up(args, work: Path, dataset: str) -> tuple[dict, dict]:
    rounds = []
    for i in range(args.rounds):
        common.wait_until_quiet(log)
        flags = ["--warm-workers", str(args.warm_workers)] + (["--v2"] if args.v2 else [])
        r = scenario(work / f"round{i}", dataset, *flags)
        seen = r["seen"]
        node_start = seen["node_joined"] - r["requested_at_s"]
        total = seen["first_step"] - seen["submit"]
        rounds.append({"submit_to_first_step_s": round(total, 3), "node_start_s": round(node_start, 3),
                       "ours_s": round(total - node_start, 3),
                       "ours_before_node_s": round(r["requested_at_s"] - seen["submit"], 3),
                       "ours_after_node_s": round(seen["first_step"] - seen["node_joined"], 3),
                       "run_start_phases": r["summary"].get("start_phases", {}),
                       "empty_queue_to_release_s": round(seen["released"] - seen["finished"], 3),
                       "history": r["history"], "wait_causes": r["wait_causes"],
                       "steps_redone": r["summary"].get("steps_redone")})
        log.info("round %d: %s", i, rounds[-1])
    return rounds, {"v2": args.v2}


def scale_up_section(rounds: list[dict], reference: dict) -> dict:
    ours = median([r["ours_s"] for r in rounds])
    goal_s = GOAL_OURS_RATIO * reference["median_s"]
    return {"rounds": rounds, "submit_to_first_step_median_s": median([r["submit_to_first_step_s"] for r in rounds]),
            "node_start_median_s": median([r["node_start_s"] for r in rounds]), "ours_median_s": ours,
            "ours_after_node_median_s": median([r["ours_after_node_s"] for r in rounds]),
            "warm_reference": reference, "ours_ratio_to_warm": round(ours / reference["median_s"], 2),
            "goal": {"met": ours <= goal_s,
                     "text": f"goal (ours at most {GOAL_OURS_RATIO}x the warm submit-to-first-step, "
                             f"{reference['median_s']:.2f} s: {goal_s:.2f} s): ours {ours:.2f} s: "
                             f"{'met' if ours <= goal_s else 'not met'}"}}


def release_section(rounds: list[dict], idle_timeout_s: float, pass_s: float) -> dict:
    worst = max(r["empty_queue_to_release_s"] for r in rounds)
    goal_s = idle_timeout_s + pass_s
    return {"empty_queue_to_release_s": [r["empty_queue_to_release_s"] for r in rounds],
            "idle_timeout_s": idle_timeout_s, "pass_s": pass_s,
            "goal": {"met": worst <= goal_s, "text": f"goal (empty queue to the node's release within the idle timeout "
                                                    f"{idle_timeout_s:g} s plus one pass {pass_s:g} s = {goal_s:g} s): "
                                                    f"worst {worst:.1f} s: {'met' if worst <= goal_s else 'not met'}"}}


def drain_section(args, work: Path, dataset: str) -> dict:
    common.wait_until_quiet(log)
    r = scenario(work / "drain", dataset, "--drain", *(["--v2"] if args.v2 else []))
    summary = r["summary"]
    lost = summary.get("steps_redone")
    return {"steps_redone": lost, "world_sizes": summary.get("world_sizes"), "hook_rc": r["drain_hook_rc"],
            "hook_s": round(r["drain_hook_s"], 2), "failures": summary.get("failures"),
            "history": r["history"],
            "goal": {"met": lost == 0 and r["drain_hook_rc"] == 0,
                     "text": f"goal (steps lost when a node drained by `raytrain-sys node drain` leaves: 0): "
                             f"{lost} lost, the hook back in {r['drain_hook_s']:.1f} s with exit "
                             f"{r['drain_hook_rc']}: {'met' if lost == 0 and r['drain_hook_rc'] == 0 else 'not met'}"}}


def main() -> int:
    from tests.autoscale_scenario import IDLE_TIMEOUT_S, POLL_S

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--rounds", type=int, default=3, help="scale-ups timed (medians)")
    p.add_argument("--warm-workers", type=int, default=1,
                   help="the service's warm spares per node (its spare runners then up too), as a service runs")
    p.add_argument("--v2", action="store_true", help="Ray's autoscaler v2 (default v1)")
    common.add_reference_flag(p)
    p.add_argument("--quick", action="store_true", help="one round")
    p.add_argument("--out", default=str(HERE / "results" / "autoscale.json"))
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    sections = common.pick(p, args.sections, SECTIONS, "section")
    if args.quick:
        args.rounds = 1
    loadavg = os.getloadavg()
    work = Path(common.start(args.verbose, log, "rts-as-"))
    dataset = str(work / "data")
    from raytrain_sys.data.prepare import prepare_text_dataset

    prepare_text_dataset(dataset, row_len=33, rows_per_shard=512, max_bytes=400_000)
    results = {}
    if "scale_up" in sections or "release" in sections:
        rounds, _ = run_scale_up(args, work, dataset)
        if "scale_up" in sections:
            results["scale_up"] = scale_up_section(rounds, common.warm_reference(args.reference, args.rounds, work))
        if "release" in sections:
            results["release"] = release_section(rounds, IDLE_TIMEOUT_S, POLL_S)
    if "drain" in sections:
        results["drain"] = drain_section(args, work, dataset)
    lines = [results[name]["goal"]["text"] for name in results]
    for line in lines:
        print(line)
    report = common.report_head("autoscale", args.quick, loadavg) | {
        "args": vars(args), "autoscaler": "v2" if args.v2 else "v1", "sections": results, "table": lines}
    common.write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
