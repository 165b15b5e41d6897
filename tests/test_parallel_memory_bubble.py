"""Measured numbers (issue 5, tests 3 and 4): FSDP's per-rank bytes and the pipeline bubble."""

from __future__ import annotations

import pytest
import torch

from raytrain_sys.spec import ModelSpec, ParallelSpec
from tests.parallel_common import global_batches, make_parallel, shard_rows, units
from tests.parallel_harness import run_on_ranks

# n_embd 64 makes every parameter's first dimension divisible by 4 ranks many times over, so FSDP's
# shards are even and the 1/N claim is measured, not blurred by padding.
MEMORY_MODEL = ModelSpec(block_size=16, n_layer=2, n_head=4, n_embd=64)


def bytes_after_one_step(par: ParallelSpec) -> dict:
    pm, opt = make_parallel(par, torch.float32, MEMORY_MODEL)
    batch = global_batches(1)[0]
    index, size = pm.data_shard()
    pm.forward_backward({"tokens": torch.tensor(shard_rows(batch, index, size))}, units(batch))
    opt.step()  # now parameters, gradients and optimizer state all exist
    return pm.memory(opt)


def test_fsdp_holds_one_nth_of_ddp_bytes():
    world = 4
    ddp = run_on_ranks(world, bytes_after_one_step, ParallelSpec(strategy="ddp"))
    fsdp = run_on_ranks(world, bytes_after_one_step, ParallelSpec(strategy="fsdp"))
    zero2 = run_on_ranks(world, bytes_after_one_step,
                         ParallelSpec(strategy="fsdp", reshard_after_forward=False))
    for kind in ("param_bytes", "grad_bytes", "optim_bytes", "total_bytes"):
        for rank in range(world):
            ratio = fsdp[rank][kind] / ddp[rank][kind]
            assert abs(ratio * world - 1) < 0.10, (kind, rank, ratio, fsdp[rank], ddp[rank])
    # At rest (after backward) ZeRO-2-like has resharded too: same bytes as full shard.
    assert [r["total_bytes"] for r in zero2] == [r["total_bytes"] for r in fsdp]


def bubble(schedule: str, microbatches: int) -> dict:
    from raytrain_sys.parallel.pp import measure_bubble

    report = measure_bubble(schedule, microbatches, forward_s=0.03, backward_s=0.06, steps=4)
    return {"measured": report.measured, "theory": report.theory, "step_s": report.step_s}


# Absolute. Each micro-batch adds a gloo send/recv and Python scheduling (~1-3 ms when the machine
# is quiet, against 90 ms of stage time); measured deviations are below 0.02 on a quiet machine
# and reached 0.09 under a load average of 40 with the median step, hence the fastest step. A
# sleep that overran counts as the stage's time (measure_bubble): with five busy loops beside,
# the deviations were 0.015-0.057 against 0.018-0.075 from the nominal sleeps (one run each; the
# nominal one failed CI's run of 5a213a8 at 0.0605, 2-8-gpipe).
BUBBLE_TOLERANCE = 0.06


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("world,microbatches", [(2, 2), (2, 8), (4, 4)])
def test_pipeline_bubble_matches_theory(schedule, world, microbatches):
    """Stages of fixed length (sleeps: no CPU contention on 2 cores) idle (p-1)/(m+p-1) of a
    step under GPipe and 1F1B."""
    reports = run_on_ranks(world, bubble, schedule, microbatches)
    for r in reports:
        assert abs(r["measured"] - r["theory"]) < BUBBLE_TOLERANCE, reports
