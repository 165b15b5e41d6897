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

Memory. ``assemble`` holds the full state (export and the tests use it). A membership change and
a resume never do: they go by blocks, DCP-planner style. Each member lists the blocks of the new
layout it owns (``wanted_blocks``), plans from the sources' piece *indexes* (shapes and offsets,
no data) which sub-block of which source fills which part of them (``plan_requests``), and the
sources cut exactly those sub-blocks, in chunks of at most ``CHUNK_BYTES`` (``cut``), which the
member copies into its blocks as they arrive (``Placement``). A rank thus holds its new blocks,
its old pieces until it has loaded, and one chunk in flight; a checkpoint is read one file at a
time the same way (raytrain_sys.checkpoint.state.load_blocks).
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


def _piece(t: torch.Tensor, copy: bool = True) -> Piece:
    shape, offset, local = _block(t)
    local = local.detach().cpu()
    return Piece(shape, offset, local.clone() if copy else local)


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
                 owned_by: dict[str, int] | None = None, copy: bool = True) -> dict[str, Piece]:
    """What this rank holds of the model and its optimizer state, as pieces (no collective).

    With ``owned_by`` (this rank's mesh coordinates) only the blocks this rank owns: every
    block of the state then comes from exactly one rank, which is what a checkpoint writes.
    ``copy=False`` shares the tensors' memory (on the CPU): for a caller that drops the model
    and optimizer next, so that their state is not held twice.
    """
    out = {f"model/{name}": _piece(t, copy) for name, t in model.state_dict().items()
           if _owns(t, owned_by)}
    if optimizer is not None:
        names = parameter_names(model)
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; "
                                    f"only tensors can be resharded")
                if not _owns(value, owned_by):  # a plain scalar (Adam's step) is a copy everywhere
                    continue
                piece = _piece(value, copy)
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


# ---------------------------------------------------------------------- by blocks
# A block in global coordinates: (global shape, offset, shape).
Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# The most bytes one transfer between a source and a member carries, and so the transient buffer
# on either side: big enough that per-object costs vanish, small next to a shard worth resizing.
CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Request:
    """The part ``offset`` / ``shape`` (global coordinates) of a source's piece ``key``."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def piece_index(pieces: dict[str, Piece]) -> dict[str, tuple[Block, int]]:
    """What a source holds, without the data: key -> (block, bytes per element)."""
    return {k: ((p.global_shape, p.offset, tuple(p.data.shape)), p.data.element_size())
            for k, p in pieces.items()}


def _overlap(a_offset, a_shape, b_offset, b_shape) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes (offset, shape), or None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a_offset, b_offset))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_offset, a_shape, b_offset, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _volume(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def covers(offset: tuple[int, ...], shape: tuple[int, ...], parts: list[tuple]) -> bool:
    """Whether the boxes ``parts`` (offset, shape; inside the box ``offset`` / ``shape``) cover it.

    Blocks cut by one layout are equal or disjoint, so after dropping repeats their volumes add
    up; only pieces of two layouts (holders of a rebuild that failed half-way) can overlap in
    part, and then a mask of the box (one byte an element, for one tensor at a time) decides.
    """
    parts = list(dict.fromkeys(parts))
    disjoint = all(_overlap(*a, *b) is None for i, a in enumerate(parts) for b in parts[i + 1:])
    if disjoint:
        return sum(_volume(s) for _, s in parts) == _volume(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    for o, s in parts:
        mask[tuple(slice(x - y, x - y + n) for x, y, n in zip(o, offset, s))] = True
    return bool(mask.all())


def _param_blocks(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """(names, parameter) for every parameter the optimizer steps."""
    if optimizer is None:
        return []
    names = parameter_names(model)
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def wanted_blocks(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  source_keys: set[str]) -> dict[str, Block]:
    """The blocks of the current layout this rank owns, by the source key that fills each.

    Model entries by name. Optimizer state: each state key the sources hold for a parameter,
    under the first of its names that has it (a tied pair's copies are kept equal, so either
    serves); shaped like the parameter's block, or whole when it is not parameter-shaped (Adam's
    step count): ``plan_requests`` widens those from the source's global shape.
    """
    out = {}
    for name, target in model.state_dict().items():
        shape, offset, local = _block(target)
        out[f"model/{name}"] = (shape, offset, tuple(local.shape))
    for names, p in _param_blocks(model, optimizer):
        shape, offset, local = _block(p)
        taken = set()
        for name in names:
            prefix = f"optim/{name}/"
            for key in sorted(k for k in source_keys if k.startswith(prefix)):
                if key[len(prefix):] not in taken:
                    taken.add(key[len(prefix):])
                    out[key] = (shape, offset, tuple(local.shape))
    return out


def widened(want: Block, global_shape: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of a wanted block, the whole tensor when the source's is not shaped like the
    parameter it was wanted for (Adam's step count: one scalar on every rank)."""
    shape, offset, local = want
    if global_shape is None or tuple(global_shape) == tuple(shape):
        return offset, local
    return (0,) * len(global_shape), tuple(global_shape)


def _rows(offset, shape, bytes_per_row: int, chunk_bytes: int):
    """A box split along its first dimension into parts of at most ``chunk_bytes`` (a row more
    than that stays whole)."""
    if not shape:
        yield offset, shape
        return
    step = max(1, chunk_bytes // max(1, bytes_per_row))
    for start in range(0, shape[0], step):
        n = min(step, shape[0] - start)
        yield (offset[0] + start, *offset[1:]), (n, *shape[1:])


def plan_requests(wants: dict[str, Block], indexes: list[dict[str, tuple[Block, int]]],
                  required: set[str] = frozenset(), chunk_bytes: int = CHUNK_BYTES,
                  ) -> tuple[list[list[list[Request]]], list[str]]:
    """Which parts of which source's pieces fill the blocks ``wants`` (DCP's planner in small).

    For each wanted block, each source block that overlaps it gives the overlap, once: a block a
    source repeats (a replica) comes from the first source that has it. Returns, per source, the
    requests in chunks of at most ``chunk_bytes``, and the keys no source covers whole (those of
    ``wants`` not covered, and those of ``required`` not wanted at all).
    """
    per_source: list[list[tuple[Request, int]]] = [[] for _ in indexes]
    missing = sorted(required - wants.keys())
    for key, (shape, offset, local) in sorted(wants.items()):
        parts, seen = [], set()
        for j, index in enumerate(indexes):
            if key not in index:
                continue
            (src_shape, src_offset, src_local), elem = index[key]
            offset, local = widened((shape, offset, local), src_shape)
            shape = src_shape
            if (src_offset, src_local) in seen:
                continue
            part = _overlap(offset, local, src_offset, src_local)
            if part is None:
                continue
            seen.add((src_offset, src_local))
            parts.append(part)
            row = elem * _volume(part[1][1:])
            per_source[j] += [(Request(key, o, s), row * (s[0] if s else 1))
                              for o, s in _rows(*part, row, chunk_bytes)]
        if not covers(offset, local, parts):
            missing.append(key)
    chunks: list[list[list[Request]]] = []
    for requests in per_source:
        out, size = [], 0
        for request, nbytes in requests:
            if not out or size + nbytes > chunk_bytes:
                out.append([])
                size = 0
            out[-1].append(request)
            size += nbytes
        chunks.append(out)
    return chunks, sorted(set(missing))


def cut(pieces: dict[str, Piece], requests: list[Request]) -> list[tuple[str, Piece]]:
    """The requested parts of ``pieces``, each a copy of just its elements (a view would carry
    its whole storage through the object store)."""
    out = []
    for r in requests:
        piece = pieces[r.key]
        local = tuple(slice(o - p, o - p + n) for o, p, n in zip(r.offset, piece.offset, r.shape))
        out.append((r.key, Piece(piece.global_shape, r.offset, piece.data[local].clone())))
    return out


class Placement:
    """This rank's blocks of the current layout, filled in place as parts of pieces arrive.

    Model entries are copied into the module's own tensors; optimizer state is created per
    parameter on the first part that reaches it (shaped like the parameter, a DTensor where the
    parameter is one; whole when the state is not parameter-shaped), replacing what the
    optimizer held. ``boxes`` records what reached each key, for ``covers``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model_targets = {f"model/{name}": t for name, t in model.state_dict().items()}
        self.optimizer = optimizer
        self.params = {name: p for names, p in _param_blocks(model, optimizer) for name in names}
        self.boxes: dict[str, list[tuple]] = {}
        if optimizer is not None:
            optimizer.state.clear()

    def _target(self, key: str, piece: Piece) -> torch.Tensor | None:
        if key in self.model_targets:
            return self.model_targets[key]
        name, _, sub = key[len("optim/"):].rpartition("/")
        p = self.params.get(name) if key.startswith("optim/") else None
        if p is None:
            return None
        state = self.optimizer.state[p]
        if sub not in state:
            if tuple(piece.global_shape) == tuple(p.shape):
                state[sub] = torch.zeros_like(p)
            else:
                state[sub] = torch.zeros(piece.global_shape, dtype=piece.data.dtype)
        return state[sub]

    @torch.no_grad()
    def take(self, key: str, piece: Piece) -> None:
        """Copy the part of ``piece`` that falls in this rank's block of ``key`` (if any)."""
        target = self._target(key, piece)
        if target is None:
            return
        shape, offset, local = _block(target)
        if tuple(piece.global_shape) != shape:
            raise ValueError(f"{key}: a piece of global shape {piece.global_shape} for a tensor "
                             f"of {shape}: the pieces came from another model")
        part = _overlap(offset, tuple(local.shape), piece.offset, tuple(piece.data.shape))
        if part is None:
            return
        o, s = part
        local[tuple(slice(x - y, x - y + n) for x, y, n in zip(o, offset, s))].copy_(
            piece.data[tuple(slice(x - y, x - y + n) for x, y, n in zip(o, piece.offset, s))])
        self.boxes.setdefault(key, []).append(part)


__all__ = ["Piece", "local_pieces", "assemble", "keys_needed", "load_full_state", "parameter_names",
           "pieces_to_plain", "pieces_from_plain", "piece_index", "wanted_blocks", "plan_requests",
           "cut", "covers", "widened", "Placement", "Request", "CHUNK_BYTES"]
