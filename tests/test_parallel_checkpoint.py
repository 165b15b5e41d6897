"""Reshardable checkpoints (issue 5, test 2): DCP save in one layout, load in another.

Each round trip trains 5 of 10 steps in layout A and saves; the same job continues in A for
reference; a fresh group in layout B loads the checkpoint. The loaded parameters and optimizer
state must equal the saved ones exactly (torch.equal: DCP moves bytes, it does no arithmetic),
and the next 5 steps in B must give A's losses (to fp64 rounding: B sums in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raytrain_sys.spec import ParallelSpec
from tests.parallel_common import RTOL_FP64, STEPS, make_parallel, reference, train_steps
from tests.parallel_harness import run_on_ranks

HALF = STEPS // 2


def save_then_continue(par: ParallelSpec, path: str, async_save: bool) -> dict | None:
    pm, opt = make_parallel(par)
    train_steps(pm, opt, 0, HALF)
    pm.save_dcp(opt, path, async_save=async_save)
    saved = {"params": pm.full_state_dict(), "optim": pm.full_optimizer_state(opt)}
    pm.wait_for_save()
    losses = train_steps(pm, opt, HALF, STEPS - HALF)
    return {**saved, "losses": losses} if dist.get_rank() == 0 else None


def load_then_continue(par: ParallelSpec, path: str) -> dict | None:
    pm, opt = make_parallel(par)
    pm.load_dcp(opt, path)
    loaded = {"params": pm.full_state_dict(), "optim": pm.full_optimizer_state(opt)}
    losses = train_steps(pm, opt, HALF, STEPS - HALF)
    final = pm.full_state_dict()
    return {**loaded, "losses": losses, "final": final} if dist.get_rank() == 0 else None


def assert_state_equal(a: dict, b: dict) -> None:
    keys = a["params"].keys() & b["params"].keys()
    assert keys == set(b["params"]), "the loaded layout misses parameters"
    for k in keys:
        assert torch.equal(a["params"][k], b["params"][k]), k
    # A tied parameter is one optimizer entry in one layout and two (equal) in a pipeline.
    common = a["optim"].keys() & b["optim"].keys()
    assert len(common) >= len(b["optim"]) - 1 and common
    for k in common:
        for name, value in b["optim"][k].items():
            other = a["optim"][k][name]
            assert torch.equal(torch.as_tensor(other), torch.as_tensor(value)), f"{k}.{name}"


ROUND_TRIPS = [
    ("fsdp4_to_fsdp2", 4, dict(strategy="fsdp"), 2, dict(strategy="fsdp"), False),
    ("tp2_to_dp2", 2, dict(tp=2), 2, dict(strategy="ddp"), True),
    ("pp2_to_pp1", 2, dict(pp=2, pp_schedule="1f1b"), 2, dict(strategy="ddp"), True),
]


@pytest.mark.parametrize("name,world_a,par_a,world_b,par_b,async_save", ROUND_TRIPS,
                         ids=[r[0] for r in ROUND_TRIPS])
def test_reshard_round_trip(tmp_path, name, world_a, par_a, world_b, par_b, async_save):
    path = str(tmp_path / "ckpt")
    a = run_on_ranks(world_a, save_then_continue, ParallelSpec(**par_a), path, async_save)[0]
    b = run_on_ranks(world_b, load_then_continue, ParallelSpec(**par_b), path)[0]
    assert_state_equal(a, b)
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]),
                               rtol=RTOL_FP64, atol=0)
    ref, _ = reference()
    for k in ref:
        torch.testing.assert_close(b["final"][k], ref[k], rtol=RTOL_FP64, atol=1e-12)


def export_names(par: ParallelSpec) -> list[str] | None:
    pm, opt = make_parallel(par)
    names = sorted(pm.full_state_dict())
    return names if dist.get_rank() == 0 else None


def test_full_state_dict_keeps_original_names():
    """Export from a pipelined + tensor-parallel layout gives the model's own names, all of them."""
    names = run_on_ranks(4, export_names, ParallelSpec(strategy="ddp", pp=2, tp=2))[0]
    ref, _ = reference()
    assert names == sorted(ref)
