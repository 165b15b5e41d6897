"""The "no framework" baseline of benchmarks/ddp_overhead.py: plain DDP under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        benchmarks/_torchrun_ddp.py --spec-json spec.json --out result.json

Every rank reads its own share of each global batch straight from the Parquet shards with
pyarrow, through our pure order functions (``raytrain_sys.data.order``) and shard reader
(``raytrain_sys.data.shards``): positions ``[cursor, cursor + B)`` of the plan, dealt by
``order.deal``. No Ray, no driver, no object store. Model, loss scaling, optimizer, lr schedule
and clipping are the ones ``raytrain_sys.control.worker.TrainWorker.train_step`` uses, so the
three variants of the benchmark compute the same numbers and differ only in what runs around
the step.

The Ray Train variant imports ``ShareReader`` and ``run_steps`` from here, so (a) and (c) run
literally the same step code; only the launcher and the DDP wrapping differ.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain_sys.data import order
from raytrain_sys.data.shards import read_manifest, read_segment
from raytrain_sys.spec import DataSpec, JobSpec, from_dict
from raytrain_sys.train.optim import build_optimizer, lr_at


class ShareReader:
    """One rank's rows of each global batch, read from the shards on this rank.

    Rows are shuffled within windows of the plan, so a share's rows are scattered over the
    window's row groups; like the DataPlane, the reader reads the window that holds them once
    (its segments, row groups only), permutes it, and keeps it until the cursor leaves it. A
    window serves shuffle_window / global_batch_size steps (hundreds in the default job), so a
    read is rare and synchronous: its cost lands in that step's time, as a data wait does in
    raytrain-sys (which reads ahead in Ray Data tasks instead).
    """

    def __init__(self, data: DataSpec, global_batch_size: int, world_size: int, rank: int):
        self.dataset_uri = data.path
        self.s3_endpoint_url = data.s3_endpoint_url
        self.manifest = read_manifest(data.path, data.s3_endpoint_url)
        self.shard_rows = tuple(s.num_rows for s in self.manifest.shards)
        self.num_rows = self.manifest.num_rows
        self.window = min(data.shuffle_window, self.num_rows)  # as the DataPlane clamps it
        self.seed = data.seed
        # The plan's constants after (shard_rows, seed, epoch): the window, and the block size of
        # the block-permuted plan when this version of order.py has one (data.shuffle_block_rows).
        block_rows = getattr(data, "shuffle_block_rows", None)
        self.plan_args = (self.window,) if block_rows is None else (self.window, block_rows)
        self.global_batch_size = global_batch_size
        self.share = order.deal(global_batch_size, world_size)[rank]
        self._windows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _window(self, epoch: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        key = (epoch, w)
        if key not in self._windows:
            plan = order.epoch_plan(self.shard_rows, self.seed, epoch, *self.plan_args)
            rows = np.concatenate([read_segment(self.dataset_uri, self.manifest, seg,
                                                self.s3_endpoint_url)
                                   for seg in plan.window_segments(w)])
            self._windows[key] = (rows[plan.window_permutation(w)], plan.window_sample_ids(w))
        return self._windows[key]

    def share_rows(self, data_cursor: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, sample ids) of this rank's slice of the global batch at ``data_cursor``."""
        start = data_cursor + self.share.start
        stop = data_cursor + self.share.stop
        tokens, ids = [], []
        pos = start
        while pos < stop:
            epoch, w, offset = order.locate(pos, self.num_rows, self.window)
            wt, wi = self._window(epoch, w)
            take = min(stop - pos, len(wi) - offset)
            tokens.append(wt[offset: offset + take])
            ids.append(wi[offset: offset + take])
            pos += take
        first = order.locate(start, self.num_rows, self.window)[:2]
        for key in [k for k in self._windows if k < first]:
            del self._windows[key]
        return np.concatenate(tokens), np.concatenate(ids)


def _step_seed(seed: int, step: int, rank: int) -> int:
    # The formula of raytrain_sys.control.worker._step_seed, copied so this script imports no Ray.
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)


def build(spec: JobSpec) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Model and optimizer exactly as TrainWorker._build makes them (before any DDP wrap)."""
    from raytrain_sys.extensions import build_model

    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model)
    return model, build_optimizer(model, spec.optim)


def run_steps(spec: JobSpec, model: torch.nn.Module, ddp: torch.nn.Module,
              optimizer: torch.optim.Optimizer, reader: ShareReader, rank: int,
              world_size: int, on_step=None) -> dict:
    """``spec.train.max_steps`` optimizer steps; the step body is TrainWorker.train_step's.

    Returns this rank's per-step wall times (data read included, as raytrain-sys's step time
    includes its data wait) and per-step token-summed losses.
    """
    B = spec.train.global_batch_size
    step_times, loss_sums = [], []
    ddp.train()
    for step in range(spec.train.max_steps):
        t0 = time.perf_counter()
        tokens, ids = reader.share_rows(step * B)
        if step == 0:  # the same rows the DataPlane serves this rank
            want = order.sample_ids(reader.shard_rows, reader.seed, *reader.plan_args,
                                    reader.share.start, reader.share.stop)
            assert np.array_equal(ids, want), "share reader disagrees with order.sample_ids"
        lr = lr_at(step, spec.optim, spec.train.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(_step_seed(spec.train.seed, step, rank))
        rows = torch.from_numpy(tokens.astype(np.int64))
        x, y = rows[:, :-1], rows[:, 1:]
        scale = world_size / (B * y.shape[1])  # gradient of the global mean loss after DDP's average
        logits = ddp(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                               reduction="sum")
        (loss * scale).backward()
        loss_sums.append(loss.item())
        clip = spec.optim.grad_clip if spec.optim.grad_clip > 0 else float("inf")
        float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(step, step_times[-1])
    return {"step_times_s": step_times, "loss_sums": loss_sums}


def global_losses(spec: JobSpec, loss_sums: list[float]) -> list[float]:
    """Mean loss per step over the global batch: one all-reduce after the run, none per step."""
    t = torch.tensor(loss_sums, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / (spec.train.global_batch_size * spec.model.block_size)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec-json", required=True, help="JobSpec.to_dict() as a JSON file")
    parser.add_argument("--out", required=True, help="rank 0 writes its timings here as JSON")
    args = parser.parse_args()
    with open(args.spec_json) as f:
        spec = from_dict(json.load(f))

    torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(spec)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    reader = ShareReader(spec.data, spec.train.global_batch_size, world, rank)
    dist.barrier()  # steps start together, after every rank built its model
    result = run_steps(spec, model, ddp, optimizer, reader, rank, world)
    losses = global_losses(spec, result["loss_sums"])
    if rank == 0:
        out = {"world_size": world, "threads": torch.get_num_threads(),
               "step_times_s": result["step_times_s"], "losses": losses}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
