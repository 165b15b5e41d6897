"""Recovering state from survivors without their broken process group (raytrain_sys.parallel.reshard).

Each case trains 5 of 10 steps in layout A; every rank describes what it holds as pieces (no
collective); the test assembles them (all ranks, and all but one) and checks:
- the assembled state equals A's own gathered state exactly (pieces are copies, not arithmetic);
- without one rank it is complete exactly when the layout keeps a replica of that rank's
  shards (DDP, HSDP, dp x tp), and names what is missing otherwise (FSDP, TP, PP);
- a fresh group in layout B loads it and its next 5 steps give A's losses and the
  single-process parameters: the survivors' state continues the run in a new layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raytrain_sys.parallel import reshard
from raytrain_sys.spec import ParallelSpec
from tests.parallel_common import RTOL_FP64, STEPS, make_parallel, reference, train_steps
from tests.parallel_harness import run_on_ranks

HALF = STEPS // 2


def pieces_after_half(par: ParallelSpec, optim_name: str = "adamw") -> dict:
    pm, opt = make_parallel(par, optim_name=optim_name)
    train_steps(pm, opt, 0, HALF)
    pieces = reshard.local_pieces(pm.local_model, opt)
    from raytrain_sys.parallel import mesh as meshlib
    coords = {axis: meshlib.local_index(pm.mesh, axis) for axis in meshlib.MESH_AXES}
    owned = reshard.local_pieces(pm.local_model, opt, owned_by=coords)
    gathered = {"params": pm.full_state_dict(), "optim": pm.full_optimizer_state(opt)}
    losses = train_steps(pm, opt, HALF, STEPS - HALF)
    return {"pieces": pieces, "owned": owned, **(gathered if dist.get_rank() == 0 else {}), "losses": losses}


def load_and_continue(par: ParallelSpec, full: dict, optim_name: str = "adamw") -> dict | None:
    pm, opt = make_parallel(par, optim_name=optim_name)
    missing = reshard.keys_needed(pm.local_model, opt) - full.keys()
    assert not missing, f"layout {par} needs {sorted(missing)[:3]}"
    reshard.load_full_state(pm.local_model, opt, full)
    loaded = pm.full_state_dict()
    losses = train_steps(pm, opt, HALF, STEPS - HALF)
    final = pm.full_state_dict()
    return {"loaded": loaded, "losses": losses, "final": final} if dist.get_rank() == 0 else None


CASES = [
    # id, world A, layout A, a replica of every shard survives one loss?, world B, layout B
    ("ddp2_to_fsdp2", 2, dict(strategy="ddp"), True, 2, dict(strategy="fsdp")),
    ("fsdp2_to_tp2", 2, dict(strategy="fsdp"), False, 2, dict(tp=2)),
    ("tp2_to_ddp2", 2, dict(tp=2), False, 2, dict(strategy="ddp")),
    ("pp2_to_fsdp2", 2, dict(pp=2, pp_schedule="1f1b"), False, 2, dict(strategy="fsdp")),
    ("hsdp4_to_fsdp2", 4, dict(strategy="hsdp", fsdp=2), True, 2, dict(strategy="fsdp")),
    ("dp2xtp2_to_pp2", 4, dict(strategy="ddp", tp=2), True, 2, dict(pp=2, pp_schedule="gpipe")),
    ("fsdp2xtp2_to_ddp2", 4, dict(strategy="fsdp", tp=2), False, 2, dict(strategy="ddp")),
    ("pp2xfsdp2_to_tp2", 4, dict(strategy="fsdp", pp=2), False, 2, dict(tp=2)),
    ("lars_fsdp2_to_tp2", 2, dict(strategy="fsdp"), False, 2, dict(tp=2)),  # momentum, not Adam state
]


@pytest.mark.parametrize("name,world_a,par_a,replicated,world_b,par_b", CASES, ids=[c[0] for c in CASES])
def test_survivor_pieces_rebuild_any_layout(name, world_a, par_a, replicated, world_b, par_b):
    optim_name = "lars" if name.startswith("lars") else "adamw"
    outs = run_on_ranks(world_a, pieces_after_half, ParallelSpec(**par_a), optim_name)
    full, missing = reshard.assemble([o["pieces"] for o in outs])
    assert not missing
    gathered = outs[0]
    for k, v in gathered["params"].items():
        assert torch.equal(full[f"model/{k}"], v), k
    for k, state in gathered["optim"].items():
        for sub, v in state.items():
            assert torch.equal(full[f"optim/{k}/{sub}"], torch.as_tensor(v)), f"{k}/{sub}"

    # What a checkpoint writes: each block once (a tied pair, two parameters in a pipeline,
    # is the only repeat), and together the whole state.
    owned_full, missing = reshard.assemble([o["owned"] for o in outs])
    assert not missing and owned_full.keys() == full.keys()
    assert all(torch.equal(owned_full[k], full[k]) for k in full)
    blocks = [(k, p.offset) for o in outs for k, p in o["owned"].items()]
    repeats = {k for k, offset in blocks if blocks.count((k, offset)) > 1}
    assert all("wte" in k or "lm_head" in k for k in repeats), sorted(repeats)[:3]

    # Without the last rank: complete only where the layout keeps a replica of its shards.
    _, missing = reshard.assemble([o["pieces"] for o in outs[:-1]])
    partial_keys = set().union(*(o["pieces"].keys() for o in outs[:-1]))
    absent = set(full) - partial_keys
    assert (not missing and not absent) == replicated, (missing[:3], sorted(absent)[:3])

    b = run_on_ranks(world_b, load_and_continue, ParallelSpec(**par_b), full, optim_name)[0]
    for k, v in gathered["params"].items():
        assert torch.equal(b["loaded"][k], v), k
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(outs[0]["losses"]),
                               rtol=RTOL_FP64, atol=0)
    ref, _ = reference(optim_name=optim_name)
    for k in ref:
        torch.testing.assert_close(b["final"][k], ref[k], rtol=RTOL_FP64, atol=1e-12)


def mesh_view(par: ParallelSpec, batch: int) -> tuple:
    from raytrain_sys.data.order import deal
    from raytrain_sys.parallel import mesh as meshlib

    mesh = meshlib.build_mesh(par, dist.get_world_size())
    index, size = meshlib.data_shard(mesh)
    return deal(batch, size)[index], meshlib.is_data_leader(mesh)


@pytest.mark.parametrize("par", [dict(strategy="ddp", tp=2), dict(strategy="fsdp", pp=2),
                                 dict(strategy="hsdp", fsdp=2), dict(strategy="ddp", pp=2, pp_schedule="gpipe")])
def test_supervisor_arithmetic_matches_the_mesh(par):
    """The Supervisor deals rows and sums losses by rank arithmetic (it has no process group);
    the workers' real DeviceMesh must agree, rank by rank. A batch of 7 makes shares uneven."""
    from raytrain_sys.parallel import mesh as meshlib

    spec = ParallelSpec(**par)
    real = run_on_ranks(4, mesh_view, spec, 7)
    degrees = spec.degrees(4)
    assert meshlib.rank_data_slices(spec, 4, 7) == [r[0] for r in real]
    assert [meshlib.is_data_leader_rank(degrees, r) for r in range(4)] == [r[1] for r in real]
