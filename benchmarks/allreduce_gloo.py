"""Gloo all-reduce time against message size on this machine, and the latency + bandwidth fit.

A check of the all-reduce cost model of ``scaling_model.py`` (docs/SCALING.md) where it can be
checked here: P processes (2 by default, one per core) on one machine, torch.distributed with
gloo over TCP loopback, float32 tensors from 4 bytes to 64 MiB. Per size the median of
``--repeats`` timed all-reduces (after warm-up), the time of the slowest rank each time. Then a
weighted least-squares fit of the ring model

    t(bytes) = 2(P-1) * latency + 2(P-1)/P * bytes / busbw

(weights 1/t, so small and large messages count alike) and each size's measured / model ratio.
No Ray. Results go to benchmarks/results/allreduce_gloo.json, which scaling_model.py reads.

    .venv/bin/python benchmarks/allreduce_gloo.py             # ~1 min on 2 cores
    .venv/bin/python benchmarks/allreduce_gloo.py --quick     # sizes up to 4 MiB, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32)
        for _ in range(3):  # warm-up: connections, buffers
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
            times.append(dt.item())
        results[size] = times
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def fit_ring(points: list[tuple[int, float]], p: int) -> dict:
    """Weighted least squares of t = A + B*bytes (weights 1/t), then latency = A / 2(p-1) and
    busbw = 2(p-1)/p / B."""
    w = [1.0 / t ** 2 for _, t in points]  # squared relative error
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    sxy = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points))
    b = sxy / sxx
    a = my - b * mx
    return {"A_s": a, "B_s_per_byte": b, "latency_s": a / (2 * (p - 1)),
            "busbw_bytes_per_s": 2 * (p - 1) / p / b}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=0, help="timed all-reduces per size (default 30; --quick 10)")
    p.add_argument("--max-mib", type=int, default=0, help="largest message (default 64; --quick 4)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(HERE / "results" / "allreduce_gloo.json"))
    args = p.parse_args()
    repeats = args.repeats or (10 if args.quick else 30)
    max_bytes = (args.max_mib or (4 if args.quick else 64)) << 20
    sizes, s = [], 4
    while s <= max_bytes:
        sizes.append(s)
        s *= 4

    import tempfile

    import torch.multiprocessing as mp

    raw_path = os.path.join(tempfile.mkdtemp(prefix="ar-", dir="/tmp"), "raw.json")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    mp.start_processes(worker, args=(args.procs, free_port(), sizes, repeats, raw_path),
                       nprocs=args.procs, start_method="spawn")
    wall = time.perf_counter() - t0
    with open(raw_path) as f:
        raw = {int(k): v for k, v in json.load(f).items()}
    shutil.rmtree(os.path.dirname(raw_path), ignore_errors=True)
    med = [(size, statistics.median(raw[size])) for size in sizes]
    fit = fit_ring(med, args.procs)
    rows = []
    print(f"gloo all-reduce, {args.procs} processes on this machine ({os.cpu_count()} cores), "
          f"median of {repeats}")
    print(f"{'bytes':>10}  {'measured ms':>11}  {'model ms':>8}  {'measured/model':>14}  {'algbw MB/s':>10}")
    for size, t in med:
        model = fit["A_s"] + fit["B_s_per_byte"] * size
        rows.append({"bytes": size, "median_s": t, "p90_s": sorted(raw[size])[int(0.9 * len(raw[size])) - 1],
                     "model_s": model, "ratio": t / model})
        print(f"{size:>10}  {t * 1e3:>11.3f}  {model * 1e3:>8.3f}  {t / model:>14.2f}  {size / t / 1e6:>10.1f}")
    worst = max(max(r["ratio"], 1 / r["ratio"]) for r in rows)
    print(f"fit: t = 2(P-1) x {fit['latency_s'] * 1e6:.1f} us + 2(P-1)/P x bytes / "
          f"{fit['busbw_bytes_per_s'] / 1e9:.2f} GB/s; worst measured/model ratio {worst:.2f}x")
    out = {"benchmark": "allreduce_gloo", "quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "procs": args.procs, "repeats": repeats, "machine": {"cpus": os.cpu_count(),
                                                                "platform": platform.platform()},
           "python": platform.python_version(), "torch": __import__("torch").__version__,
           "sizes": rows, "fit": fit, "worst_ratio": worst, "wall_s": wall,
           "loadavg_1m_before_after": [load0[0], os.getloadavg()[0]]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
