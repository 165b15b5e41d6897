"""Recovery after failures: raytrain-sys against Ray Train's TorchTrainer, same model, same fault.

One invocation starts one ``ray.cluster_utils.Cluster`` (a 0-CPU head and three 1-CPU worker
nodes, in a private temp dir) and runs, with the same model, data, global batch, 2 workers and a
checkpoint every K steps:

  worker kill   raytrain-sys   SIGKILL of one of the 2 workers' processes in the middle of step N+1
  worker kill   ray-train      the same fault under TorchTrainer (Ray Train v2), FailureConfig(
                               max_failures=3), a Checkpoint reported through ray.train.report
                               every K steps and loaded from ray.train.get_checkpoint() on restart
  node loss     raytrain-sys   remove_node(allow_graceful=False) of one worker's node after step N
  drain         raytrain-sys   a PREEMPTION drain (deadline 60 s) of one worker's node after step N,
                               once per lease length of ``--drain-leases`` (train.steps_per_call;
                               0: automatic, as many steps as fit in 10 s)
  hang          raytrain-sys   rank 1's loss (the task's loss_sum) never returns at step N+1, once: its
                               process stays alive and answers, its peer waits in the all-reduce;
                               the step deadline learned from the run's steps (elastic.hang_floor_s
                               at its default) decides
  hang          ray-train      the same hang in the same place of TorchTrainer's loop: its
                               TorchConfig(timeout_s=--ray-train-timeout-s) and health check decide
  supervisor    raytrain-sys   the driver's process (the Supervisor, in a process of its own)
  kill                         SIGKILLed once its rank 0 holds step N; a new Supervisor of the same
                               run started at once in this process adopts the live workers
                               (control/adoption.py), and completes the lease the lost
                               driver had sent ahead for the ranks it never reached
  supervisor    ray-train      the same: TorchTrainer.fit()'s driver process SIGKILLed (its
  kill                         controller and workers end with it), then the same RunConfig(name,
                               storage_path) fitted again at once, which resumes from the newest
                               checkpoint reported (Ray Train v2's answer to a lost driver)

Per scenario:

  recovery s    seconds from the fault to the next step committed after it. raytrain-sys commits a
                step when every rank finished its optimizer step; for a lost node or a drain, the
                first step committed by the group that no longer holds the node (a node's worker
                can outlive its raylet for a second and still commit steps, correct ones); for a
                hang, from the moment the loss stopped to the first step committed by the
                re-formed group (the steps the survivor finished before it are committed, not
                counted). For Ray Train: the first optimizer step any attempt completes after the
                fault (Ray Train commits nothing per step; this favours it).
  steps redone  committed steps executed again (Ray Train: from its newest checkpoint on).
  regain s      seconds from the fault until the step that was running at the fault is done: the
                progress lost, redone steps included.

and for raytrain-sys the split of the recovery from its own state transitions (detect: fault to
the rebuild decision; re-form: new process group and state sync among survivors; step: the next
step, on the smaller world). Goals (issue 4, 2-core machine): worker kill <= 2 step times + 2 s,
node loss <= 5 s, 0 steps redone; issue 26: a drain notice to the node left (the boundary that
lets its workers go) <= one step + 1 s, 0 steps redone, at every lease length; issue 59: a hang
to the next committed step <= its deadline + 2 s + 2 step times, and <= 10 s at the default
deadline, 0 steps redone; issue 57: a supervisor kill costs 0 steps redone.

``--sections`` picks scenarios by kind, each with its Ray Train counterpart where there is one
(kill, node, drain, hang); ``--scenarios`` names them one by one. By default the first four run
(kill, Ray Train's kill, node, drain): the hang's pair adds about 3 minutes.

    .venv/bin/python benchmarks/recovery.py --quick      # the CI-sized model
    .venv/bin/python benchmarks/recovery.py              # jobs/tinygpt.yaml's model
    .venv/bin/python benchmarks/recovery.py --sections hang   # the hang, both frameworks
    RAYTRAIN_SYS_CODE=/work/main PYTHONPATH=/work/main .venv/bin/python benchmarks/recovery.py
                                                         # the same, with another checkout's library

The fault comes when rank 0 holds step N (asked on its control path every 20 ms): a moment
into step N + 1, whatever the lease sizes (a commit comes at a lease's end, so an event at the
commit of step N would land many steps later under long leases).

Either takes 2.5 to 4.5 min on 2 cores, depending on the load.

Results go to benchmarks/results/recovery.json (``"quick": true`` marks a smoke test's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
# The library measured: this checkout's, or the one RAYTRAIN_SYS_CODE names (set PYTHONPATH to it
# too, for the workers), to compare two versions with the same benchmark, back to back.
sys.path.insert(0, os.environ.get("RAYTRAIN_SYS_CODE") or str(REPO))

import _common as common  # noqa: E402
import _torchrun_ddp as baseline  # noqa: E402  (model build, share reader and step seed)
import yaml  # noqa: E402

from raytrain_sys.spec import ElasticSpec, JobSpec, from_dict  # noqa: E402

# Ray 2.60 defaults to Train v2 already; pin it so the figures always name the same controller.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

QUICK_MODEL = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}  # tests/helpers.tiny_spec's
QUICK_BATCH = 8
WORKER_NODES = 3  # 2 workers + room for a replacement
DRAIN_DEADLINE_S = 60.0
SCENARIOS = ("worker-kill", "ray-train-worker-kill", "node-loss", "drain", "hang", "ray-train-hang",
             "supervisor-kill", "ray-train-supervisor-kill")
DEFAULT_SCENARIOS = SCENARIOS[:4]  # the hang's pair only when asked (--sections hang): 3 more minutes
SECTIONS = {"kill": ("worker-kill", "ray-train-worker-kill"), "node": ("node-loss",), "drain": ("drain",),
            "hang": ("hang", "ray-train-hang"), "supervisor": ("supervisor-kill", "ray-train-supervisor-kill")}
HANG_MARKER = "hang-began-{name}"  # in the work dir: when the hung loss began (unix s), written by the hung rank
HUNG_RANK = 1

log = logging.getLogger("recovery")


# ----------------------------------------------------------------------------- setup

class _StuckInLoss:
    """The benchmark's hang (``train.task``, which travels to the workers by value from
    ``__main__``): the model's next-token loss, except that on rank HUNG_RANK its ``at_call``-th
    call never returns, once in the run (``_hang_once``)."""

    def __init__(self, marker: str, at_call: int):
        from raytrain_sys.train.tasks import NextToken

        self.inner, self.marker, self.at_call, self.calls = NextToken(), marker, at_call, 0

    def units(self, batch):
        return self.inner.units(batch)

    def row_units(self, batch):
        return self.inner.row_units(batch)

    def loss_sum(self, model, batch):
        import torch.distributed as dist

        self.calls += 1
        if self.calls == self.at_call and dist.is_initialized() and dist.get_rank() == HUNG_RANK:
            _hang_once(self.marker)
        return self.inner.loss_sum(model, batch)


def _hang_once(marker: str) -> None:
    """Sleep far past any deadline, the first time any process of the run gets here; the marker
    file, claimed atomically, says when."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, repr(time.time()).encode())
    os.close(fd)
    time.sleep(3600)


def make_spec(args: argparse.Namespace, data_dir: str, work_dir: str, name: str,
              lease_steps: int = 0, hang_marker: str = "") -> JobSpec:
    with open(REPO / "jobs" / "tinygpt.yaml") as f:
        raw = yaml.safe_load(f)
    if args.quick:
        raw["model"].update(QUICK_MODEL)
        raw["train"]["global_batch_size"] = QUICK_BATCH
    raw["name"] = name
    raw["output_dir"] = os.path.join(work_dir, name)
    raw["data"]["path"] = data_dir
    raw["data"]["shuffle_window"] = 256
    raw["train"]["max_steps"] = args.steps
    raw["train"]["log_every_steps"] = 1
    raw["train"]["steps_per_call"] = lease_steps
    raw["optim"]["warmup_steps"] = min(raw["optim"].get("warmup_steps", 20), args.steps)
    raw["checkpoint"] = {"every_steps": args.checkpoint_every, "keep_last": 2}
    # MLflow off: Ray Train tracks nothing either; the figures are about recovery.
    raw["tracking"] = {"enabled": False}
    raw["resources"] = {"num_workers": 2, "cpus_per_worker": 1}
    # How often draining nodes are looked up (the job default is 1 s): with the small model the
    # steps after the notice would otherwise end before the first look.
    raw["elastic"] = {"drain_poll_s": args.drain_poll_s}
    if hang_marker:  # rank 1 hangs in its loss at step fault_step + 1; elastic.hang_floor_s stays the default
        raw["train"]["task"] = _StuckInLoss(hang_marker, args.fault_step + 1)
    return from_dict(raw)


# Each worker node's Ray arguments. ray.cluster_utils gives a node 150 MiB of object store by
# default (a real node's is 30% of its memory): a benchmark whose objects are larger sets more.
NODE_ARGS = {"num_cpus": 1}


def start_cluster(work_dir: str, verbose: bool):
    """0-CPU head + WORKER_NODES 1-CPU nodes. RAY_TMPDIR points into work_dir: Cluster records
    its address in <RAY_TMPDIR>/ray/ray_current_cluster, and must not re-point anybody else's
    `ray` commands on this machine to ours."""
    import ray
    from ray.cluster_utils import Cluster

    ray_tmp = os.path.join(work_dir, "rt")
    os.makedirs(os.path.join(ray_tmp, "ray"), exist_ok=True)
    os.environ["RAY_TMPDIR"] = ray_tmp
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        os.environ.pop(var, None)
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "temp_dir": os.path.join(work_dir, "r"),
                                      "include_dashboard": False})
    for _ in range(WORKER_NODES):
        cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=verbose)
    return cluster


def restore_nodes(cluster) -> None:
    """Back to WORKER_NODES alive worker nodes (a lost or drained node is replaced)."""
    from raytrain_sys.control.drain import alive_nodes

    alive = alive_nodes()
    for node in list(cluster.worker_nodes):
        if node.node_id not in alive:
            cluster.remove_node(node, allow_graceful=False)
    while len(cluster.worker_nodes) < WORKER_NODES:
        cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()


# ----------------------------------------------------------------------------- raytrain-sys

def run_raytrain_sys(spec: JobSpec, fault: str, at_step: int, cluster, hang_marker: str = "") -> dict:
    """One run with one fault injected right after step ``at_step`` is committed (a hang: the
    run's own task hangs in step ``at_step + 1``; ``hang_marker`` says when)."""
    from raytrain_sys.control import drain
    from raytrain_sys.control.run_record import RunSummary
    from raytrain_sys.control.supervisor import Supervisor

    commits: list[tuple[int, float]] = []
    fault_at: dict = {}
    sup: Supervisor

    def inject(s: Supervisor) -> None:
        victim = s.group.workers[1]
        if fault == "worker-kill":
            # A moment into the next step, so that the step is in flight (as in the tests).
            def kill():
                fault_at["t"] = time.time()
                os.kill(victim.info["pid"], signal.SIGKILL)
            threading.Timer(0.02, kill).start()
        elif fault == "node-loss":
            node = next(n for n in cluster.worker_nodes if n.node_id == victim.node_id)
            fault_at["t"] = time.time()
            threading.Thread(target=cluster.remove_node, args=(node,),
                             kwargs={"allow_graceful": False}).start()
        elif fault == "drain":
            fault_at["t"] = time.time()
            threading.Thread(target=drain.drain_node, args=(victim.node_id, "PREEMPTION",
                                                            DRAIN_DEADLINE_S, "benchmark")).start()
        fault_at["slot"] = victim.slot

    def on_step(report) -> None:
        commits.append((report.step, time.time()))

    def watch_progress() -> None:
        # Rank 0 holds step at_step: it runs step at_step + 1 now.
        while not fault_at and sup.state.value not in ("finished", "failed"):
            workers = list(sup.group.workers) if sup.group is not None else []
            try:
                held = ray.get(workers[0].actor.ping.remote(), timeout=5) if len(workers) == 2 else 0
            except ray.exceptions.RayError:
                held = 0
            if held >= at_step:
                inject(sup)
                return
            time.sleep(0.02)

    import ray

    sup = Supervisor(spec, on_step=on_step)
    watcher = threading.Thread(target=watch_progress, daemon=True)
    if fault != "hang":
        watcher.start()
    t0 = time.perf_counter()
    result = sup.run()
    wall = time.perf_counter() - t0
    if fault != "hang":
        watcher.join(timeout=10)
    if result.status != "finished":
        raise RuntimeError(f"raytrain-sys {fault} run ended {result.status}: {result.reason}")
    summary = RunSummary.read(result.run_dir)
    if fault == "hang":
        fault_at["t"] = float(Path(hang_marker).read_text())
    t_fault = fault_at["t"]
    trans = [t for t in summary.transitions if t["time"] >= t_fault]
    # The decision: the first rebuild (kill, node loss) or leave (drain) after the fault.
    decided = next(t for t in trans if t["state"] in ("rebuilding", "draining"))
    formed = next(t for t in trans if t["state"] == "running" and t["time"] >= decided["time"])
    # When the failure was first seen; the rebuild starts once the step's other members have
    # returned (their collective fails), which is the "decide" part.
    detected = decided.get("detected_at") or decided["time"]
    after = [(s, t) for s, t in commits if t > formed["time"]]
    # The replacement joins at a step boundary once it is up (model built in the background):
    # how long the running members wait for that re-form.
    resized = next((t for t in trans if t["state"] == "resizing"), None)
    grown = next((t for t in trans if resized and t["state"] == "running"
                  and t["time"] >= resized["time"]), None)
    # The node left: its workers were let go at the boundary the notice cut the lease short at
    # (the drain's decision) and the group re-formed without them.
    left = decided if fault == "drain" else None
    next_step, next_t = after[0]
    in_flight = at_step + 1  # the step running at the fault
    steps_seen = [s for s, _ in commits]
    redone = len(steps_seen) - len(set(steps_seen))
    regain_t = next(t for s, t in commits if s >= in_flight and t > t_fault)
    before = [t for t in summary.step_times[:at_step] if t is not None]  # a lease's steps share its time
    hung = [h for r in summary.recoveries for h in r.get("hung", [])]
    return {
        "framework": "raytrain-sys", "fault": fault, "fault_after_step": at_step,
        "lease_steps": spec.train.steps_per_call, "leases": summary.leases,
        "node_left_s": left["time"] - t_fault if left else None,
        "node_left_at_step": left["step"] if left else None,
        "recovery_s": next_t - t_fault,
        # The same steps both ways (committed twice, and counted by the restore): not their sum.
        "steps_redone": max(redone, summary.steps_redone),
        "regain_s": regain_t - t_fault, "next_step": next_step,
        "detect_s": detected - t_fault,
        "decide_s": decided["time"] - detected,
        "reform_s": formed["time"] - decided["time"],
        "first_step_s": next_t - formed["time"],
        "replacement_joined_after_s": grown["time"] - t_fault if grown else None,
        "join_stall_s": grown["time"] - resized["time"] if grown else None,
        # Steps the lost node's worker still committed before the loss was seen (node loss).
        "steps_committed_before_detection": sum(1 for _, t in commits if t_fault < t < decided["time"]),
        "step_time_median_s": statistics.median(before[2:] or before),
        "decision_reason": decided["reason"][:300],
        # a hang: the deadline that found it, and whom it named, where
        "deadline_s": hung[0]["deadline_s"] if hung else None,
        "named_rank": hung[0]["rank"] if hung else None,
        "top_frame": hung[0]["top_frame"] if hung else None,
        "world_sizes": summary.world_sizes, "failures": summary.failures,
        "wall_s": wall, "commit_times": commits, "fault_unix_s": t_fault,
        "transitions": summary.transitions,
    }


# A Supervisor (or a TorchTrainer.fit()) of its own in a child process, attached to the cluster, so
# that its process can be SIGKILLed: argv = [spec yaml, run dir] or [ray-train config json].
OUR_DRIVER = """
import logging, sys, ray, yaml
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
from raytrain_sys.spec import from_dict
from raytrain_sys.control.supervisor import Supervisor
ray.init()
Supervisor(from_dict(yaml.safe_load(open(sys.argv[1]))), run_dir=sys.argv[2]).run()
"""
RAY_TRAIN_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[2])
import ray
ray.init()
import recovery
recovery.ray_train_trainer(**json.load(open(sys.argv[1]))).fit()
"""


def _child(code: str, *argv: str, log_path: str):
    import subprocess

    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join([os.environ.get("RAYTRAIN_SYS_CODE") or str(REPO),
                                          os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "a") as out:
        return subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=out, stderr=subprocess.STDOUT)


def run_supervisor_kill(spec: JobSpec, at_step: int, work_dir: str) -> dict:
    """The Supervisor's process SIGKILLed once its rank 0 holds step ``at_step`` (a moment into
    the next), then a new Supervisor of the same run started at once here: it adopts the live
    workers (``control.adoption``)."""
    import copy

    import ray

    from raytrain_sys.control import adoption, launches
    from raytrain_sys.control.run_record import RunSummary
    from raytrain_sys.control.supervisor import Supervisor

    # With the default run-ahead: the lease sent ahead when the driver died starts on rank 1 (its
    # agent's call) and not on rank 0 (the driver's own call, dropped with it); the new Supervisor
    # completes it for rank 0 (control/adoption.py: Running).
    spec = copy.deepcopy(spec)
    run_dir = os.path.join(spec.output_dir, "run")
    run_key = os.path.basename(run_dir)
    spec_path = os.path.join(work_dir, "supervisor-kill.yaml")
    Path(spec_path).write_text(yaml.safe_dump(spec.to_dict()))
    t0 = time.perf_counter()
    driver = _child(OUR_DRIVER, spec_path, run_dir, log_path=os.path.join(work_dir, "supervisor-kill.log"))
    held = 0
    try:
        while held < at_step:
            if driver.poll() is not None:
                raise RuntimeError(f"the driver ended before step {at_step}: see {work_dir}/supervisor-kill.log")
            mine = [p for p in launches.launches() if p.startswith(launches.run_name_prefix(run_key))]
            ranks = adoption.named_ranks(mine[0]) if mine else {}
            try:
                held = min(ray.get([a.ping.remote() for a, _ in ranks.values()], timeout=5)) if len(ranks) == 2 else 0
            except ray.exceptions.RayError:
                held = 0
            time.sleep(0.02)
        t_fault = time.time()
        driver.kill()
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=60)
    commits: list[tuple[int, float]] = []
    again = copy.deepcopy(spec)
    again.checkpoint.resume_from = "latest"
    result = Supervisor(again, run_dir=run_dir, previous_run_key=run_key,
                        on_step=lambda r: commits.append((r.step, time.time()))).run()
    wall = time.perf_counter() - t0
    if result.status != "finished":
        raise RuntimeError(f"raytrain-sys supervisor-kill run ended {result.status}: {result.reason}")
    summary = RunSummary.read(run_dir)
    adopted = next((t for t in summary.transitions if t["time"] > t_fault and "adopted the" in t["reason"]), None)
    if adopted is None:
        raise RuntimeError(f"the new Supervisor adopted nothing: {[t['reason'] for t in summary.transitions][-5:]}")
    adopted_step = int(adopted["reason"].split(" at step ")[1].split(" ")[0])
    after = [(s, t) for s, t in commits if s > adopted_step]  # trained by the new Supervisor
    before = [t for t in summary.step_times[:at_step] if t is not None]
    return {
        "framework": "raytrain-sys", "fault": "supervisor-kill", "fault_after_step": at_step,
        "recovery_s": after[0][1] - t_fault, "next_step": after[0][0], "steps_redone": summary.steps_redone,
        "adopted_s": adopted["time"] - t_fault, "adopted_at_step": adopted_step,
        "lease_completed": next((t["reason"] for t in summary.transitions
                                 if t["time"] > t_fault and "sent ahead by the lost driver" in t["reason"]), ""),
        "steps_trained_with_no_driver": adopted_step - at_step,
        "regain_s": next(t for s, t in commits if s >= at_step + 1) - t_fault,
        "first_step_s": after[0][1] - adopted["time"],
        "step_time_median_s": statistics.median(before[2:] or before),
        "start_phases": summary.start_phases, "wall_s": wall, "fault_unix_s": t_fault,
        "transitions": summary.transitions,
    }


# ----------------------------------------------------------------------------- Ray Train

def _ray_train_loop(config: dict) -> None:
    """TorchTrainer's train_loop_per_worker: the Supervisor's step (TrainWorker.train_step's
    math, as _torchrun_ddp.run_steps does it), resumable from a reported checkpoint."""
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    from raytrain_sys.train.optim import lr_at

    spec = from_dict(config["spec"])
    torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    events = Path(config["events"])
    attempt = uuid.uuid4().hex[:8]
    Path(config["pid_dir"], f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        with open(events, "a") as f:
            f.write(json.dumps({"attempt": attempt, "event": "start", "t": time.time()}) + "\n")

    model, optimizer = baseline.build(spec)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = int(state["step"])
    ddp = ray.train.torch.prepare_model(model)
    reader = baseline.ShareReader(spec.data, spec.train.global_batch_size, world, rank)
    B = spec.train.global_batch_size
    every = spec.checkpoint.every_steps
    ddp.train()
    for step in range(start, spec.train.max_steps):
        tokens, _ = reader.share_rows(step * B)
        lr = lr_at(step, spec.optim, spec.train.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(baseline._step_seed(spec.train.seed, step, rank))
        rows = torch.from_numpy(tokens.astype(np.int64))
        x, y = rows[:, :-1], rows[:, 1:]
        if config.get("hang_marker") and rank == HUNG_RANK and step + 1 == config["hang_step"]:
            _hang_once(config["hang_marker"])  # the loss of step hang_step never returns (once)
        logits = ddp(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                               reduction="sum")
        (loss * (world / (B * y.shape[1]))).backward()
        clip = spec.optim.grad_clip if spec.optim.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            with open(events, "a") as f:
                f.write(json.dumps({"attempt": attempt, "event": "step", "step": step + 1,
                                    "t": time.time()}) + "\n")
        if every and (step + 1) % every == 0:
            with tempfile.TemporaryDirectory() as d:
                reported = None
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                                "step": step + 1}, os.path.join(d, "state.pt"))
                    reported = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step + 1}, checkpoint=reported)
            if rank == 0:
                with open(events, "a") as f:
                    f.write(json.dumps({"attempt": attempt, "event": "reported", "step": step + 1,
                                        "t": time.time()}) + "\n")


def ray_train_trainer(spec: dict, run_dir: str, events: str, pid_dir: str, hang_marker: str = "",
                      hang_step: int = 0, timeout_s: float = 1800.0):
    """The TorchTrainer every Ray Train scenario fits (the same RunConfig name and storage path
    in a run dir: a second fit of them resumes the first's newest checkpoint)."""
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Workers cannot import benchmarks/_torchrun_ddp.py (or this module) by name: shipped with the function.
    ray.cloudpickle.register_pickle_by_value(baseline)
    ray.cloudpickle.register_pickle_by_value(sys.modules[_ray_train_loop.__module__])
    config = {"spec": spec, "events": events, "pid_dir": pid_dir}
    if hang_marker:
        config.update(hang_marker=hang_marker, hang_step=hang_step)
    return TorchTrainer(
        _ray_train_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo", timeout_s=timeout_s),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="recovery", storage_path=os.path.join(run_dir, "storage"),
                             failure_config=FailureConfig(max_failures=3),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )


def run_ray_train_driver_kill(spec: JobSpec, at_step: int, work_dir: str) -> dict:
    """TorchTrainer.fit()'s driver process SIGKILLed a moment after rank 0 reports step
    ``at_step``; the same trainer (RunConfig name and storage path) fitted again at once."""
    run_dir = os.path.join(work_dir, f"ray-train-{uuid.uuid4().hex[:6]}")
    pid_dir = os.path.join(run_dir, "pids")
    os.makedirs(pid_dir)
    events = os.path.join(run_dir, "events.jsonl")
    Path(events).touch()
    args_path = os.path.join(run_dir, "trainer.json")
    Path(args_path).write_text(json.dumps({"spec": spec.to_dict(), "run_dir": run_dir, "events": events,
                                           "pid_dir": pid_dir}))

    def read_events() -> list[dict]:
        with open(events) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    t0 = time.perf_counter()
    log_path = os.path.join(run_dir, "driver.log")
    driver = _child(RAY_TRAIN_DRIVER, args_path, str(HERE), log_path=log_path)
    try:
        while not any(e["event"] == "step" and e["step"] == at_step for e in read_events()):
            if driver.poll() is not None:
                raise RuntimeError(f"Ray Train's driver ended before step {at_step}: see {log_path}")
            time.sleep(0.005)
        time.sleep(0.02)
        t_kill = time.time()
        driver.kill()
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=60)
    again = _child(RAY_TRAIN_DRIVER, args_path, str(HERE), log_path=log_path)
    if again.wait(timeout=1800) != 0:
        raise RuntimeError(f"Ray Train's second fit failed: see {log_path}")
    wall = time.perf_counter() - t0
    ev = read_events()
    steps = [e for e in ev if e["event"] == "step"]
    done_before = max(e["step"] for e in steps if e["t"] <= t_kill)
    after = [e for e in steps if e["t"] > t_kill and e["attempt"] != steps[0]["attempt"]]
    nxt = after[0]
    restart = next(e for e in ev if e["event"] == "start" and e["t"] > t_kill)
    step_ts = [e["t"] for e in steps if e["attempt"] == steps[0]["attempt"]][:at_step]
    gaps = [b - a for a, b in zip(step_ts, step_ts[1:])]
    reported = [e["step"] for e in ev if e["event"] == "reported" and e["t"] <= t_kill]
    return {
        "framework": "ray-train", "fault": "supervisor-kill", "fault_after_step": at_step,
        "newest_checkpoint_reported_before_kill": max(reported, default=0),
        "recovery_s": nxt["t"] - t_kill, "steps_redone": done_before - (nxt["step"] - 1),
        "regain_s": next(e for e in after if e["step"] >= done_before + 1)["t"] - t_kill,
        "next_step": nxt["step"], "resumed_from_step": nxt["step"] - 1, "restart_s": restart["t"] - t_kill,
        "first_step_s": nxt["t"] - restart["t"], "step_time_median_s": statistics.median(gaps[2:] or gaps),
        "wall_s": wall, "fault_unix_s": t_kill, "events": ev,
    }


def run_ray_train(spec: JobSpec, at_step: int, work_dir: str, hang_marker: str = "",
                  timeout_s: float = 1800.0) -> dict:
    """Ray Train under the same fault: a kill of rank 1 a moment after rank 0 reports step
    ``at_step``, or (``hang_marker``) rank 1's loss of step ``at_step + 1`` never returning, its
    TorchConfig(timeout_s=``timeout_s``) deciding."""
    run_dir = os.path.join(work_dir, f"ray-train-{uuid.uuid4().hex[:6]}")
    pid_dir = os.path.join(run_dir, "pids")
    os.makedirs(pid_dir)
    events = os.path.join(run_dir, "events.jsonl")
    Path(events).touch()
    fault_at: dict = {}
    stop = threading.Event()

    def read_events() -> list[dict]:
        with open(events) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def killer() -> None:
        """Kill rank 1 a moment after rank 0 reports step ``at_step``, as for raytrain-sys."""
        while not stop.is_set() and not hang_marker:
            if any(e["event"] == "step" and e["step"] == at_step for e in read_events()):
                time.sleep(0.02)
                pid = int(Path(pid_dir, "rank1.pid").read_text())
                fault_at["t"] = time.time()
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    trainer = ray_train_trainer(spec.to_dict(), run_dir, events, pid_dir, hang_marker, at_step + 1, timeout_s)
    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    try:
        result = trainer.fit()
    finally:
        stop.set()
    wall = time.perf_counter() - t0
    if result.error:
        raise RuntimeError(f"Ray Train run failed: {result.error}")
    ev = read_events()
    t_kill = float(Path(hang_marker).read_text()) if hang_marker else fault_at["t"]
    steps = [e for e in ev if e["event"] == "step"]
    first_attempt = steps[0]["attempt"]
    if hang_marker:  # rank 0 may still finish the step before the hung one after the hang began
        done_before = max(e["step"] for e in steps if e["attempt"] == first_attempt)
        after = [e for e in steps if e["t"] > t_kill and e["attempt"] != first_attempt]
    else:
        done_before = max(e["step"] for e in steps if e["t"] <= t_kill)
        after = [e for e in steps if e["t"] > t_kill]
    nxt = after[0]
    resumed_from = nxt["step"] - 1
    restart = next(e for e in ev if e["event"] == "start" and e["t"] > t_kill)
    regain = next(e for e in after if e["step"] >= done_before + 1)
    step_ts = [e["t"] for e in steps if e["attempt"] == first_attempt][:at_step]
    gaps = [b - a for a, b in zip(step_ts, step_ts[1:])]
    reported = [e["step"] for e in ev if e["event"] == "reported" and e["t"] <= t_kill]
    return {
        "framework": "ray-train", "fault": "hang" if hang_marker else "worker-kill", "fault_after_step": at_step,
        "timeout_s": timeout_s,
        # Ray Train v2 registers a reported checkpoint asynchronously: a kill soon after the
        # report can restart from an older one (or from scratch).
        "newest_checkpoint_reported_before_kill": max(reported, default=0),
        "recovery_s": nxt["t"] - t_kill, "steps_redone": done_before - resumed_from,
        "regain_s": regain["t"] - t_kill, "next_step": nxt["step"],
        "resumed_from_step": resumed_from, "restart_s": restart["t"] - t_kill,
        "first_step_s": nxt["t"] - restart["t"],
        "attempts": len({e["attempt"] for e in ev}),
        "step_time_median_s": statistics.median(gaps[2:] or gaps),
        "wall_s": wall, "fault_unix_s": t_kill, "events": ev,
    }


# ----------------------------------------------------------------------------- report

LABELS = {"worker-kill": "worker kill (SIGKILL)", "node-loss": "node loss (remove_node)",
          "drain": "drain (PREEMPTION)", "hang": "hang (stuck in the loss)",
          "supervisor-kill": "supervisor kill (SIGKILL)"}


def label(r: dict) -> str:
    if r["fault"] == "drain":
        return f"drain, lease {r['lease_steps'] or 'auto'}"
    return LABELS[r["fault"]]


def detail(r: dict) -> str:
    if r["fault"] == "supervisor-kill" and r["framework"] == "raytrain-sys":
        return (f"adopted after {r['adopted_s']:.2f} at step {r['adopted_at_step']} ({r['steps_trained_with_no_driver']} "
                f"steps trained with no driver) + first step {r['first_step_s']:.2f}")
    if r["fault"] == "supervisor-kill":
        return (f"second fit {r['restart_s']:.1f} + first step {r['first_step_s']:.1f}; resumed from step "
                f"{r['resumed_from_step']} (newest checkpoint reported: step {r['newest_checkpoint_reported_before_kill']})")
    if r["framework"] == "ray-train":
        timeout = f"TorchConfig(timeout_s={r['timeout_s']:g}); " if r["fault"] == "hang" else ""
        return (f"{timeout}restart {r['restart_s']:.1f} + first step {r['first_step_s']:.1f}; resumed "
                f"from step {r['resumed_from_step']} (newest checkpoint reported: step "
                f"{r['newest_checkpoint_reported_before_kill']})")
    joined = (f"; replacement in after {r['replacement_joined_after_s']:.1f}, join stall "
              f"{r['join_stall_s']:.2f}" if r.get("join_stall_s") is not None else "")
    left = (f"node left {r['node_left_s']:.2f} s (step {r['node_left_at_step']}, {r['leases']} leases); "
            if r.get("node_left_s") is not None else "")
    hung = (f"deadline {r['deadline_s']:.1f}, named rank {r['named_rank']} at {r['top_frame']['function']}; "
            if r.get("deadline_s") is not None else "")
    return (f"{hung}{left}detect {r['detect_s']:.2f} + decide {r['decide_s']:.2f} + re-form "
            f"{r['reform_s']:.2f} + step {r['first_step_s']:.2f}{joined}")


def print_table(rows: list[dict], spec: JobSpec) -> None:
    print()
    print(f"model {spec.model.n_layer}L/{spec.model.n_head}H/{spec.model.n_embd}d block "
          f"{spec.model.block_size}, global batch {spec.train.global_batch_size}, 2 workers x 1 CPU, "
          f"{spec.train.max_steps} steps, checkpoint every {spec.checkpoint.every_steps}, fault "
          f"after step {rows[0]['fault_after_step']}")
    header = (f"{'scenario':<25}{'framework':<14}{'step s':>8}{'recovery s':>12}{'redone':>8}"
              f"{'regain s':>10}  breakdown (s)")
    print(header)
    print("-" * (len(header) + 40))
    for r in rows:
        print(f"{label(r):<25}{r['framework']:<14}{r['step_time_median_s']:>8.2f}"
              f"{r['recovery_s']:>12.2f}{r['steps_redone']:>8d}{r['regain_s']:>10.2f}  {detail(r)}")


def goals(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        if r["framework"] != "raytrain-sys":
            continue
        if r["fault"] == "worker-kill":
            limit = 2 * r["step_time_median_s"] + 2.0
        elif r["fault"] == "hang":  # issue 59: its deadline + 2 s + 2 steps, and 10 s at the default deadline
            limit = r["deadline_s"] + 2.0 + 2 * r["step_time_median_s"] if r["deadline_s"] else 0.0
            limit = min(limit, 10.0) if r["default_deadline"] else limit
        elif r["fault"] == "node-loss":
            limit = 5.0
        elif r["fault"] == "supervisor-kill":  # issue 57: no time goal on a CLI resume, 0 redone
            limit = None
        else:  # issue 26: the notice to the node left, at every lease length
            limit = r["step_time_median_s"] + 1.0
            out[label(r)] = {"node_left_s": r["node_left_s"], "limit_s": limit,
                             "met": r["node_left_s"] <= limit and r["steps_redone"] == 0}
            continue
        out[r["fault"]] = {"recovery_s": r["recovery_s"], "limit_s": limit,
                           "met": (limit is None or r["recovery_s"] <= limit) and r["steps_redone"] == 0}
    return out


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Recovery after a killed worker, a lost node and a "
                                            "drain: raytrain-sys vs Ray Train, same model and fault.")
    p.add_argument("--quick", action="store_true", help="the CI-sized model (a smoke test)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--fault-step", type=int, default=15,
                   help="the fault comes as rank 0 finishes this step (default 15)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="checkpoint every K steps, both frameworks (default 10)")
    p.add_argument("--drain-poll-s", type=float, default=0.25,
                   help="elastic.drain_poll_s of the raytrain-sys runs (default 0.25)")
    p.add_argument("--drain-leases", default="0",
                   help="comma list of lease lengths (train.steps_per_call; 0: automatic) for the drain "
                        "scenario, one run each (default 0)")
    p.add_argument("--scenarios", default="", help=f"comma list of {', '.join(SCENARIOS)} (default: "
                                                  f"{', '.join(DEFAULT_SCENARIOS)})")
    p.add_argument("--sections", default="", help=f"comma list of {', '.join(SECTIONS)}: each kind's scenarios, "
                                                 f"with Ray Train's where there is one (adds to --scenarios)")
    p.add_argument("--ray-train-timeout-s", type=float, default=60.0,
                   help="TorchConfig(timeout_s) of Ray Train's hang run: what finds the hang there (default 60; "
                        "Ray's own default is 1800)")
    p.add_argument("--data", default="", help="an existing dataset dir (row_len = block_size + 1)")
    p.add_argument("--out", default=str(HERE / "results" / "recovery.json"))
    p.add_argument("--keep-temp", action="store_true", help="keep the temp dir (data, run dirs)")
    p.add_argument("--verbose", action="store_true", help="INFO logs and the workers' output")
    args = p.parse_args(argv)
    picked = common.pick(p, args.scenarios, SCENARIOS, "--scenarios")
    for section in common.pick(p, args.sections, list(SECTIONS), "--sections"):
        picked += [s for s in SECTIONS[section] if s not in picked]
    args.scenarios = [s for s in SCENARIOS if s in picked] if picked else list(DEFAULT_SCENARIOS)
    try:
        args.drain_leases = [int(v) for v in args.drain_leases.split(",")]
    except ValueError:
        p.error(f"--drain-leases: a comma list of whole numbers, got {args.drain_leases!r}")
    if any(v < 0 for v in args.drain_leases):
        p.error(f"--drain-leases: lease lengths are 0 (automatic) or more, got {args.drain_leases}")
    if not 2 < args.fault_step < args.steps - 2:
        p.error(f"--fault-step must leave steps before and after it (got {args.fault_step} of {args.steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = common.start(args.verbose, log, "rts-rb-")
    rows: list[dict] = []
    cluster = None
    load0 = os.getloadavg()
    try:
        block = QUICK_MODEL["block_size"] if args.quick else yaml.safe_load(
            (REPO / "jobs" / "tinygpt.yaml").read_text())["model"]["block_size"]
        data_dir = args.data
        if not data_dir:
            from raytrain_sys.data.prepare import prepare_text_dataset

            data_dir = os.path.join(work_dir, "data")
            prepare_text_dataset(data_dir, row_len=block + 1, rows_per_shard=1024, max_bytes=1_000_000)
        cluster = start_cluster(work_dir, args.verbose)
        runs = [(s, lease) for s in args.scenarios for lease in (args.drain_leases if s == "drain" else [0])]
        for scenario, lease in runs:
            name = f"drain-{lease}" if scenario == "drain" else scenario
            marker = os.path.join(work_dir, HANG_MARKER.format(name=name)) if scenario.endswith("hang") else ""
            spec = make_spec(args, data_dir, work_dir, name, lease, hang_marker=marker if scenario == "hang" else "")
            log.info("%s: %d steps, fault after step %d, leases of %s", scenario, args.steps,
                     args.fault_step, lease or "auto")
            if scenario == "supervisor-kill":
                rows.append(run_supervisor_kill(spec, args.fault_step, work_dir))
            elif scenario == "ray-train-supervisor-kill":
                rows.append(run_ray_train_driver_kill(spec, args.fault_step, work_dir))
            elif scenario.startswith("ray-train-"):
                rows.append(run_ray_train(spec, args.fault_step, work_dir, marker, args.ray_train_timeout_s)
                            if marker else run_ray_train(spec, args.fault_step, work_dir))
            else:
                rows.append(run_raytrain_sys(spec, scenario, args.fault_step, cluster, marker))
                rows[-1]["default_deadline"] = spec.elastic.hang_floor_s == ElasticSpec().hang_floor_s
            restore_nodes(cluster)
    finally:
        import ray

        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if not args.keep_temp:
            shutil.rmtree(work_dir, ignore_errors=True)

    print_table(rows, spec)
    ours = next((r for r in rows if r["framework"] == "raytrain-sys" and r["fault"] == "worker-kill"), None)
    theirs = next((r for r in rows if r["framework"] == "ray-train" and r["fault"] == "worker-kill"), None)
    ratio = theirs["recovery_s"] / ours["recovery_s"] if ours and theirs else None
    ours_hang = next((r for r in rows if r["framework"] == "raytrain-sys" and r["fault"] == "hang"), None)
    theirs_hang = next((r for r in rows if r["framework"] == "ray-train" and r["fault"] == "hang"), None)
    hang_ratio = theirs_hang["recovery_s"] / ours_hang["recovery_s"] if ours_hang and theirs_hang else None
    ours_sk = next((r for r in rows if r["framework"] == "raytrain-sys" and r["fault"] == "supervisor-kill"), None)
    theirs_sk = next((r for r in rows if r["framework"] == "ray-train" and r["fault"] == "supervisor-kill"), None)
    sk_ratio = theirs_sk["regain_s"] / ours_sk["regain_s"] if ours_sk and theirs_sk else None
    met = goals(rows)
    import ray
    import torch

    report = {
        "benchmark": "recovery",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "versions": {"ray": ray.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "machine": {"cpu_count": os.cpu_count(), "loadavg_before": load0, "loadavg_at_end": os.getloadavg()},
        "config": {"steps": args.steps, "fault_after_step": args.fault_step, "scenarios": args.scenarios,
                   "checkpoint_every": args.checkpoint_every, "workers": 2, "cpus_per_worker": 1,
                   "worker_nodes": WORKER_NODES, "model": spec.to_dict()["model"],
                   "global_batch_size": spec.train.global_batch_size},
        "results": rows,
        "ratio_recovery_ray_train_over_raytrain_sys": ratio,
        "ratio_hang_ray_train_over_raytrain_sys": hang_ratio,
        "ratio_supervisor_kill_regain_ray_train_over_raytrain_sys": sk_ratio,
        "goals": met,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if ratio:
        print(f"worker kill, seconds to the next committed step: ray-train / raytrain-sys = {ratio:.1f}x")
    if hang_ratio:
        print(f"hang, seconds to the next committed step: ray-train / raytrain-sys = {hang_ratio:.1f}x "
              f"(Ray Train's TorchConfig(timeout_s={args.ray_train_timeout_s:g}))")
    if sk_ratio:
        print(f"supervisor kill, seconds until the step running at the kill is done again: ray-train / "
              f"raytrain-sys = {sk_ratio:.1f}x")
    for fault, g in met.items():
        limit = f"<= {g['limit_s']:.2f} s" if g["limit_s"] is not None else "no time goal"
        what = (f"notice to node left {g['node_left_s']:.2f} s" if "node_left_s" in g
                else f"{g['recovery_s']:.2f} s")
        print(f"goal {fault}: {what} ({limit}), 0 redone: {'met' if g['met'] else 'MISSED'}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
