"""Data-plane throughput: rows/s and CPU-seconds per GB over the same files, three ways.

  pyarrow       raw pyarrow: read each Parquet shard, tokens column to numpy, torch.from_numpy per
                batch of B rows. No shuffle, no Ray: the floor.
  raytrain-sys  our DataPlane: read tasks over plan windows into the object store (seek by row
                group, seeded block + window shuffle, each shard's sha256 checked once per reader
                process), global batches fetched here and sliced by cursor, torch.from_numpy.
  ray-data      Ray Data's plain path: read_parquet + streaming_split(1) + iter_torch_batches
                (tokens decoded in collate_fn), no shuffle.
  raytrain-sys pack_masked (with --sequences pack_masked, or pack / bucket): our plane over the
                same files prepared as documents, rows made by packing (or bucketing) in the
                readers; its rows carry num_tokens (and doc_ids) columns too. Rows and bytes
                counted as for the others (row_len tokens a row).

``--epochs`` epochs each (one by default), in one run, on a local Ray cluster this script starts
(so every Ray process is its descendant). pyarrow reads the files once per epoch; our plane reads
all epochs through one stream, as a training job does; Ray Data runs one pipeline per epoch. With
one epoch of the ~10 MB stdlib, fixed costs (starting reader processes, the first reads)
weigh on our figures; several epochs show the steady state a training run sees
(``--epochs 40`` streams ~400 MB, as one epoch of a 400 MB dataset would; ``--variants
pyarrow,raytrain-sys`` leaves out plain Ray Data, which takes minutes for that). CPU seconds
are summed over this process and all its descendants (raylet, Ray workers), from psutil, so other users of a loaded machine do not count. GB = delivered token
bytes (rows x row_len), not compressed file bytes. Also: time to the first batch of a fresh
DataPlane at 0% and at 90% of an epoch (resume seeks; best of 3).

    .venv/bin/python benchmarks/data_throughput.py                 # ~12 MB of stdlib source
    .venv/bin/python benchmarks/data_throughput.py --epochs 8
    .venv/bin/python benchmarks/data_throughput.py --epochs 40 --variants pyarrow,raytrain-sys
    .venv/bin/python benchmarks/data_throughput.py --max-bytes 4000000 --quick

Results go to benchmarks/results/data_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from raytrain_sys.data.plane import DataPlane  # noqa: E402
from raytrain_sys.data.prepare import prepare_documents_dataset, prepare_text_dataset  # noqa: E402
from raytrain_sys.data.shards import read_manifest  # noqa: E402


class CpuMeter:
    """CPU seconds of this process and all its descendants since start()."""

    def _snapshot(self) -> dict[int, float]:
        me = psutil.Process()
        out = {}
        for p in [me] + me.children(recursive=True):
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def start(self) -> None:
        self.t0, self.before = time.perf_counter(), self._snapshot()

    def stop(self) -> tuple[float, float]:
        after = self._snapshot()
        cpu = sum(v - self.before.get(pid, 0.0) for pid, v in after.items())
        return time.perf_counter() - self.t0, cpu


def run_pyarrow(path: str, manifest, batch: int, epochs: int) -> int:
    rows = 0
    for shard in manifest.shards * epochs:
        col = pq.read_table(os.path.join(path, shard.path), columns=["tokens"]).column("tokens")
        arr = col.combine_chunks()
        tokens = np.frombuffer(arr.buffers()[1], dtype=np.uint8)[
            arr.offset * manifest.row_len:(arr.offset + len(arr)) * manifest.row_len
        ].reshape(len(arr), manifest.row_len)
        for i in range(0, len(tokens), batch):
            t = torch.from_numpy(tokens[i:i + batch])
            rows += t.shape[0]
    return rows


def run_plane(path: str, manifest, batch: int, window: int, epochs: int, sequences: str = "rows",
              row_len: int = 0, rows_per_epoch: int = 0) -> int:
    steps = epochs * (rows_per_epoch or manifest.num_rows) // batch
    block = 256 if sequences == "rows" else 16  # a row group: 256 rows, or 16 documents
    plane = DataPlane(path, manifest, 0, window, block, batch, end_position=steps * batch,
                      sequences=sequences, row_len=row_len)
    rows = 0
    try:
        for step in range(steps):
            cols, _ = plane.global_batch(step * batch)
            rows += torch.from_numpy(cols["tokens"]).shape[0]
    finally:
        plane.close()
    return rows


def run_ray_data(path: str, manifest, batch: int, epochs: int) -> int:
    import ray.data

    row_len = manifest.row_len

    def collate(b):
        return torch.from_numpy(np.frombuffer(b"".join(b["tokens"]), dtype=np.uint8).reshape(-1, row_len))

    files = [os.path.join(path, s.path) for s in manifest.shards]
    rows = 0
    for _ in range(epochs):
        it = ray.data.read_parquet(files).streaming_split(1)[0]
        for t in it.iter_torch_batches(batch_size=batch, collate_fn=collate):
            rows += t.shape[0]
    return rows


def first_batch_s(path: str, manifest, cursor: int, batch: int, window: int) -> float:
    plane = DataPlane(path, manifest, 0, window, 256, batch, end_position=2 * manifest.num_rows)
    try:
        t0 = time.perf_counter()
        plane.global_batch(cursor)
        return time.perf_counter() - t0
    finally:
        plane.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", type=int, default=12_000_000)
    ap.add_argument("--batch", type=int, default=32, help="global batch (jobs/tinygpt.yaml's)")
    ap.add_argument("--window", type=int, default=4096, help="shuffle window (tinygpt's)")
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray cluster")
    ap.add_argument("--epochs", type=int, default=1, help="epochs read by each variant")
    ap.add_argument("--sequences", choices=("pack", "pack_masked", "bucket"), default="",
                    help="add our plane over the same sources as documents, rows made this way")
    ap.add_argument("--doc-window", type=int, default=64, help="documents per shuffle window")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of every variant; best run of each, and the median ratio within rounds")
    ap.add_argument("--quick", action="store_true", help="one repeat per variant, no warm-up")
    ap.add_argument("--variants", default="pyarrow,raytrain-sys,ray-data",
                    help="comma list of pyarrow, raytrain-sys, ray-data (pyarrow, the base, always runs)")
    ap.add_argument("--out", default=str(HERE / "results" / "data_throughput.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

    import ray

    tmp = tempfile.mkdtemp(prefix="rts-bench-data-")
    path = os.path.join(tmp, "stdlib")
    prepare_text_dataset(path, row_len=129, max_bytes=args.max_bytes)
    manifest = read_manifest(path)
    gb = manifest.num_rows * manifest.row_len / 1e9
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="rts-ray-", dir="/tmp"))
    ray.data.DataContext.get_current().enable_progress_bars = False
    load_before = os.getloadavg()[0]
    if args.sequences:
        docs_path = os.path.join(tmp, "stdlib-docs")
        prepare_documents_dataset(docs_path, max_bytes=args.max_bytes)
        docs = read_manifest(docs_path)
        probe = DataPlane(docs_path, docs, 0, args.doc_window, 16, args.batch, end_position=1,
                          sequences=args.sequences, row_len=manifest.row_len)
        docs_rows = probe.stream.epoch(0).num_rows  # rows of the first epoch, from the lengths
        probe.close()

    variants = {
        "pyarrow": lambda: run_pyarrow(path, manifest, args.batch, args.epochs),
        "raytrain-sys": lambda: run_plane(path, manifest, args.batch, args.window, args.epochs),
        "ray-data": lambda: run_ray_data(path, manifest, args.batch, args.epochs),
    }
    keep = {"pyarrow", *args.variants.split(",")}
    unknown = keep - set(variants)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose from {sorted(variants)}")
    variants = {k: v for k, v in variants.items() if k in keep}
    if args.sequences:
        variants[f"raytrain-sys {args.sequences}"] = lambda: run_plane(
            docs_path, docs, args.batch, args.doc_window, args.epochs, args.sequences,
            manifest.row_len, docs_rows)
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    meter = CpuMeter()
    if not args.quick:
        for fn in variants.values():
            fn()  # warm-up: worker processes, page cache
    # Rounds, each running every variant back to back, in the reverse order of the round before:
    # the machine's speed drifts by tens of percent over minutes (pyarrow alone moved between 1.3
    # and 2.0 M rows/s here), so ratios are taken within a round, where the drift cancels out.
    for r in range(repeats):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            meter.start()
            rows = variants[name]()
            wall, cpu = meter.stop()
            runs[name].append({"rows": rows, "wall_s": wall, "cpu_s": cpu, "rows_per_s": rows / wall,
                               "cpu_s_per_gb": cpu / (rows * manifest.row_len / 1e9)})
    results = {name: {**min(rs, key=lambda x: x["wall_s"]), "runs": rs} for name, rs in runs.items()}
    within = {name: {k: statistics.median(a[k] / b[k] for a, b in zip(rs, runs["pyarrow"]))
                     for k in ("rows_per_s", "cpu_s_per_gb")}
              for name, rs in runs.items() if name != "pyarrow"}
    ttfb = {pct: min(first_batch_s(path, manifest, int(pct / 100 * manifest.num_rows), args.batch,
                                   args.window) for _ in range(3)) for pct in (0, 90)}
    ray.shutdown()

    base = results["pyarrow"]
    load_after = os.getloadavg()[0]
    print(f"{manifest.num_rows} rows x {manifest.row_len} tokens ({gb * 1000:.0f} MB delivered) x "
          f"{args.epochs} epoch(s), {len(manifest.shards)} shards, batch {args.batch}, window "
          f"{args.window}, best of {repeats} rounds; load average {load_before:.1f} before, "
          f"{load_after:.1f} after, on {os.cpu_count()} cores")
    print(f"{'variant':25s} {'rows/s':>10s} {'x pyarrow':>10s} {'CPU s/GB':>10s} {'x pyarrow':>10s}")
    for name, r in results.items():
        print(f"{name:25s} {r['rows_per_s']:10,.0f} {r['rows_per_s'] / base['rows_per_s']:10.2f} "
              f"{r['cpu_s_per_gb']:10.1f} {r['cpu_s_per_gb'] / base['cpu_s_per_gb']:10.2f}")
    if repeats > 1:
        for name, w in within.items():
            print(f"{name:25s} median of {repeats} rounds' ratios: {w['rows_per_s']:.2f}x pyarrow rows/s, "
                  f"{w['cpu_s_per_gb']:.2f}x its CPU per GB")
    print(f"time to first batch: {ttfb[0]:.2f} s at 0%, {ttfb[90]:.2f} s at 90% of the epoch")
    tinygpt = None
    ddp = HERE / "results" / "ddp_overhead.json"
    if ddp.exists():
        try:
            tps = json.loads(ddp.read_text())["results"]["raytrain-sys"]["tokens_per_s"]
            tinygpt = tps / 128  # rows/s the default job consumes (block_size 128)
            print(f"default tinygpt job consumes ~{tinygpt:,.0f} rows/s (from {ddp.name}); "
                  f"our plane serves {results['raytrain-sys']['rows_per_s'] / tinygpt:,.0f}x that")
        except (KeyError, ValueError, TypeError):
            pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "rows": manifest.num_rows, "row_len": manifest.row_len, "batch": args.batch,
        "window": args.window, "epochs": args.epochs, "repeats": repeats, "variants": results,
        "ratios_within_rounds": within,
        "first_batch_s": ttfb, "tinygpt_rows_per_s": tinygpt,
        "loadavg_1m": {"before": load_before, "after": load_after}, "quick": args.quick,
    }, indent=1))


if __name__ == "__main__":
    main()
