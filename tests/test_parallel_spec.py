"""The parallel section of the spec (issue 5, test 5) and the mesh's data shards."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from raytrain_sys.errors import SpecError
from raytrain_sys.spec import ParallelSpec, from_dict
from tests.parallel_harness import run_on_ranks


def load(parallel: dict, **sections) -> None:
    raw = {"model": {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16},
           "train": {"global_batch_size": 8}, "resources": {"num_workers": 4},
           "elastic": {"max_workers": 0}, "parallel": parallel}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return from_dict(raw)


@pytest.mark.parametrize("parallel,extra,field,words", [
    ({"tp": 3}, {}, "parallel.tp", "must divide model.n_head=4"),
    ({"tp": 2}, {"model": {"block_size": 15}}, "parallel.tp", "must divide model.block_size=15"),
    ({"pp": 5}, {}, "parallel.pp", "must not exceed model.n_layer=4"),
    ({"tp": 8}, {"model": {"n_head": 8}}, "parallel", "does not divide the world of 4 workers (resources.num_workers=4)"),
    ({"dp": 3}, {}, "parallel", "but the world has 4 workers"),
    ({"strategy": "ddp", "fsdp": 2}, {}, "parallel.fsdp", "use strategy fsdp or hsdp"),
    ({"strategy": "fsdp", "dp": 2}, {}, "parallel.dp", "strategy hsdp"),
    ({"strategy": "hsdp"}, {}, "parallel.fsdp", "shard group size"),
    ({"strategy": "hsdp", "fsdp": 3}, {}, "parallel.fsdp", "must divide the data-parallel size 4"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 3}, {},
     "parallel.pp_stages_per_rank", "pp x pp_stages_per_rank = 2 x 3"),
    ({"pp": 4, "pp_schedule": "1f1b", "microbatches": 2}, {}, "parallel.microbatches",
     "needs at least pp=4"),
    ({"pp": 2, "microbatches": 8}, {}, "parallel.microbatches", "gives 4 with resources.num_workers=4"),
    ({"strategy": "fsdp", "comm_hook": "powersgd"}, {}, "parallel.comm_hook", "reduce-scatters"),
    ({"tp": 2, "comm_hook": "fp16"}, {}, "parallel.comm_hook", "DDP module hook"),
    ({"mixed_precision": "bf16"}, {}, "parallel.mixed_precision", "strategy fsdp or hsdp"),
    ({"strategy": "fsdp", "mixed_precision": "bf16"}, {"train": {"precision": "fp64"}},
     "parallel.mixed_precision", "train.precision: fp32"),
    ({"pp_schedule": "zb"}, {}, "parallel.pp_schedule", "allowed: gpipe, 1f1b, interleaved_1f1b"),
    ({"tp": 0}, {}, "parallel.tp", "must be 1 or more"),
    ({"pp": 2, "dp": 2}, {"elastic": {"max_workers": 6}}, "parallel",
     "but the world has 6 workers (elastic.max_workers=6); leave dp unset"),
])
def test_config_errors_name_the_field(parallel, extra, field, words):
    with pytest.raises(SpecError) as info:
        load(parallel, **extra)
    assert info.value.field == field, str(info.value)
    assert words in str(info.value), str(info.value)


def test_degrees_follow_the_world():
    assert ParallelSpec().degrees(4) == {"pp": 1, "dp": 4, "fsdp": 1, "tp": 1}
    assert ParallelSpec(strategy="fsdp", tp=2).degrees(8) == {"pp": 1, "dp": 1, "fsdp": 4, "tp": 2}
    assert ParallelSpec(strategy="hsdp", fsdp=2, pp=2).degrees(8) == {"pp": 2, "dp": 2, "fsdp": 2, "tp": 1}
    par = ParallelSpec(strategy="fsdp", tp=2, pp=2)
    assert par.world_granularity() == 4
    assert [par.usable_world_size(n) for n in (3, 4, 7, 8)] == [0, 4, 4, 8]
    load({"strategy": "fsdp", "tp": 2, "pp": 2})  # a valid 3-D layout loads


def mesh_layout(par: ParallelSpec) -> tuple:
    from raytrain_sys.parallel.mesh import build_mesh, data_shard, is_data_leader, local_index

    mesh = build_mesh(par, dist.get_world_size())
    coords = tuple(local_index(mesh, a) for a in ("pp", "dp", "fsdp", "tp"))
    return coords, data_shard(mesh), is_data_leader(mesh)


def test_tp_and_pp_peers_get_the_same_rows():
    """dp 2 x tp 2 on 4 ranks: ranks 0,1 (a TP pair) share shard 0, ranks 2,3 shard 1; one
    leader per shard. HSDP 2 x 2: four different shards."""
    dp_tp = run_on_ranks(4, mesh_layout, ParallelSpec(strategy="ddp", tp=2))
    assert [r[1] for r in dp_tp] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r[2] for r in dp_tp] == [True, False, True, False]
    pp_fsdp = run_on_ranks(4, mesh_layout, ParallelSpec(strategy="fsdp", pp=2))
    assert [r[1] for r in pp_fsdp] == [(0, 2), (1, 2), (0, 2), (1, 2)]  # pp outermost
    assert [r[2] for r in pp_fsdp] == [True, True, False, False]
    hsdp = run_on_ranks(4, mesh_layout, ParallelSpec(strategy="hsdp", fsdp=2))
    assert [r[1] for r in hsdp] == [(0, 4), (1, 4), (2, 4), (3, 4)]
