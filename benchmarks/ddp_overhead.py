"""What raytrain-sys costs per step, against plain torchrun DDP and Ray Train's TorchTrainer.

One invocation runs the same model, data, global batch and step count three ways and prints
steady-state tokens/s for each:

  torchrun      python -m torch.distributed.run --standalone, gloo; every rank reads its share of
                each global batch from the Parquet shards itself (benchmarks/_torchrun_ddp.py).
                The "no framework" floor.
  raytrain-sys  run_job(spec): Ray actors, the Supervisor's per-step dispatch and commit, the
                Ray Data plane; step times from StepReport.step_time_s.
  raytrain-sys-no-metrics
                the same with tracking.metrics false: no Prometheus series. raytrain-sys over it is
                what the metrics cost (the target: at most 1% of step time, a ratio of 0.99 or more).
  ray-train     ray.train.torch.TorchTrainer (Ray Train v2 in Ray 2.60) with prepare_model, the
                same step code and the same per-rank reader as torchrun, inside the train loop.
  torchrun-ray-idle
                torchrun again, while the Ray session the two Ray variants ran in is still up and
                idle (its daemons, Ray Data's actors, idle worker processes). The control: what Ray's
                mere presence costs plain DDP, so that raytrain-sys's own overhead can be told from it.
  metrics-interleaved
                (only when named in --variants) one raytrain-sys run whose metrics are switched off
                and on every --metrics-window steps: the metrics' cost from windows seconds apart,
                finer than runs minutes apart can resolve on a shared machine, and the step loop's
                own time in the metrics calls (RunMetrics.spent_s) as a share of step time.

Steady state skips the first ``--skip-steps`` steps of each (process group warm-up, allocator
growth); worker startup, Ray Train's controller and placement are outside the measured steps for
all three, and reported separately as end-to-end wall time. Each variant starts once the machine
is quiet (under 15% CPU for a second): a just-started Ray keeps a core busy for seconds, which
would otherwise land on whichever variant runs first after it. tokens/s = global_batch * block_size
* steps / (sum of their step wall times), the formula the Supervisor uses for its own reports.

    .venv/bin/python benchmarks/ddp_overhead.py --quick          # smoke test, about a minute
    .venv/bin/python benchmarks/ddp_overhead.py                  # default job, 60 steps each
    .venv/bin/python benchmarks/ddp_overhead.py --repeats 5      # 5 rounds: a noisy machine
    .venv/bin/python benchmarks/ddp_overhead.py --variants raytrain-sys,raytrain-sys-no-metrics --repeats 5
                                                                 # the metrics' cost alone
    .venv/bin/python benchmarks/ddp_overhead.py --variants metrics-interleaved --steps 1000 \
        --out benchmarks/results/ddp_overhead_metrics_interleaved.json   # the same, within one run

With --repeats N the variants run in N rounds, each round in the reverse order of the one before.
Two ratios are printed: best run against best run, and the median over rounds of the ratio
within a round (the variants of a round run minutes apart, so the machine's drift between rounds
cancels out; this is the figure to quote).

Results go to benchmarks/results/ddp_overhead.json (``"quick": true`` marks a smoke test's; pass
``--out`` to keep real figures from being overwritten).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402
import _torchrun_ddp as baseline  # noqa: E402  (the shared step code of torchrun and ray-train)
import yaml  # noqa: E402

from raytrain_sys.spec import JobSpec, from_dict  # noqa: E402

# Ray 2.60 defaults to Train v2 already; pin it so the figures always name the same controller.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

VARIANTS = ("torchrun", "raytrain-sys", "raytrain-sys-no-metrics", "ray-train", "torchrun-ray-idle",
            "metrics-interleaved")
DEFAULT_VARIANTS = VARIANTS[:5]  # metrics-interleaved: asked for by name
# --quick: the CI-sized model of tests/helpers.tiny_spec.
QUICK_MODEL = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
QUICK_BATCH = 8
QUICK_WINDOW = 256

log = logging.getLogger("ddp_overhead")


# ----------------------------------------------------------------------------- setup

def make_spec(args: argparse.Namespace, data_dir: str, work_dir: str) -> JobSpec:
    """The default job (jobs/tinygpt.yaml), or the tiny one with --quick, sized for a benchmark."""
    with open(REPO / "jobs" / "tinygpt.yaml") as f:
        raw = yaml.safe_load(f)
    if args.quick:
        raw["model"].update(QUICK_MODEL)
        raw["train"]["global_batch_size"] = QUICK_BATCH
        raw["data"]["shuffle_window"] = QUICK_WINDOW
    raw["name"] = "ddp-overhead"
    raw["output_dir"] = os.path.join(work_dir, "runs")
    raw["data"]["path"] = data_dir
    raw["train"]["max_steps"] = args.steps
    raw["optim"]["warmup_steps"] = min(raw["optim"].get("warmup_steps", 20), args.steps)
    # The steps are what is measured: no checkpoint in the loop or after it, no MLflow unless asked.
    raw["checkpoint"] = {"every_steps": 0, "save_on_exit": False}
    raw["tracking"] = {**raw.get("tracking", {}), "enabled": bool(args.tracking)}
    raw["resources"] = {**raw.get("resources", {}), "num_workers": args.workers,
                        "cpus_per_worker": args.cpus_per_worker}
    return from_dict(raw)


def without_metrics(spec: JobSpec) -> JobSpec:
    """The same job with no Prometheus series (tracking.metrics false)."""
    return dataclasses.replace(spec, tracking=dataclasses.replace(spec.tracking, metrics=False))


def prepare_data(args: argparse.Namespace, row_len: int, work_dir: str) -> str:
    if args.data:
        return args.data
    from raytrain_sys.data.prepare import prepare_text_dataset

    out = os.path.join(work_dir, "data")
    t0 = time.perf_counter()
    if args.quick:
        prepare_text_dataset(out, row_len=row_len, rows_per_shard=512, max_bytes=400_000)
    else:
        prepare_text_dataset(out, row_len=row_len, max_bytes=args.data_bytes)
    log.info("dataset prepared in %.1f s at %s", time.perf_counter() - t0, out)
    return out


def summarize(step_times: list[float], losses: list[float], spec: JobSpec, skip: int,
              wall_s: float, load: tuple, **extra) -> dict:
    tokens_per_step = spec.train.global_batch_size * spec.model.block_size
    steady = step_times[skip:] if len(step_times) > skip else step_times
    return {
        "steps": len(step_times),
        "steady_steps": len(steady),
        "step_time_mean_s": statistics.fmean(steady),
        "step_time_median_s": statistics.median(steady),
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
        "tokens_per_s_median": tokens_per_step / statistics.median(steady),
        "wall_s": wall_s,  # end to end, startup included
        "loadavg_1m_before_after": [load[0], os.getloadavg()[0]],
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "step_times_s": step_times,
        "losses": losses,
        **extra,
    }


# ----------------------------------------------------------------------------- (a) torchrun

def run_torchrun(spec: JobSpec, args: argparse.Namespace, work_dir: str) -> dict:
    spec_path = os.path.join(work_dir, "spec.json")
    out_path = os.path.join(work_dir, "torchrun-result.json")
    with open(spec_path, "w") as f:
        json.dump(spec.to_dict(), f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.workers}", str(HERE / "_torchrun_ddp.py"),
           "--spec-json", spec_path, "--out", out_path]
    # torchrun would set OMP_NUM_THREADS=1 itself (with a warning); give it the worker's CPUs.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, int(args.cpus_per_worker)))}
    # A rank of plain torchrun has aborted on these machines ("terminate called without an
    # active exception", SIGABRT: seen on 2026-11-27 and 2026-12-05), and with it the whole
    # invocation's rounds were lost: a failed baseline runs once more; a second failure raises.
    for attempt in (1, 2):
        load, t0 = os.getloadavg(), time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=not args.verbose, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode == 0:
            break
        tail = (proc.stderr or "")[-4000:] if not args.verbose else ""
        if attempt == 2:
            raise RuntimeError(f"torchrun baseline failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        log.warning("torchrun baseline failed (exit %d), running it again:\n%s", proc.returncode, tail[-600:])
    with open(out_path) as f:
        res = json.load(f)
    return summarize(res["step_times_s"], res["losses"], spec, args.skip_steps, wall, load,
                     threads=res["threads"])


# ----------------------------------------------------------------------------- (b) raytrain-sys

def run_raytrain_sys(spec: JobSpec, args: argparse.Namespace) -> dict:
    from raytrain_sys.control.supervisor import StepReport, run_job

    step_times: list[float] = []

    def on_step(report: StepReport) -> None:
        step_times.append(report.step_time_s)

    load, t0 = os.getloadavg(), time.perf_counter()
    result = run_job(spec, on_step=on_step)
    wall = time.perf_counter() - t0
    if result.status != "finished":
        raise RuntimeError(f"raytrain-sys run ended {result.status}: {result.reason}")
    return summarize(step_times, result.losses, spec, args.skip_steps, wall, load)


def run_metrics_interleaved(spec: JobSpec, args: argparse.Namespace) -> dict:
    """One raytrain-sys run whose metrics are off and on in turn, ``--metrics-window`` steps
    each (the step loop's ``RunMetrics.enabled``): windows seconds apart see the same machine, so
    the cost of metrics shows at a resolution rounds minutes apart cannot give on a shared
    machine. Each window's first 2 steps are left out (the step in flight when the switch
    flips belongs to neither). Reported: the mean step time of each pair of windows (off, then
    on) and the median of their ratios on/off; and ``RunMetrics.spent_s``, the step loop's own
    time in the metrics calls, over the on windows' steps. Ray's agent exports the series
    registered so far in both kinds of window: the exporter's own cost is in neither figure
    (the raytrain-sys vs raytrain-sys-no-metrics runs hold it)."""
    from raytrain_sys.control.supervisor import StepReport, Supervisor

    window = args.metrics_window
    step_times: list[float] = []
    windows: list[tuple[bool, list[float]]] = []  # (metrics on, the window's step times)
    sup: Supervisor

    def on_step(report: StepReport) -> None:
        step_times.append(report.step_time_s)
        if report.step <= args.skip_steps:
            return
        index = (report.step - args.skip_steps - 1) // window
        on = index % 2 == 1
        if len(windows) <= index:
            windows.append((on, []))
        if (report.step - args.skip_steps - 1) % window >= 2:
            windows[index][1].append(report.step_time_s)
        # the switch for the next step: the window it falls in
        sup.metrics.enabled = ((report.step - args.skip_steps) // window) % 2 == 1

    sup = Supervisor(spec, on_step=on_step)
    sup.metrics.enabled = False  # warm-up and the first window: off
    spent_at_start = sup.metrics.spent_s
    load, t0 = os.getloadavg(), time.perf_counter()
    result = sup.run()
    wall = time.perf_counter() - t0
    if result.status != "finished":
        raise RuntimeError(f"raytrain-sys run ended {result.status}: {result.reason}")
    pairs = []
    for off, on in zip(windows[0::2], windows[1::2]):
        if off[1] and on[1]:
            pairs.append({"off_mean_s": statistics.fmean(off[1]), "on_mean_s": statistics.fmean(on[1])})
    ratios_on_off = [p["on_mean_s"] / p["off_mean_s"] for p in pairs]
    on_steps = sum(len(w) for flag, w in windows if flag)
    on_time = sum(sum(w) for flag, w in windows if flag)
    interleaved = {
        "window_steps": window, "pairs": pairs,
        "ratio_on_off_per_pair": ratios_on_off,
        "ratio_on_off_median": statistics.median(ratios_on_off) if ratios_on_off else float("nan"),
        "metrics_spent_s": sup.metrics.spent_s - spent_at_start,
        "metrics_spent_fraction_of_on_steps": (sup.metrics.spent_s - spent_at_start) / on_time if on_time else float("nan"),
        "on_steps": on_steps,
    }
    return summarize(step_times, result.losses, spec, args.skip_steps, wall, load, interleaved=interleaved)


# ----------------------------------------------------------------------------- (c) Ray Train

def _ray_train_loop(config: dict) -> dict:
    """Ray Train's train_loop_per_worker: torchrun's step code, DDP from prepare_model."""
    import ray.train
    import ray.train.torch
    import torch

    spec = from_dict(config["spec"])
    torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model, optimizer = baseline.build(spec)
    ddp = ray.train.torch.prepare_model(model)  # DistributedDataParallel over Train's gloo group
    reader = baseline.ShareReader(spec.data, spec.train.global_batch_size, world, rank)
    torch.distributed.barrier()

    every = config["report_every"]

    def on_step(step: int, step_time_s: float) -> None:
        # ray.train.report is a barrier across workers; off by default so only DDP is measured.
        if every and (step + 1) % every == 0:
            ray.train.report({"step": step + 1, "step_time_s": step_time_s})

    result = baseline.run_steps(spec, model, ddp, optimizer, reader, rank, world, on_step)
    losses = baseline.global_losses(spec, result["loss_sums"])
    # Ray Train v2 hands rank 0's return value to the driver as Result.return_value.
    return {"step_times_s": result["step_times_s"], "losses": losses,
            "threads": torch.get_num_threads(), "rank": rank}


def run_ray_train(spec: JobSpec, args: argparse.Namespace, work_dir: str, repeat: int = 0) -> dict:
    import ray.cloudpickle
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Workers cannot import benchmarks/_torchrun_ddp.py by name (not a package on their path):
    # ship it by value with the train function.
    ray.cloudpickle.register_pickle_by_value(baseline)
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec.to_dict(), "report_every": args.report_every},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                     resources_per_worker={"CPU": args.cpus_per_worker}),
        run_config=RunConfig(name=f"ddp-overhead-{repeat}", storage_path=os.path.join(work_dir, "ray-train")),
    )
    load, t0 = os.getloadavg(), time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    res = result.return_value
    if not res:
        raise RuntimeError(f"Ray Train returned no timings (error: {result.error})")
    assert res["rank"] == 0, f"Result.return_value came from rank {res['rank']}"
    return summarize(res["step_times_s"], res["losses"], spec, args.skip_steps, wall, load,
                     threads=res["threads"], train_v2=_train_v2_enabled())


def _train_v2_enabled() -> bool:
    from ray.train.v2._internal.constants import is_v2_enabled

    return bool(is_v2_enabled())


# ----------------------------------------------------------------------------- report

def print_table(results: dict, spec: JobSpec) -> None:
    header = (f"{'variant':<25}{'steady steps':>13}{'step ms (mean)':>16}{'step ms (median)':>18}"
              f"{'tokens/s':>11}{'tokens/s (median)':>19}{'wall s':>9}{'last loss':>11}")
    print()
    print(f"model {spec.model.n_layer}L/{spec.model.n_head}H/{spec.model.n_embd}d block "
          f"{spec.model.block_size}, global batch {spec.train.global_batch_size}, "
          f"{spec.resources.num_workers} workers x {spec.resources.cpus_per_worker:g} CPU, "
          f"{spec.train.max_steps} steps")
    print(header)
    print("-" * len(header))
    for name in VARIANTS:
        r = results.get(name)
        if r is None:
            continue
        print(f"{name:<25}{r['steady_steps']:>13}{r['step_time_mean_s'] * 1e3:>16.1f}"
              f"{r['step_time_median_s'] * 1e3:>18.1f}{r['tokens_per_s']:>11.0f}"
              f"{r['tokens_per_s_median']:>19.0f}{r['wall_s']:>9.1f}{r['last_loss']:>11.4f}")


def _run_torchrun_logged(spec: JobSpec, args: argparse.Namespace, work_dir: str, repeat: int) -> dict:
    common.wait_until_quiet(log)
    log.info("[%d] (a) torchrun: %d steps", repeat, args.steps)
    return run_torchrun(spec, args, work_dir)


# (numerator, denominator) of the printed ratios: raytrain-sys against each reference, and what an
# idle Ray session beside it costs plain DDP.
RATIOS = (("raytrain-sys", "torchrun"), ("raytrain-sys", "ray-train"),
          ("raytrain-sys", "torchrun-ray-idle"), ("torchrun-ray-idle", "torchrun"),
          ("raytrain-sys", "raytrain-sys-no-metrics"))


def ratios(results: dict) -> dict:
    """The RATIOS of tokens/s, best run against best run."""
    return {f"{a}/{b}": results[a]["tokens_per_s"] / results[b]["tokens_per_s"]
            for a, b in RATIOS if a in results and b in results}


def round_ratios(results: dict) -> dict:
    """The same ratios within each round (variants run minutes apart at most), and their median:
    robust to the machine's drift between rounds, which best-of-N is not."""
    out = {}
    for a, b in RATIOS:
        per_round = [x / y for x, y in zip(results.get(a, {}).get("repeats_tokens_per_s", []),
                                           results.get(b, {}).get("repeats_tokens_per_s", []))]
        if per_round:
            out[f"{a}/{b}"] = {"per_round": per_round, "median": statistics.median(per_round)}
    return out


def runs_interleaved(results: dict) -> list[dict]:
    """The metrics-interleaved run's in-run figures, if it ran (its best round's)."""
    r = results.get("metrics-interleaved")
    return [r["interleaved"]] if r else []


def max_loss_diff(results: dict) -> dict:
    """The variants train the same numbers: their per-step losses agree to float rounding."""
    out = {}
    ref = results.get("torchrun")
    for name in VARIANTS:
        if ref and name != "torchrun" and name in results:
            a, b = ref["losses"], results[name]["losses"]
            out[f"{name} vs torchrun"] = max(abs(x - y) for x, y in zip(a, b))
    return out


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Steady-state step overhead: torchrun vs raytrain-sys "
                                            "vs Ray Train, same model, data and batches.")
    p.add_argument("--steps", type=int, default=None, help="steps per variant (default 60; 15 with --quick)")
    p.add_argument("--workers", type=int, default=2, help="data-parallel workers (default 2)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs (and torch threads) per worker")
    p.add_argument("--skip-steps", type=int, default=5, help="first steps left out of steady state")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps: a smoke test")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (default: all but metrics-interleaved)")
    p.add_argument("--metrics-window", type=int, default=20,
                   help="metrics-interleaved: steps per window, metrics off and on in turn (default 20)")
    p.add_argument("--data", default="", help="an existing dataset dir (row_len = block_size + 1); "
                                              "default: prepare one from the stdlib in a temp dir")
    p.add_argument("--data-bytes", type=int, default=4_000_000,
                   help="stdlib bytes to tokenize when preparing (default 4 MB, ~31k rows of 129)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the three variants this many times; each keeps its best (default 1)")
    p.add_argument("--tracking", action="store_true", help="keep MLflow tracking on in raytrain-sys")
    p.add_argument("--report-every", type=int, default=0,
                   help="call ray.train.report every N steps in Ray Train (0 = never, default)")
    p.add_argument("--out", default=str(HERE / "results" / "ddp_overhead.json"),
                   help="JSON results path (default benchmarks/results/ddp_overhead.json)")
    p.add_argument("--keep-temp", action="store_true", help="keep the temp dir (data, run dirs)")
    p.add_argument("--verbose", action="store_true", help="INFO logs and the workers' output")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 15 if args.quick else 60
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.steps <= args.skip_steps:
        p.error(f"--steps ({args.steps}) must exceed --skip-steps ({args.skip_steps})")
    args.variants = common.pick(p, args.variants, VARIANTS, "--variants")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = common.start(args.verbose, log, "rts-ddpb-")
    results: dict = {}
    try:
        model_block = QUICK_MODEL["block_size"] if args.quick else yaml.safe_load(
            (REPO / "jobs" / "tinygpt.yaml").read_text())["model"]["block_size"]
        data_dir = prepare_data(args, model_block + 1, work_dir)
        spec = make_spec(args, data_dir, work_dir)

        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for repeat in range(args.repeats):
            # The machine's speed drifts over minutes (other tenants, thermal): each round runs
            # every variant back to back, in the reverse order of the round before, so that no
            # variant always runs first or last. torchrun runs outside Ray: it pays no idle Ray
            # daemons.
            forward = repeat % 2 == 0
            ray_variants = [v for v in ("raytrain-sys", "raytrain-sys-no-metrics", "ray-train", "metrics-interleaved")
                            if v in args.variants]
            if not forward:
                ray_variants.reverse()
            if "torchrun-ray-idle" in args.variants:
                # Last in the session, when the Ray variants have left what a run leaves idle.
                ray_variants.append("torchrun-ray-idle")
            if forward and "torchrun" in args.variants:
                runs["torchrun"].append(_run_torchrun_logged(spec, args, work_dir, repeat))
            if ray_variants:
                import ray

                ray.init(address="local", num_cpus=math.ceil(args.workers * args.cpus_per_worker) + 1,
                         include_dashboard=False, _temp_dir=os.path.join(work_dir, "ray"),
                         log_to_driver=args.verbose)
                try:
                    for name in ray_variants:
                        common.wait_until_quiet(log)
                        if name in ("raytrain-sys", "raytrain-sys-no-metrics"):
                            log.info("[%d] (b) %s: %d steps", repeat, name, args.steps)
                            runs[name].append(run_raytrain_sys(
                                spec if name == "raytrain-sys" else without_metrics(spec), args))
                        elif name == "metrics-interleaved":
                            log.info("[%d] (e) raytrain-sys, metrics off and on every %d steps: %d steps",
                                     repeat, args.metrics_window, args.steps)
                            runs[name].append(run_metrics_interleaved(spec, args))
                        elif name == "torchrun-ray-idle":
                            log.info("[%d] (d) torchrun beside the idle Ray session: %d steps",
                                     repeat, args.steps)
                            runs[name].append(run_torchrun(spec, args, work_dir))
                        else:
                            log.info("[%d] (c) Ray Train: %d steps", repeat, args.steps)
                            runs[name].append(run_ray_train(spec, args, work_dir, repeat))
                finally:
                    ray.shutdown()
            if not forward and "torchrun" in args.variants:
                runs["torchrun"].append(_run_torchrun_logged(spec, args, work_dir, repeat))
        # Best of the repeats: on a shared machine the least disturbed run is the one to compare.
        for name, rs in runs.items():
            best = max(rs, key=lambda r: r["tokens_per_s"])
            results[name] = {**best, "repeats_tokens_per_s": [r["tokens_per_s"] for r in rs]}
    finally:
        if not args.keep_temp:
            shutil.rmtree(work_dir, ignore_errors=True)

    print_table(results, spec)
    rat = ratios(results)
    by_round = round_ratios(results)
    diffs = max_loss_diff(results)
    import ray
    import torch

    report = {
        "benchmark": "ddp_overhead",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "versions": {"ray": ray.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "machine": {"cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "config": {"steps": args.steps, "skip_steps": args.skip_steps, "repeats": args.repeats,
                   "workers": args.workers,
                   "cpus_per_worker": args.cpus_per_worker, "tracking": args.tracking,
                   "report_every": args.report_every, "model": spec.to_dict()["model"],
                   "global_batch_size": spec.train.global_batch_size,
                   "shuffle_window": spec.data.shuffle_window},
        "results": results,
        "ratios_tokens_per_s": rat,
        "ratios_within_rounds": by_round,
        "max_abs_loss_diff": diffs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if diffs:
        print("max |loss - torchrun loss| per step: "
              + "  ".join(f"{k}: {v:.2e}" for k, v in diffs.items()))
    print(f"results: {args.out}")
    print("ratio (best run of each) " + "  ".join(f"{k} = {v:.2f}x" for k, v in rat.items()))
    for r in runs_interleaved(results):
        print(f"metrics on/off within one run ({len(r['pairs'])} pairs of {r['window_steps']}-step windows): "
              f"{r['ratio_on_off_median']:.4f}x median [{' '.join(f'{x:.3f}' for x in r['ratio_on_off_per_pair'])}]; "
              f"the step loop's time in metrics calls: {r['metrics_spent_s'] * 1e3:.1f} ms over {r['on_steps']} "
              f"steps, {r['metrics_spent_fraction_of_on_steps'] * 100:.3f}% of their step time")
    if args.repeats > 1:
        print("ratio (median of rounds) " + "  ".join(
            f"{k} = {v['median']:.2f}x [{' '.join(f'{x:.2f}' for x in v['per_round'])}]"
            for k, v in by_round.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
