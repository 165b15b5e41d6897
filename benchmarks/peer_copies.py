"""Peer copies (``checkpoint.peer_copies``, issue 29): what a copy of every rank's shard at every
step costs, and what it buys, FSDP over 2 workers, in one invocation on one cluster.

For each model (the tiny GPT of jobs/tinygpt.yaml, and a larger CPU model with hundreds of MB of
state), the same job four ways, in the order off, on, off, on (the machine drifts; the median of
each pair's steps is compared, and the ratio printed per pair):

  step time     median seconds a committed step, copies on / off (goal at most 1.05x)
  host memory   per rank: the bytes of the copies it holds for its peer, and of its own newest
                snapshot in its node's object store, each over its shard (parameters and optimizer
                state; goal: at most one extra shard)

and, for each model, one SIGKILL of a worker a moment into step N + 1 with a checkpoint every K
steps (recovery.py's fault and measure):

  recovery s    fault to the next committed step, copies on (from the peer's copy) against off
                (the checkpoint of step K restored, the steps since redone); goal at most 0.5x
  steps redone  0 with copies, N - K without

Each worker node gets OBJECT_STORE_BYTES of object store (ray.cluster_utils' default of 150 MiB
would spill the large model's snapshots to disk at every step; a real node's is 30% of its memory).

    .venv/bin/python benchmarks/peer_copies.py               # both models (about 8 min on 2 cores)
    .venv/bin/python benchmarks/peer_copies.py --models tiny # the tiny GPT only

Results go to benchmarks/results/peer_copies.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import _common as common  # noqa: E402
import recovery  # noqa: E402  (its cluster, and its worker-kill run and measure)
import yaml  # noqa: E402

from raytrain_sys.spec import JobSpec, from_dict  # noqa: E402

MODELS = {
    "tiny": {"model": {}, "batch": 32, "steps": 40, "kill_after": 25, "every": 20},
    # about 28 M parameters: 0.34 GB of parameters and AdamW state, 0.17 GB a rank under FSDP x2
    "large": {"model": {"n_layer": 4, "n_embd": 768, "n_head": 12}, "batch": 4,
              "steps": 14, "kill_after": 9, "every": 5},
}

OBJECT_STORE_BYTES = 2 * 2**30  # each worker node's (recovery.WORKER_NODES of them)

log = logging.getLogger("peer_copies")


def make_spec(data_dir: str, work_dir: str, name: str, model: dict, copies: int, steps: int,
              every: int) -> JobSpec:
    with open(REPO / "jobs" / "tinygpt.yaml") as f:
        raw = yaml.safe_load(f)
    cfg = MODELS[model]
    raw["model"].update(cfg["model"])
    raw["name"] = name
    raw["output_dir"] = os.path.join(work_dir, name)
    raw["data"]["path"] = data_dir
    raw["data"]["shuffle_window"] = 256
    raw["train"].update({"max_steps": steps, "log_every_steps": 1, "global_batch_size": cfg["batch"],
                         "steps_per_call": 0})
    raw["optim"]["warmup_steps"] = min(raw["optim"].get("warmup_steps", 20), steps)
    raw["checkpoint"] = {"every_steps": every, "keep_last": 2, "peer_copies": copies}
    raw["parallel"] = {"strategy": "fsdp"}
    raw["tracking"] = {"enabled": False}
    raw["resources"] = {"num_workers": 2, "cpus_per_worker": 1}
    return from_dict(raw)


def steady_run(spec: JobSpec) -> dict:
    """One run without a fault: the median step time, and each rank's copy bytes (polled)."""
    import ray

    from raytrain_sys.control.run_record import RunSummary
    from raytrain_sys.control.supervisor import Supervisor

    sup = Supervisor(spec)
    seen = {"held": 0, "sent": 0, "shard": 0, "copy_s": 0.0}
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.3):
            workers = list(sup.group.workers) if sup.group is not None else []
            if len(workers) != 2:
                continue
            try:
                stats = ray.get([w.actor.peer_copy_stats.remote() for w in workers], timeout=5)
                memory = ray.get([w.actor.memory_bytes.remote() for w in workers], timeout=5)
            except Exception:  # between groups, or the run ending
                continue
            seen["held"] = max(seen["held"], *(s["held_bytes"] for s in stats))
            seen["sent"] = max(seen["sent"], *(s["sent_bytes"] for s in stats))
            seen["copy_s"] = max(s["copy_s"] for s in stats)
            seen["shard"] = max(seen["shard"], *(m["param_bytes"] + m["optim_bytes"] for m in memory))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    result = sup.run()
    done.set()
    poller.join(timeout=10)
    if result.status != "finished":
        raise RuntimeError(f"run ended {result.status}: {result.reason}")
    summary = RunSummary.read(result.run_dir)
    times = [t for t in summary.step_times if t is not None][3:]  # past the first steps' one-off costs
    return {"step_median_s": statistics.median(times), "steps": len(summary.step_times),
            "held_bytes": seen["held"], "snapshot_bytes": seen["sent"], "shard_bytes": seen["shard"],
            "copy_s_total": seen["copy_s"]}


def measure(model: str, data_dir: str, work_dir: str, cluster, sections: list[str]) -> dict:
    cfg = MODELS[model]
    out: dict = {"model": model, "pairs": [], "kill": {}}
    for pair in range(2 if "steady" in sections else 0):
        row = {}
        for copies in (0, 1):
            spec = make_spec(data_dir, work_dir, f"{model}-steady-{pair}-{copies}", model, copies,
                             cfg["steps"], every=0)
            row["on" if copies else "off"] = steady_run(spec)
            recovery.restore_nodes(cluster)
        row["ratio"] = row["on"]["step_median_s"] / row["off"]["step_median_s"]
        log.info("%s pair %d: step %.4f s with copies, %.4f s without: %.3fx", model, pair,
                 row["on"]["step_median_s"], row["off"]["step_median_s"], row["ratio"])
        out["pairs"].append(row)
    if out["pairs"]:
        on = out["pairs"][-1]["on"]
        out["step_ratio"] = statistics.median(p["ratio"] for p in out["pairs"])
        out["held_over_shard"] = on["held_bytes"] / on["shard_bytes"] if on["shard_bytes"] else None
        out["snapshot_over_shard"] = on["snapshot_bytes"] / on["shard_bytes"] if on["shard_bytes"] else None
    for copies in ((1, 0) if "kill" in sections else ()):
        spec = make_spec(data_dir, work_dir, f"{model}-kill-{copies}", model, copies, cfg["steps"], cfg["every"])
        run = recovery.run_raytrain_sys(spec, "worker-kill", cfg["kill_after"], cluster)
        out["kill"]["on" if copies else "off"] = {k: run[k] for k in (
            "recovery_s", "steps_redone", "regain_s", "detect_s", "decide_s", "reform_s", "first_step_s",
            "step_time_median_s", "decision_reason", "world_sizes")}
        recovery.restore_nodes(cluster)
    k = out["kill"]
    if k:
        out["recovery_ratio"] = k["on"]["recovery_s"] / k["off"]["recovery_s"]
        out["regain_ratio"] = k["on"]["regain_s"] / k["off"]["regain_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,large")
    p.add_argument("--out", default=str(HERE / "results" / "peer_copies.json"))
    p.add_argument("--sections", default="steady,kill", help="steady (step time and memory), kill")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    models = common.pick(p, args.models, MODELS, "--models")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("raytrain_sys", "ray"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    loadavg = os.getloadavg()
    work_dir = tempfile.mkdtemp(prefix="rts-peer-")
    from raytrain_sys.data.prepare import prepare_text_dataset

    data_dir = os.path.join(work_dir, "data")
    prepare_text_dataset(data_dir, row_len=129, rows_per_shard=512, max_bytes=2_000_000)
    # A node's object store holds each rank's newest snapshots (hundreds of MB for the large
    # model): ray.cluster_utils' 150 MiB would spill every one of them to disk, which no real
    # node (30% of its memory) does.
    recovery.NODE_ARGS["object_store_memory"] = OBJECT_STORE_BYTES
    cluster = recovery.start_cluster(work_dir, args.verbose)
    report = common.report_head("peer_copies", False, loadavg)
    try:
        sections = common.pick(p, args.sections, ("steady", "kill"), "--sections")
        report["models"] = {m: measure(m, data_dir, work_dir, cluster, sections) for m in models}
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    common.write_report(args.out, report)
    for m, r in report["models"].items():
        if r["pairs"]:
            pairs = ", ".join(f"{pair['ratio']:.3f}" for pair in r["pairs"])
            print(f"{m}: step with copies / without {r['step_ratio']:.3f}x (pairs {pairs}); held copies {r['held_over_shard'] or 0:.2f}x "
                  f"a shard, own snapshot {r['snapshot_over_shard'] or 0:.2f}x")
        k = r["kill"]
        if k:
            print(f"{m}: kill to the next committed step {k['on']['recovery_s']:.2f} s with copies, "
                  f"{k['off']['recovery_s']:.2f} s from the checkpoint ({r['recovery_ratio']:.2f}x); to the step in "
                  f"flight done again {k['on']['regain_s']:.2f} / {k['off']['regain_s']:.2f} s ({r['regain_ratio']:.2f}x); "
                  f"steps redone {k['on']['steps_redone']} / {k['off']['steps_redone']}")
    shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
