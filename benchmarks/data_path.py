"""The data path at cluster scale: rows relayed by the driver against rows fetched by the ranks.

One invocation, per world size (``--workers``, default 2 and 4), starts a
``ray.cluster_utils.Cluster`` with a 0-CPU head (the driver; read tasks may land anywhere) and
one 1-CPU node per worker, and trains a trivial model through the real Supervisor on two kinds
of rows, in alternating rounds:

  image   WebDataset shards of 150,528-byte uint8 images (the bytes of a 3x224x224 image, stored
          1x224x672), decoded in the read tasks; model: ``trivial``, an average pool to 4x4 and a
          linear head (registered by this script in the driver and, through Ray's
          worker_process_setup_hook, in the workers), so that the data path, not a convolution
          over 150,000 pixels on a CPU, sets the pace
  tokens  the stdlib token shards (129 B rows); model: a 1-layer GPT of width 32

and two deliveries:

  relay   data.delivery=driver: the driver fetches each global batch and sends each rank its
          rows as task arguments (the path before this change: every byte through one process)
  refs    data.delivery=refs: the driver sends object references and row ranges; each rank
          fetches its rows from the object store of the node they were read on

Per variant: rows/s over the steps after warm-up, the bytes the driver serialized per rank per
step for ``train_step`` (Ray's own serializer, measured on the calls), and the ranks' data wait
as a fraction of step time. Plus ``raw``: the same shards read in this one process with no Ray
(``webdataset.read_segment`` / ``shards.read_segments`` over whole shards: ranged read and
decode), rows/s. Goals (issue 12): the driver handles at most 4 KiB per rank per step; image
rows at 4 workers >= 1.5x the relay's rows/s and >= 0.9x raw reading's.

    .venv/bin/python benchmarks/data_path.py --quick
    .venv/bin/python benchmarks/data_path.py

Results go to benchmarks/results/data_path.json.
"""

from __future__ import annotations

import argparse
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

log = logging.getLogger("data_path")
IMAGE_SHAPE = (1, 224, 672)  # 150,528 bytes: a 3x224x224 uint8 image's
KINDS = ("image", "tokens")
DELIVERIES = ("relay", "refs")


def write_images(out: Path, num: int, per_shard: int) -> None:
    """Image-like WebDataset shards (uint8 noise images, a class label each) plus a manifest."""
    import numpy as np

    from raytrain_sys.data.manifest import MANIFEST_NAME, WEBDATASET_FORMAT, DatasetManifest
    from raytrain_sys.data.webdataset import encode_field, write_tar_shard

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def write_atomic(path: Path, data: bytes) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    shards = []
    for s, start in enumerate(range(0, num, per_shard)):
        samples = ((f"{i:07d}", {"npy": encode_field("npy", rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)),
                                 "cls": encode_field("cls", np.int64(i % 10))})
                   for i in range(start, min(start + per_shard, num)))
        shards.append(write_tar_shard(out / f"shard-{s:05d}.tar", samples, write_atomic))
    manifest = DatasetManifest(format=WEBDATASET_FORMAT, row_len=0, shards=tuple(shards),
                               source="benchmarks/data_path.py image-like noise",
                               extra={"fields": {"image": "npy", "label": "cls"}, "num_classes": 10,
                                      "image_shape": list(IMAGE_SHAPE), "index_suffix": ".idx",
                                      "samples_per_shard": per_shard})
    write_atomic(out / MANIFEST_NAME, manifest.to_json().encode())


def raw_rows_per_s(dataset: str) -> float:
    """Every shard read whole in this process (ranged read + decode, no Ray): rows/s."""
    from raytrain_sys.data.order import Segment
    from raytrain_sys.data.shards import clear_caches, read_manifest, read_segments

    m = read_manifest(dataset)
    clear_caches()
    t0 = time.perf_counter()
    rows = 0
    for i, (sh, first) in enumerate(zip(m.shards, m.row_offsets)):
        cols = read_segments(dataset, m, [Segment(i, 0, sh.num_rows, first)])
        rows += len(next(iter(cols.values())))
    return rows / (time.perf_counter() - t0)


def register_trivial_model() -> None:
    """A benchmark-only classifier, ``model.name: trivial``: pool each image to 4x4, one linear
    layer. Registered in every process that builds or validates the spec."""
    import torch.nn as nn

    from raytrain_sys import models
    from raytrain_sys.train import tasks

    if "trivial" in models.MODELS:
        return
    models.register_model("trivial", lambda m: nn.Sequential(
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16, m.vocab_size)),
        lambda: tasks.Classify("image", "label"))


def spec_for(kind: str, delivery: str, dataset: str, workers: int, steps: int, out: str):
    from raytrain_sys.spec import from_dict

    if kind == "image":
        model = {"name": "trivial", "vocab_size": 10, "n_layer": 1, "n_embd": 1, "n_head": 1}
        batch, window, block = 32 * workers, 256, 32  # 4.8 MB a rank a step: bytes, not per-step costs, dominate
    else:
        model = {"name": "gpt", "vocab_size": 256, "block_size": 128, "n_layer": 1, "n_embd": 32,
                 "n_head": 2}
        batch, window, block = 64 * workers, 4096, 256
    return from_dict({
        "name": f"dp-{kind}-{delivery}-{workers}", "output_dir": out, "model": model,
        "data": {"path": dataset, "shuffle_window": window, "shuffle_block_rows": block,
                 "delivery": "driver" if delivery == "relay" else "refs"},
        "train": {"max_steps": steps, "global_batch_size": batch, "log_every_steps": 4},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "checkpoint": {"every_steps": 0, "save_on_exit": False},
        "tracking": {"enabled": False},
        "resources": {"num_workers": workers, "cpus_per_worker": 1, "worker_niceness": None},
        "elastic": {"min_workers": workers},
    })


def run_variant(kind: str, delivery: str, dataset: str, workers: int, steps: int, warmup: int,
                out: str) -> dict:
    from raytrain_sys.control.supervisor import Supervisor

    spec = spec_for(kind, delivery, dataset, workers, steps, out)
    stamps: list[float] = []
    meter = common.CallArgBytes("train_steps")
    try:
        sup = Supervisor(spec, on_step=lambda r: stamps.append(time.perf_counter()))
        sup.run()
    finally:
        meter.close()
    summary = json.loads(Path(sup.run_dir, "summary.json").read_text())
    rows = spec.train.global_batch_size * (len(stamps) - warmup - 1)
    rows_per_s = rows / (stamps[-1] - stamps[warmup])
    per_call = meter.sizes[warmup * workers:] or meter.sizes
    return {"kind": kind, "delivery": delivery, "workers": workers, "rows_per_s": rows_per_s,
            "driver_bytes_per_rank_step": statistics.median(per_call),
            "driver_bytes_per_rank_step_max": max(per_call),
            "data_wait_fraction": summary["throughput"].get("data_wait_fraction"),
            "global_batch_size": spec.train.global_batch_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--images", type=int, default=1536)
    p.add_argument("--quick", action="store_true", help="1 round, 2 workers, 16 steps, fewer images")
    p.add_argument("--out", default=str(HERE / "results" / "data_path.json"))
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    kinds = common.pick(p, args.kinds, KINDS, "kind")
    if args.quick:
        args.workers, args.steps, args.warmup, args.rounds, args.images = "2", 16, 4, 1, 256
    work = common.start(args.verbose, log, "rts-dp-")
    import ray
    from ray.cluster_utils import Cluster

    from raytrain_sys.data.prepare import prepare_text_dataset

    datasets = {}
    if "image" in kinds:
        datasets["image"] = os.path.join(work, "images")
        write_images(Path(datasets["image"]), args.images, 128)
    if "tokens" in kinds:
        datasets["tokens"] = os.path.join(work, "tokens")
        prepare_text_dataset(datasets["tokens"])
    raw = {k: max(raw_rows_per_s(d) for _ in range(3)) for k, d in datasets.items()}
    for k, v in raw.items():
        print(f"raw {k}: {v:,.0f} rows/s (one process, no Ray, best of 3)", flush=True)

    results = []
    for workers in [int(w) for w in args.workers.split(",")]:
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 0, "temp_dir": os.path.join(work, "ray"),
                                          "object_store_memory": 1024**3})
        for _ in range(workers):
            cluster.add_node(num_cpus=1, object_store_memory=1024**3)
        cluster.wait_for_nodes()
        register_trivial_model()
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING",
                 runtime_env={"worker_process_setup_hook": register_trivial_model})
        try:
            for r in range(args.rounds):
                order = [(k, d) for k in kinds for d in DELIVERIES]
                for kind, delivery in (order if r % 2 == 0 else order[::-1]):
                    common.wait_until_quiet(log, max_s=20)
                    res = run_variant(kind, delivery, datasets[kind], workers, args.steps, args.warmup,
                                      os.path.join(work, "runs"))
                    res["round"] = r
                    results.append(res)
                    print(f"  {workers} workers {kind:6s} {delivery:5s} {res['rows_per_s']:10,.0f} rows/s  "
                          f"driver {res['driver_bytes_per_rank_step']:>10,.0f} B/rank/step  "
                          f"data wait {100 * (res['data_wait_fraction'] or 0):5.1f}%", flush=True)
        finally:
            ray.shutdown()
            cluster.shutdown()

    print()
    print(f"{'workers':>7} {'rows':6} {'relay rows/s':>13} {'refs rows/s':>12} {'refs/relay':>10} "
          f"{'refs/raw':>8} {'relay B/rank/step':>17} {'refs B/rank/step':>16} {'refs wait':>9}")
    table = []
    for workers in sorted({r["workers"] for r in results}):
        for kind in kinds:
            def med(delivery, key):
                return statistics.median(r[key] for r in results if r["workers"] == workers
                                         and r["kind"] == kind and r["delivery"] == delivery)
            # Ratios within rounds, then their median: the machine drifts between rounds.
            ratios = []
            for r in range(args.rounds):
                pair = {x["delivery"]: x["rows_per_s"] for x in results
                        if x["workers"] == workers and x["kind"] == kind and x["round"] == r}
                ratios.append(pair["refs"] / pair["relay"])
            row = {"workers": workers, "kind": kind, "relay_rows_per_s": med("relay", "rows_per_s"),
                   "refs_rows_per_s": med("refs", "rows_per_s"),
                   "refs_over_relay": statistics.median(ratios),
                   "refs_over_raw": med("refs", "rows_per_s") / raw[kind],
                   "relay_bytes_per_rank_step": med("relay", "driver_bytes_per_rank_step"),
                   "refs_bytes_per_rank_step": med("refs", "driver_bytes_per_rank_step"),
                   "refs_data_wait_fraction": med("refs", "data_wait_fraction")}
            table.append(row)
            print(f"{workers:>7} {kind:6s} {row['relay_rows_per_s']:>13,.0f} {row['refs_rows_per_s']:>12,.0f} "
                  f"{row['refs_over_relay']:>9.2f}x {row['refs_over_raw']:>7.2f}x "
                  f"{row['relay_bytes_per_rank_step']:>17,.0f} {row['refs_bytes_per_rank_step']:>16,.0f} "
                  f"{100 * row['refs_data_wait_fraction']:>8.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"quick": args.quick, "raw_rows_per_s": raw, "table": table,
                                          "runs": results, "steps": args.steps, "warmup": args.warmup},
                                         indent=2) + "\n")
    print(f"\nwritten to {args.out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
