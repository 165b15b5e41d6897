"""Resharding by blocks (raytrain_sys.parallel.reshard: plan_requests, cut, Placement), issue 17.

Layout A trains 5 of 10 steps on gloo ranks and each rank describes what it holds as pieces; a
fresh group in layout B then takes its blocks the way a membership change does: each rank plans
from the sources' indexes, the sources cut the planned parts in small chunks, the rank copies
them in. What a user would notice:
- memory: a rank receives exactly the bytes of its own new blocks (no replica twice, never a
  whole tensor it only owns a block of), in chunks no larger than the bound;
- the result: B's state and its next 5 steps equal the full-state path's (the single-process
  run's), so the new path changes no parameter;
- without a rank whose shards have no copy, the plan names what is missing and nothing loads.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raytrain_sys.parallel import mesh as meshlib
from raytrain_sys.parallel import reshard
from raytrain_sys.spec import ParallelSpec
from tests.parallel_common import RTOL_FP64, STEPS, make_parallel, reference, train_steps
from tests.parallel_harness import run_on_ranks

HALF = STEPS // 2
CHUNK_BYTES = 8 * 1024  # small, so that the tiny model's tensors are cut into several chunks


def pieces_after_half(par: ParallelSpec, optim_name: str) -> dict:
    pm, opt = make_parallel(par, optim_name=optim_name)
    train_steps(pm, opt, 0, HALF)
    pieces = reshard.local_pieces(pm.local_model, opt)
    losses = train_steps(pm, opt, HALF, STEPS - HALF)
    return {"pieces": pieces, "losses": losses}


def load_by_blocks(par: ParallelSpec, sources: list[dict], optim_name: str) -> dict:
    pm, opt = make_parallel(par, optim_name=optim_name)
    indexes = [reshard.piece_index(s) for s in sources]
    wants = reshard.wanted_blocks(pm.local_model, opt, set().union(*indexes))
    chunks, missing = reshard.plan_requests(wants, indexes, reshard.keys_needed(pm.local_model, opt),
                                            CHUNK_BYTES)
    if missing:
        return {"missing": missing}
    # The bytes of this rank's own blocks in layout B (a whole tensor where it holds it whole).
    elem = {k: next(i[k][1] for i in indexes if k in i) for k in wants}
    global_shapes = {k: next(i[k][0][0] for i in indexes if k in i) for k in wants}
    own_bytes = sum(elem[k] * reshard._volume(reshard.widened(w, global_shapes[k])[1])
                    for k, w in wants.items())
    placement = reshard.Placement(pm.local_model, opt)
    received, largest = 0, 0
    for source, source_chunks in zip(sources, chunks):
        for requests in source_chunks:
            parts = reshard.cut(source, requests)
            nbytes = sum(p.data.nbytes for _, p in parts)
            received, largest = received + nbytes, max(largest, nbytes)
            for key, piece in parts:
                placement.take(key, piece)
    opt.zero_grad(set_to_none=True)
    loaded = pm.full_state_dict()
    losses = train_steps(pm, opt, HALF, STEPS - HALF)
    final = pm.full_state_dict()
    out = {"received": received, "largest": largest, "own": own_bytes,
           "rank_has_largest_row": max(p.data[0].nbytes if p.data.dim() else p.data.nbytes
                                       for s in sources for p in s.values())}
    return {**out, **({"loaded": loaded, "losses": losses, "final": final} if dist.get_rank() == 0 else {})}


CASES = [
    # id, world A, layout A, world B, layout B
    ("fsdp2_to_tp2", 2, dict(strategy="fsdp"), 2, dict(tp=2)),
    ("hsdp4_to_fsdp2", 4, dict(strategy="hsdp", fsdp=2), 2, dict(strategy="fsdp")),  # replicas once
    ("fsdp2_to_fsdp4", 2, dict(strategy="fsdp"), 4, dict(strategy="fsdp")),  # grow
    ("pp2xfsdp2_to_tp2", 4, dict(strategy="fsdp", pp=2), 2, dict(tp=2)),  # the tied pair split
    ("lars_fsdp2_to_ddp2", 2, dict(strategy="fsdp"), 2, dict(strategy="ddp")),  # momentum only
]


@pytest.mark.parametrize("name,world_a,par_a,world_b,par_b", CASES, ids=[c[0] for c in CASES])
def test_each_rank_receives_only_its_blocks_and_ends_like_one_process(name, world_a, par_a, world_b, par_b):
    optim_name = "lars" if name.startswith("lars") else "adamw"
    outs = run_on_ranks(world_a, pieces_after_half, ParallelSpec(**par_a), optim_name)
    b = run_on_ranks(world_b, load_by_blocks, ParallelSpec(**par_b), [o["pieces"] for o in outs], optim_name)
    for rank, r in enumerate(b):
        assert r["received"] == r["own"], f"rank {rank} received {r['received']} B for {r['own']} B of blocks"
        assert r["largest"] <= max(CHUNK_BYTES, r["rank_has_largest_row"]), (rank, r["largest"])
    full_state = sum(p.data.nbytes for p in reshard.assemble([o["pieces"] for o in outs])[0].values())
    if world_b > 1 and par_b.get("strategy") != "ddp":
        assert all(r["received"] < 0.75 * full_state for r in b), [r["received"] for r in b]
    torch.testing.assert_close(torch.tensor(b[0]["losses"]), torch.tensor(outs[0]["losses"]),
                               rtol=RTOL_FP64, atol=0)
    ref, _ = reference(optim_name=optim_name)
    for k in ref:
        torch.testing.assert_close(b[0]["final"][k], ref[k], rtol=RTOL_FP64, atol=1e-12)


def test_plan_names_the_shards_that_died_and_loads_nothing():
    outs = run_on_ranks(2, pieces_after_half, ParallelSpec(strategy="fsdp"), "adamw")
    b = run_on_ranks(2, load_by_blocks, ParallelSpec(tp=2), [outs[0]["pieces"]], "adamw")
    assert all(r.get("missing") for r in b), b
    assert any(k.startswith("model/") for k in b[0]["missing"]), b[0]["missing"][:3]


def owned_after_half(par: ParallelSpec) -> dict:
    """What a checkpoint of layout ``par`` at step HALF holds from this rank, and the full state."""
    pm, opt = make_parallel(par)
    train_steps(pm, opt, 0, HALF)
    coords = {axis: meshlib.local_index(pm.mesh, axis) for axis in meshlib.MESH_AXES}
    owned = reshard.pieces_to_plain(reshard.local_pieces(pm.local_model, opt, owned_by=coords))
    return {"owned": owned, "pieces": reshard.local_pieces(pm.local_model, opt)}


def test_resume_at_another_world_size_reads_its_blocks_and_names_an_incomplete_checkpoint(tmp_path):
    """An FSDP checkpoint of two ranks, resumed by one plain process file by file, gives the state
    the ranks held, exactly; without one rank's file the resume says which state is missing."""
    from raytrain_sys.checkpoint.checkpointer import Checkpointer
    from raytrain_sys.checkpoint.state import load_blocks
    from raytrain_sys.checkpoint.store import open_store
    from raytrain_sys.errors import CheckpointError
    from raytrain_sys.train.optim import build_optimizer
    from tests.parallel_common import OPTIM, build

    outs = run_on_ranks(2, owned_after_half, ParallelSpec(strategy="fsdp"))
    full, _ = reshard.assemble([o["pieces"] for o in outs])
    ckpt = Checkpointer(open_store(str(tmp_path / "ckpt")), keep_last=None)
    files = [ckpt.write_state(HALF, f"pieces_rank{rank:05d}.pt",
                              {"step": HALF, "rank": rank, "world_size": 2, "pieces": o["owned"]})
             for rank, o in enumerate(outs)]
    model = build()
    opt = build_optimizer(model, OPTIM)
    load_blocks(ckpt, ckpt.commit(HALF, files, {}), model, opt)
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[f"model/{name}"]), name
    names = reshard.parameter_names(model)
    for p, state in opt.state.items():
        for key, value in state.items():
            assert torch.equal(value, full[f"optim/{names[id(p)][0]}/{key}"]), (names[id(p)], key)
    assert len(opt.state) == len(list(model.parameters()))

    half_ckpt = Checkpointer(open_store(str(tmp_path / "half")), keep_last=None)
    one = half_ckpt.write_state(HALF, "pieces_rank00000.pt",
                                {"step": HALF, "rank": 0, "world_size": 2, "pieces": outs[0]["owned"]})
    model = build()
    with pytest.raises(CheckpointError, match="is incomplete: no file covers all of"):
        load_blocks(half_ckpt, half_ckpt.commit(HALF, [one], {}), model, build_optimizer(model, OPTIM))
