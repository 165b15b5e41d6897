"""Seek stress: one fresh driver process that seeks a data stream many times with reads in flight.

    python -m tests.seek_stress --address ADDR --dataset DIR --seeks 60 --mode plane|raydata

``plane``: our DataPlane (read tasks into the object store; a seek drops references, never
cancels). ``raydata``: the same reads as a Ray Data ``map_batches`` stream consumed with
``iter_batches`` and closed early at every seek, which is what the data plane did before: Ray
Data's stock shutdown force-cancels the reads still running, and Ray 2.60 aborts the calling
process when such a cancel meets a reply in flight (task_manager.cc "Tried to complete task that
was not pending"). Each seek goes to a random cursor, takes one or two batches (so reads are in
flight when the next seek comes), now and then changes the ranks' share (a resize); the dataset
may hold a bad shard (``--bad-shard``, read under on_bad_shard=skip, which seeks too).

In ``plane`` mode ``ray.cancel`` is replaced by a function that fails the run: if a Ray or
raytrain-sys change brings a cancel back into the data path, this fails loudly instead of
aborting one run in many. The process prints ``SEEKS_DONE n`` at the end; an abort shows as a
signal exit (SIGABRT) with Ray's check message on stderr.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def _no_cancel(*args, **kwargs):
    raise AssertionError("the data path called ray.cancel: a seek must never cancel a read "
                         "(Ray 2.60 aborts the driver when a cancel meets a reply in flight)")


def run_plane(args, manifest) -> int:
    import ray

    from raytrain_sys.data.plane import DataPlane

    ray.cancel = _no_cancel
    rng = random.Random(args.seed)
    B = args.batch
    end = 3 * manifest.num_rows // B * B
    plane = DataPlane(args.dataset, manifest, args.seed, args.window, args.block_rows, B,
                      end_position=end, prefetch_steps=2, on_bad_shard="skip" if args.bad_shard >= 0 else "fail",
                      run_dir=args.run_dir, num_readers=args.readers,
                      read_resources={"CPU": args.read_cpus} if args.read_cpus else None)
    done = 0
    for i in range(args.seeks):
        cursor = rng.randrange(0, end // B - 2) * B
        if rng.random() < 0.2:
            plane.share_rows = max(1, B // rng.choice([1, 2, 4]))  # a resize: pieces cut anew
        for k in range(rng.choice([1, 1, 2])):
            batch = plane.global_batch_refs(cursor + k * B)
            if rng.random() < 0.5:  # fetch as a rank would, from the object store
                batch.share(slice(0, B)).fetch()
        if args.read_jitter_ms:  # the next seek comes while this stream's reads run or end
            time.sleep(rng.random() * args.read_jitter_ms / 1000.0)
        done += 1
    plane.close()
    return done


def run_raydata(args, manifest) -> int:
    """The stock path: a Ray Data stream per seek, closed early (force-cancelling running reads)."""
    import ray.data

    from raytrain_sys.data import order
    from raytrain_sys.data.reads import ReadContext, read_chunk_columns

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    rng = random.Random(args.seed)
    stream = order.RowStream(tuple(s.num_rows for s in manifest.shards), args.seed, args.window,
                             args.block_rows)
    rctx = ReadContext(args.dataset, manifest, stream, "", False, ())

    jitter_s = args.read_jitter_ms / 1000.0

    def read(batch):
        import random as r

        import numpy as np

        out = read_chunk_columns(rctx, {"g": int(batch["g"][0]), "last": int(batch["last"][0]),
                                        "start": 0})
        if jitter_s:  # reads of uneven length: some end just as the stream closes
            time.sleep(r.random() * jitter_s)
        return {"n": np.asarray([len(out["sample_id"])])}

    windows = 3 * stream.windows_per_epoch
    done = 0
    for i in range(args.seeks):
        g = rng.randrange(0, windows - 8)
        items = [{"g": w, "last": w} for w in range(g, min(g + 16, windows))]
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            read, batch_size=1, batch_format="numpy", num_cpus=args.read_cpus,
            compute=ray.data.TaskPoolStrategy(size=args.readers))
        it = iter(ds.iter_batches(batch_size=None, prefetch_batches=1))
        for _ in range(rng.choice([1, 1, 2])):
            next(it)
        if jitter_s:
            time.sleep(rng.random() * jitter_s)
        it.close()  # stock shutdown: running reads are cancelled
        done += 1
    return done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--mode", choices=["plane", "raydata"], default="plane")
    p.add_argument("--seeks", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--block-rows", type=int, default=16)
    p.add_argument("--readers", type=int, default=3)
    p.add_argument("--read-cpus", type=float, default=0.0)
    p.add_argument("--bad-shard", type=int, default=-1)
    p.add_argument("--run-dir", default="")
    p.add_argument("--read-jitter-ms", type=float, default=0.0,
                   help="each read sleeps up to this long, and each seek waits up to this long after "
                        "the last batch (reads end around the seek, or the stock mode's cancel)")
    args = p.parse_args()

    import logging

    import ray

    from raytrain_sys.data.shards import read_manifest

    logging.basicConfig(level=logging.WARNING)
    from raytrain_sys.data.reads import READ_JITTER_ENV

    # The reads of this driver's job sleep a random while (plane mode; raydata mode sleeps in
    # its own read function): reads end around the seeks, where the race lies.
    env = {READ_JITTER_ENV: str(args.read_jitter_ms)} if args.read_jitter_ms else {}
    ray.init(address=args.address, log_to_driver=False, logging_level="WARNING",
             runtime_env={"env_vars": env} if env else None)
    manifest = read_manifest(args.dataset)
    t0 = time.monotonic()
    done = (run_plane if args.mode == "plane" else run_raydata)(args, manifest)
    print(f"SEEKS_DONE {done} in {time.monotonic() - t0:.1f} s", flush=True)
    ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
