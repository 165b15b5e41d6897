"""Moving training state between layouts without the process group that sharded it.

After a worker dies, the old process group is broken: no collective over it (DCP, a DTensor's
``full_tensor``) can gather what the survivors hold. What each survivor holds is still well
defined, though: every tensor it keeps is a block of a global tensor at a known offset (DTensor
shards know their mesh coordinate and placements; plain tensors are the whole thing). So each
survivor describes its state as *pieces*, without talking to anyone; the pieces of any set of
ranks that together cover every element (a whole DDP replica, one complete HSDP replica group,
one rank per TP x PP coordinate, ...) assemble into the full state, and any new layout takes its
own blocks of that. When the survivors do not cover it (the only shard of something died), the
durable checkpoint is the fallback: see the Supervisor.

The same offsets are used in both directions (``compute_local_shape_and_global_offset``, which
DCP's planner also relies on), so the assembled tensor and the re-cut blocks agree with how the
layouts shard. Keys: ``model/<name>`` for ``state_dict()`` entries and
``optim/<name>/<state key>`` for optimizer state; a parameter known under several names (the GPT's
tied embedding and head) is listed under each, so a layout that splits the pair (a pipeline) and
one that keeps it whole both find their state.

Memory: assembling holds the full state once per assembling rank. Fine for the models this runs
on CPU and for single-node GPU jobs; a multi-node FSDP job of a large model would rather assemble
only its own blocks (left for when such a job needs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# DTensor's module is imported only where a tensor is one (see raytrain_sys.parallel.dtensor).
from raytrain_sys.parallel.dtensor import is_dtensor


@dataclass
class Piece:
    """A block of a global tensor: ``data`` sits at ``offset`` in a tensor of ``global_shape``."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    data: torch.Tensor

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.data.shape))


def _block(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global shape, offset, local tensor) of ``t`` on this rank."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        assert tuple(local.shape) == tuple(local_shape), (t.shape, t.placements, local.shape)
        return tuple(t.shape), tuple(offset), local
    return tuple(t.shape), (0,) * t.dim(), t


def _piece(t: torch.Tensor) -> Piece:
    shape, offset, local = _block(t)
    return Piece(shape, offset, local.detach().cpu().clone())


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in ``model`` (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


REPLICA_AXES = ("dp", "fsdp", "tp")  # mesh axes along which a tensor is either sharded or copied


def _owns(t: torch.Tensor, coords: dict[str, int] | None) -> bool:
    """Whether this rank is the one that writes ``t``'s block: of the ranks holding the same
    block (copies along the axes ``t`` is not sharded on), the one at coordinate 0."""
    if coords is None:
        return True
    sharded = set()
    if is_dtensor(t):
        from torch.distributed.tensor.placement_types import _StridedShard

        for axis, placement in zip(t.device_mesh.mesh_dim_names or (), t.placements):
            # _StridedShard (FSDP on top of TP along one dim) is a shard but not a Shard.
            if placement.is_shard() or isinstance(placement, _StridedShard):
                sharded.add(axis)
    return all(coords.get(axis, 0) == 0 for axis in REPLICA_AXES if axis not in sharded)


def local_pieces(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 owned_by: dict[str, int] | None = None) -> dict[str, Piece]:
    """What this rank holds of the model and its optimizer state, as pieces (no collective).

    With ``owned_by`` (this rank's mesh coordinates) only the blocks this rank owns: every
    block of the state then comes from exactly one rank, which is what a checkpoint writes.
    """
    out = {f"model/{name}": _piece(t) for name, t in model.state_dict().items() if _owns(t, owned_by)}
    if optimizer is not None:
        names = parameter_names(model)
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; "
                                    f"only tensors can be resharded")
                if not _owns(value, owned_by):  # a plain scalar (Adam's step) is a copy everywhere
                    continue
                piece = _piece(value)
                for name in names[id(p)]:
                    out[f"optim/{name}/{key}"] = piece
    return out


def pieces_to_plain(pieces: dict[str, Piece]) -> dict[str, dict]:
    """Pieces as plain containers of tensors and ints: what torch.load(weights_only=True) reads."""
    return {k: {"global_shape": list(p.global_shape), "offset": list(p.offset), "data": p.data}
            for k, p in pieces.items()}


def pieces_from_plain(plain: dict[str, dict]) -> dict[str, Piece]:
    return {k: Piece(tuple(v["global_shape"]), tuple(v["offset"]), v["data"]) for k, v in plain.items()}


def assemble(piece_sets: list[dict[str, Piece]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Full tensors from the pieces of several ranks, and the keys some element of which no
    piece covers (empty when the state is complete)."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for pieces in piece_sets:
        for key, piece in pieces.items():
            if key not in full:
                full[key] = torch.empty(piece.global_shape, dtype=piece.data.dtype)
                covered[key] = torch.zeros(piece.global_shape, dtype=torch.bool)
            full[key][piece.slices()] = piece.data
            covered[key][piece.slices()] = True
    missing = sorted(k for k, c in covered.items() if not bool(c.all()))
    return full, missing


def keys_needed(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                with_optimizer_state: bool = True) -> set[str]:
    """The keys ``load_full_state`` reads for this rank's layout. The optimizer's per-parameter
    state (its ``state_keys``, AdamW's by default) exists once it has taken a step."""
    keys = {f"model/{name}" for name in model.state_dict()}
    if optimizer is not None and with_optimizer_state:
        state_keys = getattr(optimizer, "state_keys", ("step", "exp_avg", "exp_avg_sq"))
        names = parameter_names(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                keys |= {f"optim/{names[id(p)][0]}/{k}" for k in state_keys}
    return keys


@torch.no_grad()
def _copy_block_into(target: torch.Tensor, full: torch.Tensor) -> None:
    shape, offset, local = _block(target)
    assert tuple(full.shape) == shape, f"global shape {tuple(full.shape)} != {shape}"
    local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])


@torch.no_grad()
def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    full: dict[str, torch.Tensor]) -> None:
    """Set this rank's blocks of the model (and optimizer state) from assembled full tensors.

    The optimizer must be the one built for ``model`` in its current layout; its state is
    replaced by tensors shaped like each parameter (DTensors where the parameter is one).
    No collective: every rank takes its blocks of the same full tensors.
    """
    for name, target in model.state_dict().items():
        key = f"model/{name}"
        if key not in full:
            raise KeyError(f"no state for {name}: the pieces came from another model")
        _copy_block_into(target, full[key])
    if optimizer is None:
        return
    names = parameter_names(model)
    optimizer.state.clear()
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = {}
            for name in names[id(p)]:
                prefix = f"optim/{name}/"
                for key, value in full.items():
                    if key.startswith(prefix) and key[len(prefix):] not in state:
                        sub = key[len(prefix):]
                        if value.dim() == 0 or tuple(value.shape) != tuple(p.shape):
                            state[sub] = value.clone()  # a scalar such as Adam's step count
                        else:
                            like = torch.zeros_like(p)
                            _copy_block_into(like, value)
                            state[sub] = like
            if state:
                optimizer.state[p] = state


__all__ = ["Piece", "local_pieces", "assemble", "keys_needed", "load_full_state", "parameter_names",
           "pieces_to_plain", "pieces_from_plain"]
