"""Peer copies (``checkpoint.peer_copies``, issue 29): what a copy of every rank's shard at every
step costs, and what it buys, FSDP over 2 workers, in one invocation on one cluster.

For each model (the tiny GPT of jobs/tinygpt.yaml, and a larger CPU model with hundreds of MB of
state), the same job four ways, in the order off, on, off, on (the machine drifts; the median of
each pair's steps is compared, and the ratio printed per pair):

  step time     median seconds a committed step, copies on / off (goal at most 1.05x), past a
                group's first WARM_UP_STEPS (one-step leases, policy.lease_steps, and for copies
                the channel's first use: printed apart, ``first_steps_s``)
  host memory   per rank: the bytes of the copies it holds for its peer, and of its own newest
                snapshot in its node's object store, each over its shard (parameters and optimizer
                state; goal: at most one extra shard)

and, for each model, one SIGKILL of a worker a moment into step N + 1 with a checkpoint every K
steps (recovery.py's fault and measure):

  recovery s    fault to the next committed step, copies on (from the peer's copy) against off
                (the checkpoint of step K restored, the steps since redone); goal at most 0.5x
  steps redone  0 with copies, N - K without

and what moving a copy costs by itself, no training beside it (``--sections transport``): a
rank's shard of each model (its owned blocks' sizes: parameters and AdamW's two moments, halved)
sent twenty times from an actor on one worker node to one on the other, two ways:

  ray           our path (PeerCopies.send to a peer's hold_copy and its receipt: ray.put into
                the node's object store, Ray's object transfer, the peer's copy into its arrays)
  gloo          a snapshot copied into a buffer of the sender's, then torch.distributed send /
                recv over gloo into the peer's buffer (a possible transport, not in the product)

  wall s        a copy, sent to held
  CPU-s         a copy's CPU in both actors and every raylet (the object transfer is theirs)
  floor         the step ratio that CPU alone sets when every core trains (this machine: two
                ranks on two cores): 1 + CPU-s / the step without copies, one copy a rank a step

Each worker node gets OBJECT_STORE_BYTES of object store, for the transport section's Ray-object
way (ray.cluster_utils' default of 150 MiB would spill a 170 MB copy; a real node's is 30% of its
memory); the product's copies go over gloo and use none.

    .venv/bin/python benchmarks/peer_copies.py               # both models (5-13 min on 2 cores)
    .venv/bin/python benchmarks/peer_copies.py --sections steady,kill,transport  # and a copy alone
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
import time
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
              "steps": 14, "kill_after": 9, "every": 5, "steady_steps": 30},
}
# A group's first steps go one a lease (policy.lease_steps: until three step times are known,
# and the first three of a group), each a lease's end; their copies also make the channel's
# pairs. The steady figure is past them (14 steps of the large model left 10, of which 4 were
# lease ends: the median was theirs).
WARM_UP_STEPS = 4

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
    asked: list = []  # (the group's first worker, its memory_bytes calls) in flight
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.3):
            workers = list(sup.group.workers) if sup.group is not None else []
            if len(workers) != 2:
                continue
            try:  # the copies' figures answer during a lease (the control group)
                stats = ray.get([w.actor.peer_copy_stats.remote() for w in workers], timeout=5)
            except Exception:  # between groups, or the run ending
                continue
            seen["held"] = max(seen["held"], *(s["held_bytes"] for s in stats))
            seen["sent"] = max(seen["sent"], *(s["sent_bytes"] for s in stats))
            seen["copy_s"] = max(s["copy_s"] for s in stats)
            # The shard's answer waits for the lease to end (a step's own method): asked once
            # at a time, read when it has come.
            if asked and asked[0] is not workers[0]:  # a new group: ask it
                asked.clear()
            if asked and not ray.wait(asked[1], num_returns=2, timeout=0)[1]:
                try:
                    memory = ray.get(asked[1])
                    seen["shard"] = max(seen["shard"], *(m["param_bytes"] + m["optim_bytes"] for m in memory))
                except Exception:
                    pass
                asked.clear()
            if not asked:
                asked.extend([workers[0], [w.actor.memory_bytes.remote() for w in workers]])

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    result = sup.run()
    done.set()
    poller.join(timeout=10)
    if result.status != "finished":
        raise RuntimeError(f"run ended {result.status}: {result.reason}")
    summary = RunSummary.read(result.run_dir)
    times = [t for t in summary.step_times if t is not None]
    return {"step_median_s": statistics.median(times[WARM_UP_STEPS:]), "steps": len(summary.step_times),
            "first_steps_s": [round(t, 4) for t in times[:WARM_UP_STEPS]], "leases": summary.leases,
            "held_bytes": seen["held"], "snapshot_bytes": seen["sent"], "shard_bytes": seen["shard"],
            "copy_s_total": seen["copy_s"]}


def measure(model: str, data_dir: str, work_dir: str, cluster, sections: list[str]) -> dict:
    cfg = MODELS[model]
    out: dict = {"model": model, "pairs": [], "kill": {}}
    for pair in range(2 if "steady" in sections else 0):
        row = {}
        for copies in (0, 1):
            spec = make_spec(data_dir, work_dir, f"{model}-steady-{pair}-{copies}", model, copies,
                             cfg.get("steady_steps", cfg["steps"]), every=0)
            row["on" if copies else "off"] = steady_run(spec)
            recovery.restore_nodes(cluster)
        row["ratio"] = row["on"]["step_median_s"] / row["off"]["step_median_s"]
        log.info("%s pair %d: step %.4f s with copies, %.4f s without: %.3fx (first %d steps: %s s on, "
                 "%s s off; leases %d on, %d off)", model, pair, row["on"]["step_median_s"],
                 row["off"]["step_median_s"], row["ratio"], WARM_UP_STEPS, row["on"]["first_steps_s"],
                 row["off"]["first_steps_s"], row["on"]["leases"], row["off"]["leases"])
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


def shard_pieces(model: str) -> dict:
    """A rank's owned blocks under FSDP x2, by size: half of each parameter, and as much of each
    of AdamW's two moments (the values do not matter to a copy's cost)."""
    import torch

    from raytrain_sys.models import build_model
    from raytrain_sys.parallel.reshard import Piece

    spec = make_spec("/nonexistent", "/tmp", "transport", model, 1, 1, 0)
    pieces = {}
    for name, param in build_model(spec.model).named_parameters():
        half = (param.numel() + 1) // 2
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            pieces[f"{name}/{kind}"] = Piece((param.numel(),), (0,), torch.rand(half, dtype=param.dtype))
    return pieces


COPIES = 20  # each way


def transport(model: str, cluster) -> dict:
    """One rank's copy moved between the two worker nodes, our way (ray) and over gloo."""
    import psutil
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_sys.control.drain import alive_nodes

    nodes = sorted(n for n in alive_nodes() if n != cluster.head_node.node_id)[:2]
    at = [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes]
    end = ray.remote(num_cpus=0)(CopyEnd)
    src = end.options(scheduling_strategy=at[0]).remote(model, 0)
    peer = end.options(scheduling_strategy=at[1]).remote(model, 1)
    pids = ray.get([src.pid.remote(), peer.pid.remote()])
    port = 29000 + os.getpid() % 1000
    ray.get([src.gloo.remote(port), peer.gloo.remote(port)])

    def cpu() -> float:
        total = 0.0
        for proc in psutil.process_iter(["name", "pid"]):
            if proc.info["pid"] in pids or "raylet" in (proc.info["name"] or ""):
                try:
                    t = proc.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
        return total

    out = {"bytes": ray.get(src.nbytes.remote())}
    for way in ("ray", "gloo", "ray", "gloo"):  # twice each, alternated; the second counts (the
        # first makes the buffers and the object store's pages)
        common.wait_until_quiet(log, max_s=20)
        c0, t0 = cpu(), time.perf_counter()
        if way == "ray":
            ray.get(src.ray_copies.remote(peer, COPIES))
        else:
            ray.get([src.gloo_copies.remote(COPIES), peer.gloo_copies.remote(COPIES)])
        wall, used = time.perf_counter() - t0, cpu() - c0
        out[way] = {"wall_s": wall / COPIES, "cpu_s": used / COPIES}
        log.info("%s transport %s: %.1f ms, %.1f CPU-ms a copy", model, way, wall / COPIES * 1e3,
                 used / COPIES * 1e3)
    for actor in (src, peer):
        ray.kill(actor)
    return out


class CopyEnd:
    """Either end of a copy: the sender (rank 0) holds a shard's blocks, the peer (rank 1) what
    it receives. The ray way is the product's PeerCopies on both ends."""

    def __init__(self, model: str, rank: int):
        import torch

        from raytrain_sys.control.peer_copies import PeerCopies

        torch.set_num_threads(1)
        self.rank, self.copies = rank, PeerCopies()
        self.pieces = shard_pieces(model)
        self.flat = torch.cat([p.data.reshape(-1) for p in self.pieces.values()])
        self.snapshot = torch.empty_like(self.flat)

    def pid(self) -> int:
        return os.getpid()

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def hold_copy(self, generation: int, source: int, step: int, wire: dict) -> int:
        held = self.copies.hold(generation, source, step, wire)
        self.copies.agreed(step, generation)  # one copy held at a time, as at a lease's end
        return held

    def ray_copies(self, peer, n: int) -> None:
        self.copies.set_peer(peer, 1, 1)
        for step in range(n):
            self.copies.send(0, step, self.pieces)
            self.copies.wait(60.0)
            self.copies.agreed(step, 1)

    def gloo(self, port: int) -> None:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                world_size=2, timeout=datetime.timedelta(seconds=60))

    def gloo_copies(self, n: int) -> None:
        import torch.distributed as dist

        for _ in range(n):
            if self.rank == 0:
                self.snapshot.copy_(self.flat)  # the state goes on changing: send a snapshot
                dist.send(self.snapshot, 1)
            else:
                dist.recv(self.snapshot, 0)
        dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,large")
    p.add_argument("--out", default=str(HERE / "results" / "peer_copies.json"))
    p.add_argument("--sections", default="steady,kill",
                   help="steady (step time and memory), kill, transport (a copy's cost alone)")
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
        sections = common.pick(p, args.sections, ("steady", "kill", "transport"), "--sections")
        report["models"] = {m: measure(m, data_dir, work_dir, cluster, sections) for m in models}
        if "transport" in sections:
            for m in models:
                report["models"][m]["transport"] = transport(m, cluster)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
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
        t = r.get("transport")
        if t:
            step = r["pairs"][-1]["off"]["step_median_s"] if r["pairs"] else None
            floors = {way: 1 + t[way]["cpu_s"] / step for way in ("ray", "gloo")} if step else {}
            print(f"{m}: a copy of {t['bytes'] / 2**20:.1f} MB alone: ray {t['ray']['wall_s'] * 1e3:.1f} ms, "
                  f"{t['ray']['cpu_s'] * 1e3:.1f} CPU-ms; gloo {t['gloo']['wall_s'] * 1e3:.1f} ms, "
                  f"{t['gloo']['cpu_s'] * 1e3:.1f} CPU-ms ({t['ray']['cpu_s'] / t['gloo']['cpu_s']:.2f}x the CPU)"
                  + (f"; step-ratio floor {floors['ray']:.3f}x ray, {floors['gloo']:.3f}x gloo" if floors else ""))
            if floors:
                t["floor"] = floors
    common.write_report(args.out, report)
    shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
