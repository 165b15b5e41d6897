"""One DeviceMesh for every strategy, with named axes in a fixed order.

The mesh always has the four axes ``("pp", "dp", "fsdp", "tp")``, degree-1 axes included, so code
asks for an axis by name and never guesses which ones exist. The order puts the axes that talk
the most innermost: consecutive ranks share a tensor-parallel group (every layer all-gathers and
reduce-scatters activations), then an FSDP shard group (per-layer parameter all-gathers), then
the DDP/HSDP replicas (one gradient all-reduce per step), and pipeline stages outermost (only
point-to-point activations). On GPUs this keeps TP inside a node; on CPU it only fixes the layout.

Which rows of a global batch a rank gets is decided here, by its data-parallel index: the rank's
place among the ``dp x fsdp`` ranks. Tensor- and pipeline-parallel peers share that index, so they
get the same rows, as they must.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raytrain_sys.spec import ParallelSpec

MESH_AXES = ("pp", "dp", "fsdp", "tp")  # outermost first; see the module docstring for why
DATA_AXES = ("dp", "fsdp")  # the ranks that see different rows


def build_mesh(parallel_spec: ParallelSpec, world_size: int, device_type: str = "cpu") -> DeviceMesh:
    """The job's mesh over the current default process group (which must span ``world_size``)."""
    degrees = parallel_spec.degrees(world_size)  # raises SpecError naming the field
    shape = tuple(degrees[axis] for axis in MESH_AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)


def degree(mesh: DeviceMesh, axis: str) -> int:
    return mesh.size(MESH_AXES.index(axis)) if axis in mesh.mesh_dim_names else 1


def local_index(mesh: DeviceMesh, axis: str) -> int:
    return mesh.get_local_rank(axis) if axis in mesh.mesh_dim_names else 0


def submesh(mesh: DeviceMesh, *axes: str) -> DeviceMesh:
    """The sub-mesh over ``axes`` (in mesh order); asserts they exist."""
    missing = [a for a in axes if a not in (mesh.mesh_dim_names or ())]
    assert not missing, f"mesh {mesh.mesh_dim_names} has no axis {missing}"
    return mesh[axes if len(axes) > 1 else axes[0]]


def data_shard(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp_index, dp_size): this rank's slice of the global batch is slice ``dp_index`` of
    ``dp_size`` equal-as-possible slices. The index runs over ``dp x fsdp`` (dp outer), so HSDP
    groups and FSDP shards each see different rows and TP/PP peers see the same."""
    fsdp = degree(mesh, "fsdp")
    index = local_index(mesh, "dp") * fsdp + local_index(mesh, "fsdp")
    return index, degree(mesh, "dp") * fsdp


dp_rank_and_size = data_shard  # the name the issue uses


def rank_coordinates(degrees: dict[str, int], rank: int) -> dict[str, int]:
    """A rank's coordinate on each axis, as ``init_device_mesh`` lays ranks out (row-major in
    MESH_AXES order). Pure arithmetic: the Supervisor uses it without a process group."""
    coords = {}
    for axis in reversed(MESH_AXES):
        rank, coords[axis] = divmod(rank, degrees[axis])
    return coords


def rank_data_slices(parallel_spec: ParallelSpec, world_size: int, global_batch_size: int,
                     rows: list[int] | None = None) -> list[slice]:
    """Rows of a global batch for each rank, in rank order: the ``deal`` slice of its data index
    (TP and PP peers share one). ``rows``: sizes per data index (``deal``'s), else an even split."""
    from raytrain_sys.data.order import deal

    degrees = parallel_spec.degrees(world_size)
    shares = deal(global_batch_size, degrees["dp"] * degrees["fsdp"], rows)
    out = []
    for rank in range(world_size):
        out.append(shares[data_index_of_rank(degrees, rank)])
    return out


def data_index_of_rank(degrees: dict[str, int], rank: int) -> int:
    """A rank's data-parallel index (``data_shard``'s) by arithmetic, without a process group."""
    c = rank_coordinates(degrees, rank)
    return c["dp"] * degrees["fsdp"] + c["fsdp"]


def is_data_leader_rank(degrees: dict[str, int], rank: int) -> bool:
    """``is_data_leader`` by arithmetic: the rank whose summed loss counts for its data shard."""
    c = rank_coordinates(degrees, rank)
    return c["tp"] == 0 and c["pp"] == 0


def is_data_leader(mesh: DeviceMesh) -> bool:
    """True on one rank per data shard (tp index 0, pp index 0): the rank whose loss counts once
    when per-rank losses are summed over the world."""
    return local_index(mesh, "tp") == 0 and local_index(mesh, "pp") == 0


__all__ = ["MESH_AXES", "DATA_AXES", "build_mesh", "degree", "local_index", "submesh",
           "data_shard", "dp_rank_and_size", "is_data_leader", "rank_coordinates",
           "rank_data_slices", "data_index_of_rank", "is_data_leader_rank"]
